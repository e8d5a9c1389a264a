"""`torch.spyre`: the device module of the emulated card, mirroring `torch.cuda`.

    torch.spyre.is_available(), device_count(), current_device(), set_device(0)
    torch.spyre.get_device_properties()       # name, cores, total_memory
    torch.spyre.synchronize(), manual_seed(s)
    torch.spyre.Stream / Event / stream(s) / current_stream() / default_stream()
    torch.spyre.memory_allocated() / max_memory_allocated() / memory_reserved() /
               empty_cache() / memory_stats() / mem_get_info() / reset_peak_memory_stats()
    torch.spyre.fallback_counts()             # op -> calls that ran on the CPU
    torch.spyre.counters()                    # the card's: launches, compiles, bytes copied...

Every function here is cheap until the card is needed: asking whether a card is there, or
how much memory tensors hold, does not make one (0 before the first spyre tensor).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

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
    runtime()


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def _index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        if d.type != "spyre":
            raise ValueError(f"spyre: expected a spyre device, got {d}")
        index = d.index or 0
    if index != 0:
        raise RuntimeError(f"spyre: there is one card (index 0); got index {index}")
    return index


def set_device(device) -> None:
    _index(device)


class device:  # noqa: N801 - torch.cuda.device's name
    """`with torch.spyre.device(0):` (there is one card)."""

    def __init__(self, device):
        _index(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def get_device_name(device=None) -> str:
    _index(device)
    return NAME


def get_device_properties(device=None) -> SpyreDeviceProperties:
    _index(device)
    from spyre_serve.device.memory import STICK

    card = runtime().card
    return SpyreDeviceProperties(NAME, card.cores, card.capacity, STICK)


def get_device_capability(device=None) -> tuple[int, int]:
    return (1, 0)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes torch.autocast may use on the card (it computes in float32 and casts)."""
    return [torch.float32]


def counters() -> dict:
    """The card's counters (device.Counters): compiles, prepares, launches, bytes patched,
    host and compute seconds, bytes copied each way; empty before the card exists."""
    return runtime().card.counters.snapshot() if initialized() else {}


def card():
    """The device.Card behind "spyre" (made if need be): for tools such as spyre-smi."""
    return runtime().card


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
