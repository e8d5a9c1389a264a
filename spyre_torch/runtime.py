"""The cards behind torch's "spyre" device: `$SPYRE_DEVICE_COUNT` of them, each made on first use.

Nothing here runs at `import torch`: the first tensor on "spyre:i" (or the first call that needs
card i) creates its `Runtime`, which imports `device` (Numba) and makes the `Card`. How many
cards there are is `$SPYRE_DEVICE_COUNT` (default 1), read once, the first time it is asked
for (`device_count()`, or the first card): asking makes no card. Each card's size is
`$SPYRE_SERVE_DEVICE_MEMORY` (e.g. `8G`, read by `device.memory.parse_bytes`) or the card's
default of 4 GiB; the arena's pages are only touched when used. With several cards each has
its share of the host's cores, as a tensor-parallel server's cards do (`device.card.
share_cores`: each of its streams runs its kernels on NUMBA_NUM_THREADS // count threads).

Each runtime owns:
- its card, the card's default stream and a pool of side streams (`torch.spyre.Stream()` takes
  the next one round-robin, as torch.cuda takes streams from a pool);
- each host thread's current stream on that card (`torch.spyre.stream(s)` sets it);
- tensor memory: blocks of the card's caching allocator, counted for `memory_allocated(i)`.
  A block whose tensor dies while a stream that used it still has queued work is freed once
  that stream has passed the point where the tensor died (CUDA's caching allocator reuses a
  block only in its stream's order; ours is shared by every stream, so it waits instead);
- one prepared program per (torch op, stream), all of one kernel family sharing its compiled
  entry: a program's launches share its operand table, so two streams never launch the same
  program object.

Each host thread has a current card (`set_device(i)`, 0 to begin with, as CUDA's current
device is the thread's); an op runs on its tensors' card (ops/devices.py switches the thread's
current card for the op's duration), so `runtime()` inside an op is that card's.
"""

from __future__ import annotations

import collections
import os
import threading

MEMORY_ENV = "SPYRE_SERVE_DEVICE_MEMORY"
COUNT_ENV = "SPYRE_DEVICE_COUNT"
MAX_CARDS = 128  # torch's device index is an int8
SIDE_STREAMS = 8  # side streams in the pool (torch.cuda has 32 per priority)

_lock = threading.Lock()
_runtimes: dict[int, Runtime] = {}
_count: list[int] = []  # $SPYRE_DEVICE_COUNT, once read
_tls = threading.local()  # .device: this host thread's current card


def device_count() -> int:
    """`$SPYRE_DEVICE_COUNT` (default 1), read and checked the first time it is asked for."""
    if _count:
        return _count[0]
    raw = os.environ.get(COUNT_ENV, "1")
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_CARDS:
        raise RuntimeError(f"spyre: ${COUNT_ENV} must be a whole number of cards from 1 to "
                           f"{MAX_CARDS}, got {raw!r}")
    _count.append(n)
    return n


def check_index(index: int) -> int:
    """`index` if there is such a card, else torch.cuda's "invalid device ordinal" with the count."""
    n = device_count()
    if not 0 <= index < n:
        raise RuntimeError(f"spyre: invalid device ordinal {index}: there {'is' if n == 1 else 'are'} "
                           f"{n} card{'' if n == 1 else 's'} (spyre:0 to spyre:{n - 1}; ${COUNT_ENV}={n})")
    return index


def current_index() -> int:
    """This host thread's current card (0 until set_device)."""
    return getattr(_tls, "device", 0)


def set_current_index(index: int) -> None:
    _tls.device = check_index(index)


def swap_index(index: int) -> int:
    """Make `index` this thread's current card (unchecked: an op's own tensors' card); returns
    the one it replaces."""
    prev = getattr(_tls, "device", 0)
    _tls.device = index
    return prev


def index_of(device) -> int:
    """The card index of `device` (None, an int, "spyre", "spyre:1", a torch.device), checked;
    None and a bare "spyre" are this thread's current card."""
    if device is None:
        return current_index()
    if isinstance(device, int):
        return check_index(device)
    import torch

    d = torch.device(device)
    if d.type != "spyre":
        raise ValueError(f"spyre: expected a spyre device, got {d}")
    return current_index() if d.index is None else check_index(d.index)


class on_card:  # noqa: N801 - a context manager, named as one
    """`with on_card(i):` card i is this thread's current card inside the block."""

    def __init__(self, index: int):
        self.index = index

    def __enter__(self):
        self.prev = swap_index(self.index)
        return self

    def __exit__(self, *exc) -> None:
        swap_index(self.prev)


def runtime(index: int | None = None) -> Runtime:
    """Card `index`'s runtime (this thread's current card by default), made on first use."""
    rt = _runtimes.get(getattr(_tls, "device", 0) if index is None else index)
    if rt is None:
        rt = _create(current_index() if index is None else index)
    elif rt.pid != os.getpid():
        raise RuntimeError("spyre: the card was made in the parent process; a forked child "
                           "has no copy of its streams (use the 'spawn' start method, or make "
                           "the card only in the child)")
    return rt


def initialized(index: int | None = None) -> bool:
    """Whether card `index` was made (any card: None)."""
    return bool(_runtimes) if index is None else index in _runtimes


def made() -> list[Runtime]:
    """The runtimes made so far, by card index."""
    return [_runtimes[i] for i in sorted(_runtimes)]


def in_bad_fork() -> bool:
    """True in a process forked after a card was made (torch.cuda's notion)."""
    return any(rt.pid != os.getpid() for rt in list(_runtimes.values()))


def _create(index: int) -> Runtime:
    check_index(index)
    with _lock:
        if index not in _runtimes:
            _runtimes[index] = Runtime(index, device_count())
        return _runtimes[index]


class Runtime:
    def __init__(self, index: int = 0, cards: int = 1):
        import torch

        from spyre_serve.device import Card
        from spyre_serve.device.card import DEFAULT_MEMORY_BYTES
        from spyre_serve.device.memory import DeviceOutOfMemory, parse_bytes

        size = os.environ.get(MEMORY_ENV)
        self.index = index
        self.cards = cards
        self.card = Card(parse_bytes(size) if size else DEFAULT_MEMORY_BYTES)
        self.pid = os.getpid()
        self.device = torch.device("spyre", index)
        self.default_stream = self._share(self.card.default_stream)
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
                self._side.append(self._share(self.card.new_stream(f"torch-{i}")))
            return self._side[i]

    def _share(self, stream):
        """`stream`, its kernels on this card's share of the host's cores (one card: all)."""
        if self.cards > 1:
            from spyre_serve.device.card import share_cores

            share_cores(stream, self.cards)
        return stream

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
                raise self._torch_oom(f"spyre:{self.index}: {e}") from e
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
