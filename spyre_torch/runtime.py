"""The card behind torch's "spyre" device: made on first use, one per process.

Nothing here runs at `import torch`: the first tensor on "spyre" (or the first call that needs
the card) creates the `Runtime`, which imports `device` (Numba) and makes the `Card`. Its size
is `$SPYRE_SERVE_DEVICE_MEMORY` (e.g. `8G`, read by `device.memory.parse_bytes`) or the card's
default of 4 GiB; the arena's pages are only touched when used.

The runtime owns:
- the card, its default stream and a pool of side streams (`torch.spyre.Stream()` takes the
  next one round-robin, as torch.cuda takes streams from a pool);
- each host thread's current stream (`torch.spyre.stream(s)` sets it);
- tensor memory: blocks of the card's caching allocator, counted for `memory_allocated()`.
  A block whose tensor dies while a stream that used it still has queued work is freed once
  that stream has passed the point where the tensor died (CUDA's caching allocator reuses a
  block only in its stream's order; ours is shared by every stream, so it waits instead);
- one prepared program per (torch op, stream), all of one kernel family sharing its compiled
  entry: a program's launches share its operand table, so two streams never launch the same
  program object.
"""

from __future__ import annotations

import collections
import os
import threading

MEMORY_ENV = "SPYRE_SERVE_DEVICE_MEMORY"
SIDE_STREAMS = 8  # side streams in the pool (torch.cuda has 32 per priority)

_lock = threading.Lock()
_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The process's runtime, made (card and all) on the first call."""
    rt = _runtime
    if rt is None:
        rt = _create()
    elif rt.pid != os.getpid():
        raise RuntimeError("spyre: the card was made in the parent process; a forked child "
                           "has no copy of its streams (use the 'spawn' start method, or make "
                           "the card only in the child)")
    return rt


def initialized() -> bool:
    return _runtime is not None


def in_bad_fork() -> bool:
    """True in a process forked after the card was made (torch.cuda's notion)."""
    return _runtime is not None and _runtime.pid != os.getpid()


def _create() -> Runtime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


class Runtime:
    def __init__(self):
        import torch

        from spyre_serve.device import Card
        from spyre_serve.device.card import DEFAULT_MEMORY_BYTES
        from spyre_serve.device.memory import DeviceOutOfMemory, parse_bytes

        size = os.environ.get(MEMORY_ENV)
        self.card = Card(parse_bytes(size) if size else DEFAULT_MEMORY_BYTES)
        self.pid = os.getpid()
        self.default_stream = self.card.default_stream
        self._side: list = []
        self._next_side = 0
        self._tls = threading.local()
        self._oom = DeviceOutOfMemory
        self._torch_oom = torch.OutOfMemoryError
        # tensor memory: live blocks (address -> (bytes, streams that used it)), tallies
        self._mem = threading.Lock()
        self._blocks: dict[int, tuple[int, list]] = {}
        self._pending: collections.deque = collections.deque()  # (address, [(stream, position)])
        self.allocated = 0      # bytes of live tensor blocks
        self.peak = 0
        self.count = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.num_ooms = 0
        self.num_deferred = 0   # frees that waited for a stream
        self.programs: dict = {}
        self._programs_lock = threading.Lock()

    # streams --------------------------------------------------------------------
    def current_stream(self):
        return getattr(self._tls, "stream", None) or self.default_stream

    def set_current_stream(self, stream) -> None:
        self._tls.stream = stream

    def side_stream(self):
        """The next stream of the pool (created on first use)."""
        with self._programs_lock:
            i = self._next_side % SIDE_STREAMS
            self._next_side += 1
            if i == len(self._side):
                self._side.append(self.card.new_stream(f"torch-{i}"))
            return self._side[i]

    def stream_id(self, stream) -> int:
        """torch's id of a stream: 0 the default stream, i + 1 the pool's i-th."""
        return 0 if stream is self.default_stream else self._side.index(stream) + 1

    def stream_of(self, stream_id: int):
        return self.default_stream if stream_id == 0 else self._side[stream_id - 1]

    def synchronize(self) -> None:
        self.card.synchronize()
        self.collect(everything=True)

    # memory ---------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Address of a new block for a tensor of `nbytes` on the current stream."""
        self.collect()
        allocator = self.card.allocator
        try:
            addr = allocator.malloc(nbytes)
        except self._oom:
            self.synchronize()  # blocks waiting on streams become free once they are idle
            try:
                addr = allocator.malloc(nbytes)
            except self._oom as e:
                with self._mem:
                    self.num_ooms += 1
                raise self._torch_oom(f"spyre: {e}") from e
        size = allocator.size_of(addr)
        with self._mem:
            self._blocks[addr] = (size, [self.current_stream()])
            self.allocated += size
            self.peak = max(self.peak, self.allocated)
            self.count += 1
            self.num_allocs += 1
        return addr

    def record_stream(self, addr: int, stream) -> None:
        """The block at `addr` is used on `stream` too: its free waits for that stream as well."""
        with self._mem:
            streams = self._blocks[addr][1]
            if stream not in streams:
                streams.append(stream)

    def release(self, addr: int) -> None:
        """The tensor storage at `addr` died (called by its finalizer, on any thread)."""
        with self._mem:
            size, streams = self._blocks.pop(addr)
            self.allocated -= size
            self.count -= 1
            self.num_frees += 1
            busy = [(s, s.position) for s in streams]
            busy = [(s, p) for s, p in busy if not s.reached(p)]
            if busy:
                self.num_deferred += 1
                self._pending.append((addr, busy))
                return
        self.card.allocator.free(addr)

    def collect(self, everything: bool = False) -> None:
        """Free the deferred blocks whose streams have passed them (all of them, in order of
        death, up to the first still waiting; `everything`: look at every one)."""
        if not self._pending:
            return
        free = []
        with self._mem:
            if everything:
                keep = collections.deque()
                for addr, busy in self._pending:
                    (free if all(s.reached(p) for s, p in busy) else keep).append((addr, busy))
                self._pending = keep
                free = [a for a, _ in free]
            else:
                while self._pending and all(s.reached(p) for s, p in self._pending[0][1]):
                    free.append(self._pending.popleft()[0])
        for addr in free:
            self.card.allocator.free(addr)

    @property
    def pending_frees(self) -> int:
        return len(self._pending)

    def reset_peak(self) -> None:
        with self._mem:
            self.peak = self.allocated
        self.card.allocator.reset_peak()

    # programs -------------------------------------------------------------------
    def program(self, op: str, kernel: str, stream):
        """The prepared program of torch op `op` (running entry `kernel`) for `stream`."""
        key = (op, kernel, stream)
        prog = self.programs.get(key)
        if prog is None:
            from spyre_torch import kernels

            with self._programs_lock:
                prog = self.programs.get(key)
                if prog is None:
                    prog = kernels.program(self.card, op, kernel, stream)
                    self.programs[key] = prog
        return prog
