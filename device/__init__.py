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
