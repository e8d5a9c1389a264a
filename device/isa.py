"""Which vector ISA the card's kernels are compiled for: the host's best level, or a lower one
forced by SPYRE_KERNEL_ISA, chosen once per process before Numba compiles anything.

    level         the CPU features it needs (LLVM's names)            LLVM CPU when forced
    avx2          avx2, fma, f16c                                        haswell
    avx512        + avx512f, avx512bw, avx512dq, avx512vl                skylake-avx512
    avx512_vnni   + avx512vnni                                           cascadelake
    avx512_bf16   + avx512bf16                                           cooperlake
    amx           + amx-tile, amx-bf16 (and the kernel's leave to use them)  sapphirerapids

The host's level is the highest whose features llvmlite reports for this CPU; unforced, Numba
compiles for the host itself (all its features). SPYRE_KERNEL_ISA names a level at or below
the host's: Numba then compiles for that level's CPU (NUMBA_CPU_NAME), so every path below
the host's can be run and tested on it; above the host's is refused, naming both. The
compile cache is keyed by the level too (device/cache.py), so code compiled for one level is
never loaded for another. What the kernels do with each level: device/kernels/simd.py.

AMX's tile registers are state Linux hands a process only when asked (arch_prctl
ARCH_REQ_XCOMP_PERM for XTILEDATA); the host reaches the amx level only once that was
granted, and `current()` asks for it before anything compiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LEVELS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx512vnni",),
    "avx512_bf16": ("avx512bf16",),
    "amx": ("amx-tile", "amx-bf16"),
}
_CPU_NAME = {"avx2": "haswell", "avx512": "skylake-avx512", "avx512_vnni": "cascadelake",
             "avx512_bf16": "cooperlake", "amx": "sapphirerapids"}
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


def host_level(features: dict[str, bool], amx_granted: bool = True) -> str:
    """The highest level all of whose features (and those below it) are present (amx: and
    the kernel granted the tile state)."""
    best = None
    for level in LEVELS:
        if not all(features.get(f, False) for f in _NEEDS[level]):
            break
        if level == "amx" and not amx_granted:
            break
        best = level
    if best is None:
        missing = [f for f in _NEEDS["avx2"] if not features.get(f, False)]
        raise ISAError(f"the card's kernels need AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}")
    return best


def choose(features: dict[str, bool], cpu: str, requested: str | None,
           amx_granted: bool = True) -> KernelISA:
    """The level for a host with `features`, and SPYRE_KERNEL_ISA's value (None: unset)."""
    best = host_level(features, amx_granted)
    if not requested:
        return KernelISA(best, best, cpu, forced=False)
    level = requested.strip().lower()
    if level not in LEVELS:
        raise ISAError(f"{ENV}={requested!r} is not one of {', '.join(LEVELS)}")
    if LEVELS.index(level) > LEVELS.index(best):
        raise ISAError(f"{ENV}={level} is above what this CPU ({cpu}) runs: at most {best}")
    return KernelISA(level, best, cpu, forced=level != best)


_SELECTED: KernelISA | None = None
_ARCH_REQ_XCOMP_PERM = 0x1023   # linux/arch/x86/include/uapi/asm/prctl.h
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158           # x86_64


def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process (every thread); True when granted."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False



def current() -> KernelISA:
    """This process's level: chosen on the first call, which also points Numba's code
    generation at it, so it must come before Numba compiles anything (device/process.py
    calls it first thing)."""
    global _SELECTED
    if _SELECTED is None:
        import llvmlite.binding as ll

        features = dict(ll.get_host_cpu_features())
        granted = all(features.get(f, False) for f in _NEEDS["amx"]) and request_amx()
        isa = choose(features, ll.get_host_cpu_name(), os.environ.get(ENV), granted)
        if isa.forced:
            import numba

            numba.config.CPU_NAME = _CPU_NAME[isa.level]
            numba.config.CPU_FEATURES = ""
        _SELECTED = isa
    return _SELECTED
