"""The emulated Spyre card: memory, allocator, streams, events, programs, kernels.

Knows bytes, addresses and kernels; nothing of language models. See README.md
in this folder for the call-by-call map to CUDA/torch.
"""

import os

# Numba's parallel kernels run on Intel TBB (the `tbb` wheel, a dependency) when it loads, else on
# OpenMP. Every kernel of a step is a parallel loop on every core (models/threads.py), ~30 a
# layer. TBB's workers spin briefly and then sleep, and a thread that is running takes the
# chunks of one that is not (work stealing), where OpenMP's static split waits for it. SmolLM2-135M
# shape, decode step ms (batch 1 / batch 32), one process per setting, on an idle machine and
# beside one busy process:
#     OpenMP, OMP_WAIT_POLICY=PASSIVE      56 / 151      idle     39-41 / 172-182   busy
#     OpenMP, GOMP_SPINCOUNT=1e4           22 / 115               158 / 387
#     OpenMP, GOMP_SPINCOUNT=1e5           23 / 118               > 80 s for the run
#     TBB                                  22-26 / 111-120        33 / 189
# The tbb wheel puts libtbb.so.12 in <prefix>/lib, which the loader does not search: load it
# here, before Numba opens its TBB pool. Without TBB, OpenMP's idle workers sleep (PASSIVE),
# slower on an idle machine but never the 10-100x of spinning beside another process.


def _load_tbb() -> bool:
    import ctypes
    import sys

    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(lib):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                pass
    return False


if not _load_tbb():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The same for OpenBLAS's pool: its idle workers spin (sched_yield) for 2**28 cycles after a
# GEMM by default, through the Numba kernels that follow it; 2**4 puts them to sleep at once.
# granite-tiny 512-token prefill, same process, interleaved: 157-159 ms -> 139-153 ms, with
# OpenBLAS's spinning at 14% of CPU samples before (perf) and gone after. Beside a busy
# process of the same priority (`yes`): prefill 312-331 -> 273-288 ms, batch-32 decode step
# 59-60 -> 39-41 ms.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numba  # noqa: E402

from device.isa import current as _kernel_isa  # noqa: E402

# The vector ISA the kernels are compiled for (the host's best, or SPYRE_KERNEL_ISA's lower
# level), chosen before anything compiles: device/isa.py.
KERNEL_ISA = _kernel_isa()

# Numba's default "workqueue" threading layer aborts when parallel kernels run from
# two threads at once; every stream is a thread, so pick a thread-safe layer (tbb, loaded
# above, else omp) unless the user chose one.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "threadsafe"  # tbb or omp, whichever is installed

from pathlib import Path  # noqa: E402

from device.cache import use_source_keyed_cache  # noqa: E402

# Compiled kernels are cached on disk under a key of this package's sources (device/cache.py):
# before any kernel module is imported, since Numba fixes a function's cache when decorating it.
use_source_keyed_cache(Path(__file__).parent)

from device.allocator import AllocatorStats, CachingAllocator  # noqa: E402
from device.card import Card  # noqa: E402
from device.counters import Counters  # noqa: E402
from device.event import Event  # noqa: E402
from device.memory import STICK, DeviceError, DeviceOutOfMemory, DeviceTensor  # noqa: E402
from device.program import (  # noqa: E402
    D2H,
    H2D,
    Compute,
    HostCompute,
    JobPlan,
    LaunchHandle,
    Program,
    Slot,
)
from device.stream import DeviceCommandError, Stream  # noqa: E402

__all__ = [
    "KERNEL_ISA", "STICK", "AllocatorStats", "CachingAllocator", "Card", "Compute", "Counters", "D2H",
    "DeviceCommandError", "DeviceError", "DeviceOutOfMemory", "DeviceTensor", "Event", "H2D",
    "HostCompute", "JobPlan", "LaunchHandle", "Program", "Slot", "Stream",
]
