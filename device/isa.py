"""Which vector ISA the card's kernels are compiled for: the host's best level, or a lower one
forced by SPYRE_KERNEL_ISA, chosen once per process before Numba compiles anything.

    level         the CPU features it needs (LLVM's names)            LLVM CPU when forced
    avx2          avx2, fma, f16c                                        haswell
    avx512        + avx512f, avx512bw, avx512dq, avx512vl                skylake-avx512
    avx512_vnni   + avx512vnni                                           cascadelake
    avx512_bf16   + avx512bf16                                           cooperlake

The host's level is the highest whose features llvmlite reports for this CPU; unforced, Numba
compiles for the host itself (all its features). SPYRE_KERNEL_ISA names a level at or below
the host's: Numba then compiles for that level's CPU (NUMBA_CPU_NAME), so every path below
the host's can be run and tested on it; above the host's is refused, naming both. The
compile cache is keyed by the level too (device/cache.py), so code compiled for one level is
never loaded for another. What the kernels do with the level: device/kernels/microkernel.py
(integer dot products for the 8- and 4-bit weights need avx2's vpmaddubsw).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LEVELS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16")
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx512vnni",),
    "avx512_bf16": ("avx512bf16",),
}
_CPU_NAME = {"avx2": "haswell", "avx512": "skylake-avx512", "avx512_vnni": "cascadelake",
             "avx512_bf16": "cooperlake"}
ENV = "SPYRE_KERNEL_ISA"


class ISAError(RuntimeError):
    """An ISA level the host cannot run, or a host below the lowest level."""


@dataclass(frozen=True, slots=True)
class KernelISA:
    level: str               # one of LEVELS: what the kernels are compiled for
    host_level: str          # the best this CPU runs
    cpu: str                 # LLVM's name of the host CPU ("znver4", ...)
    forced: bool             # chosen by SPYRE_KERNEL_ISA

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def describe(self) -> str:
        how = f"forced by {ENV}" if self.forced else "the host's best"
        return f"{self.level} ({how}; host {self.cpu}, up to {self.host_level})"


def host_level(features: dict[str, bool]) -> str:
    """The highest level all of whose features (and those below it) are present."""
    best = None
    for level in LEVELS:
        if not all(features.get(f, False) for f in _NEEDS[level]):
            break
        best = level
    if best is None:
        missing = [f for f in _NEEDS["avx2"] if not features.get(f, False)]
        raise ISAError(f"the card's kernels need AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}")
    return best


def choose(features: dict[str, bool], cpu: str, requested: str | None) -> KernelISA:
    """The level for a host with `features`, and SPYRE_KERNEL_ISA's value (None: unset)."""
    best = host_level(features)
    if not requested:
        return KernelISA(best, best, cpu, forced=False)
    level = requested.strip().lower()
    if level not in LEVELS:
        raise ISAError(f"{ENV}={requested!r} is not one of {', '.join(LEVELS)}")
    if LEVELS.index(level) > LEVELS.index(best):
        raise ISAError(f"{ENV}={level} is above what this CPU ({cpu}) runs: at most {best}")
    return KernelISA(level, best, cpu, forced=level != best)


_SELECTED: KernelISA | None = None


def current() -> KernelISA:
    """This process's level: chosen on the first call, which also points Numba's code
    generation at it, so it must come before Numba compiles anything (device/process.py
    calls it first thing)."""
    global _SELECTED
    if _SELECTED is None:
        import llvmlite.binding as ll

        isa = choose(dict(ll.get_host_cpu_features()), ll.get_host_cpu_name(), os.environ.get(ENV))
        if isa.forced:
            import numba

            numba.config.CPU_NAME = _CPU_NAME[isa.level]
            numba.config.CPU_FEATURES = ""
        _SELECTED = isa
    return _SELECTED
