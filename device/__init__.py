"""The emulated Spyre card: memory, allocator, streams, events, programs, kernels.

Knows bytes, addresses and kernels; nothing of language models. See README.md
in this folder for the call-by-call map to CUDA/torch.
"""

import os

# Idle OpenMP workers spin for a short while, then sleep (unless the user chose a policy).
# Every kernel of a step is a parallel region on every core (models/threads.py): with
# OMP_WAIT_POLICY=PASSIVE each region woke a sleeping thread (~90 us a region here, ~30 regions
# a layer); libgomp's default spins 300k iterations. 1e5 spins keep a region at ~2 us while a
# step runs and let the worker sleep between steps, where the host needs the core. SmolLM2-135M
# shape, one process per setting: decode b32 189 -> 113 ms, b1 32 -> 23 ms, prefill 512 1770
# -> 1056 ms against PASSIVE (and the old serial policy). OpenBLAS's pool, which used to spin
# beside it, no longer runs during a step (BLAS is on one thread there).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")
# The same for OpenBLAS's pool: its idle workers spin (sched_yield) for 2**28 cycles after a
# GEMM by default, through the Numba kernels that follow it; 2**4 puts them to sleep at once.
# granite-tiny 512-token prefill, same process, interleaved: 157-159 ms -> 139-153 ms, with
# OpenBLAS's spinning at 14% of CPU samples before (perf) and gone after. Beside a busy
# process of the same priority (`yes`): prefill 312-331 -> 273-288 ms, batch-32 decode step
# 59-60 -> 39-41 ms.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numba  # noqa: E402

# Numba's default "workqueue" threading layer aborts when parallel kernels run from
# two threads at once; every stream is a thread, so pick a thread-safe layer (omp here)
# unless the user chose one.
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
    "STICK", "AllocatorStats", "CachingAllocator", "Card", "Compute", "Counters", "D2H",
    "DeviceCommandError", "DeviceError", "DeviceOutOfMemory", "DeviceTensor", "Event", "H2D",
    "HostCompute", "JobPlan", "LaunchHandle", "Program", "Slot", "Stream",
]
