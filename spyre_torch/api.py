"""`torch.spyre`: the device module of the emulated cards, mirroring `torch.cuda`.

    torch.spyre.is_available(), device_count(), current_device(), set_device(1), device(1)
    torch.spyre.get_device_properties(i)      # name, cores, total_memory
    torch.spyre.synchronize(i), manual_seed(s)
    torch.spyre.Stream(device=i) / Event / stream(s) / current_stream(i) / default_stream(i)
    torch.spyre.memory_allocated(i) / max_memory_allocated(i) / memory_reserved(i) /
               empty_cache() / memory_stats(i) / mem_get_info(i) / reset_peak_memory_stats(i)
    torch.spyre.fallback_counts()             # op -> calls that ran on the CPU
    torch.spyre.counters(i)                   # card i's: launches, compiles, bytes copied...

How many cards: `$SPYRE_DEVICE_COUNT` (default 1; a whole number from 1 to 128, else
RuntimeError naming the value), read once per process, the first time it is asked for. Each
card ("spyre:0", "spyre:1", ...) has its own arena, caching allocator, streams and counters,
and is made on first use; an index past the last is torch.cuda's "invalid device ordinal"
(naming the count). `i` above is an int, "spyre:i" or a torch.device; left out (or a bare
"spyre"), it is the current card: this host thread's, 0 until `set_device`. torch itself
resolves a bare "spyre" in `Tensor.to("spyre")`, `torch.tensor(..., device="spyre")` and
`Module.to("spyre")` to spyre:0 whatever the current card (its Python-backend device guard
answers 0), while `torch.empty(..., device="spyre")` and `Tensor.spyre()` follow
`set_device`: name the card ("spyre:1") where it matters. For the same reason (one device as
torch's C++ sees it) torch's autograd engine has one device queue: a backward pass through
tensors of spyre:1 and up fails inside torch; card 0's works.

Every function here is cheap until a card is needed: asking whether a card is there, how many
there are, or how much memory tensors hold, does not make one (0 before its first tensor).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from spyre_torch import runtime as _runtime
from spyre_torch.memory import (  # noqa: F401 - the module's API
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
)
from spyre_torch.ops.fallback import counts as fallback_counts  # noqa: F401
from spyre_torch.ops.fallback import reset_counts as reset_fallback_counts  # noqa: F401
from spyre_torch.ops.fallback import set_enabled as set_cpu_fallback  # noqa: F401
from spyre_torch.runtime import in_bad_fork, initialized, runtime
from spyre_torch.streams import (  # noqa: F401
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_stream,
    stream,
    synchronize,
)

NAME = "Spyre (emulated)"


@dataclass(frozen=True)
class SpyreDeviceProperties:
    name: str
    cores: int
    total_memory: int
    stick_bytes: int

    @property
    def multi_processor_count(self) -> int:  # torch.cuda's name for the cores
        return self.cores


def is_available() -> bool:
    """The emulated card is always there."""
    return True


def is_initialized() -> bool:
    """True once the card has been made (by the first spyre tensor, stream or event)."""
    return initialized()


def _is_in_bad_fork() -> bool:
    return in_bad_fork()


def init() -> None:
    """Make the current card."""
    runtime()


def device_count() -> int:
    """`$SPYRE_DEVICE_COUNT` (default 1), without making a card."""
    return _runtime.device_count()


def current_device() -> int:
    """This host thread's current card."""
    return _runtime.current_index()


def set_device(device) -> None:
    """Make `device` (an index, "spyre:i", a torch.device) this host thread's current card;
    a negative index changes nothing (as torch.cuda's)."""
    if isinstance(device, int) and device < 0:
        return
    _runtime.set_current_index(_runtime.index_of(device))


class device:  # noqa: N801 - torch.cuda.device's name
    """`with torch.spyre.device(1):` card 1 is the current card inside the block (None or a
    negative index: unchanged)."""

    def __init__(self, device):
        if device is None or (isinstance(device, int) and device < 0):
            self.idx = -1
        else:
            self.idx = _runtime.index_of(device)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev_idx = _runtime.swap_index(self.idx)
        return self

    def __exit__(self, *exc):
        if self.idx >= 0:
            _runtime.swap_index(self.prev_idx)
        return False


def get_device_name(device=None) -> str:
    _runtime.index_of(device)
    return NAME


def get_device_properties(device=None) -> SpyreDeviceProperties:
    from spyre_serve.device.memory import STICK

    card = runtime(_runtime.index_of(device)).card
    return SpyreDeviceProperties(NAME, card.cores, card.capacity, STICK)


def get_device_capability(device=None) -> tuple[int, int]:
    return (1, 0)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes torch.autocast may use on the card (it computes in float32 and casts)."""
    return [torch.float32]


def counters(device=None) -> dict:
    """The card's counters (device.Counters): compiles, prepares, launches, bytes patched,
    host and compute seconds, bytes copied each way; empty before the card exists."""
    index = _runtime.index_of(device)
    return runtime(index).card.counters.snapshot() if initialized(index) else {}


def card(device=None):
    """The device.Card behind "spyre:i" (made if need be): for tools such as spyre-smi."""
    return runtime(_runtime.index_of(device)).card


def warmup() -> None:
    """Compile (or load from Numba's disk cache) every card kernel now, so that no op compiles
    later: the programs the ops of one stream use are prepared on first use, then reused."""
    from spyre_torch import kernels

    rt = runtime()
    for name in kernels.SPECS:
        rt.program(f"warmup:{name}", name, rt.default_stream)


# ---- random numbers: ops without a card kernel sample on the host with this generator ----------
_rng_lock = threading.Lock()
_rng: dict = {}


def generator() -> torch.Generator:
    """The generator of the card's random ops (which run on the CPU: see ops/fallback.py)."""
    with _rng_lock:
        if "g" not in _rng:
            g = torch.Generator()
            g.manual_seed(torch.initial_seed())
            _rng["g"] = g
        return _rng["g"]


def manual_seed(seed: int) -> None:
    generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    generator().seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return generator().initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return generator().get_state()


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    generator().set_state(new_state)
