"""The emulated Spyre card: memory, allocator, streams, events, programs, kernels.

Knows bytes, addresses and kernels; nothing of language models. See README.md
in this folder for the call-by-call map to CUDA/torch.
"""

import os

import numba

# Numba's default "workqueue" threading layer aborts when parallel kernels run from
# two threads at once; every stream is a thread, so pick a thread-safe layer (omp here)
# unless the user chose one.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "threadsafe"  # tbb or omp, whichever is installed

# Worker-thread waiting is left at the runtimes' defaults on purpose. OMP_WAIT_POLICY=PASSIVE
# (alone, and with OPENBLAS_THREAD_TIMEOUT=4) was measured on granite-tiny, 2 shared cores,
# in alternating runs: no gain on prefill, batch-1 or batch-32 decode (best batch-1 decode
# 3.0 ms with the defaults against 3.3-3.7 ms passive), because small steps already run on
# one thread (models.runner.step_threads) and libgomp throttles its spinning by itself once
# it has more threads than cores. Set the variables in the environment to try them.

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
