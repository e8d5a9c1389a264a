"""Card: one emulated Spyre card: a memory arena, an allocator, streams, counters.

The arena is one `np.uint8` buffer whose base is 128-byte aligned; an address
is a byte offset into it. `f32`, `i32`, `i64` and `u16` view the same bytes
as other dtypes, so a kernel given the four views and an address can reach
any tensor (see device/abi.py).
"""

from __future__ import annotations

import threading

import numpy as np

from spyre_serve.device.allocator import AllocatorStats, CachingAllocator
from spyre_serve.device.counters import Counters
from spyre_serve.device.memory import STICK, DeviceError, DeviceTensor
from spyre_serve.device.process import configure_runtime
from spyre_serve.device.stream import DEFAULT_DEPTH, Stream

# 4 GiB: fits the machines we run on; pages are only touched when used. The card reads no
# environment: the server's --device-memory ($SPYRE_SERVE_DEVICE_MEMORY) sizes it from above.
DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_CORES = 32  # Spyre has 32 AI cores


def share_cores(stream: Stream, cards: int) -> None:
    """`stream`'s kernels run on one card's share of the host's cores when `cards` cards share
    the host: NUMBA_NUM_THREADS // cards threads (at least one). Numba's thread count belongs to
    a host thread, and each stream is one: the setting is a command on the stream."""
    import numba

    threads = max(1, numba.config.NUMBA_NUM_THREADS // cards)
    stream.enqueue(numba.set_num_threads, threads, compute=False, label="card_threads")


class Card:
    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES, cores: int = DEFAULT_CORES,
                 stream_depth: int = DEFAULT_DEPTH):
        configure_runtime()   # threads and ISA, when no entry point configured the process
        if memory_bytes <= 0:
            raise DeviceError(f"card memory must be positive, got {memory_bytes} bytes")
        if cores < 1:
            raise DeviceError(f"a card needs at least one core, got {cores}")
        capacity = -(-int(memory_bytes) // STICK) * STICK  # whole sticks
        raw = np.zeros(capacity + STICK, dtype=np.uint8)  # zero pages are mapped lazily by the OS
        skip = (-raw.ctypes.data) % STICK
        self.memory = raw[skip:skip + capacity]  # uint8[capacity], base 128-byte aligned
        self.f32 = self.memory.view(np.float32)
        self.i32 = self.memory.view(np.int32)
        self.i64 = self.memory.view(np.int64)
        self.u16 = self.memory.view(np.uint16)
        self.capacity = capacity
        self.cores = cores
        self.stream_depth = stream_depth
        self.allocator = CachingAllocator(capacity)
        self.counters = Counters()
        self.compute_lock = threading.Lock()  # one set of cores: one compute command at a time
        self._streams: list[Stream] = []
        self._streams_lock = threading.Lock()
        self.default_stream = self.new_stream("default")

    def __repr__(self) -> str:
        s = self.allocator.stats()
        return f"Card({self.capacity} bytes, {self.cores} cores, {s.allocated} allocated, {len(self._streams)} streams)"

    def __enter__(self) -> Card:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # memory -------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> DeviceTensor:
        """A new tensor (contents unspecified), 128-byte aligned."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype)
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        return DeviceTensor(self.allocator.malloc(n), shape, dtype, self)

    def zeros(self, shape, dtype=np.float32) -> DeviceTensor:
        t = self.empty(shape, dtype)
        t.numpy().fill(0)
        return t

    def free(self, tensor_or_address) -> None:
        """Free a tensor's block (by tensor or address); double free / foreign address -> DeviceError."""
        if isinstance(tensor_or_address, DeviceTensor):
            if tensor_or_address.card is not None and tensor_or_address.card is not self:
                raise DeviceError(f"free: tensor at {tensor_or_address.address} belongs to another card")
            addr = tensor_or_address.address
        else:
            addr = int(tensor_or_address)
        self.allocator.free(addr)

    def memory_stats(self) -> AllocatorStats:
        return self.allocator.stats()

    # streams ------------------------------------------------------------------
    def new_stream(self, name: str = "stream", depth: int | None = None) -> Stream:
        s = Stream(self, name, depth or self.stream_depth)
        with self._streams_lock:
            self._streams.append(s)
        return s

    @property
    def streams(self) -> list[Stream]:
        with self._streams_lock:
            return list(self._streams)

    def synchronize(self) -> None:
        """Wait for every stream; then re-raise the first failure found (streams in creation order)."""
        streams = self.streams
        targets = [s.position for s in streams]
        for s, t in zip(streams, targets, strict=True):
            s.wait_until(t)
        for s, t in zip(streams, targets, strict=True):
            s.raise_failures(t)

    def close(self) -> None:
        """Finish all pending commands and stop the stream threads."""
        for s in self.streams:
            s.close()
