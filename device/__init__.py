"""The emulated Spyre card: memory, allocator, streams, events, programs, kernels.

Knows bytes, addresses and kernels; nothing of language models. See README.md
in this folder for the call-by-call map to CUDA/torch. Importing it changes nothing of the
process and imports nothing yet (each name below loads its module when first used): an entry
point calls `device.process.configure()` first (threads, ISA level, compile cache), before
any kernel is imported.
"""

from importlib import import_module

_EXPORTS = {
    "AllocatorStats": "device.allocator", "CachingAllocator": "device.allocator",
    "Card": "device.card", "Counters": "device.counters", "Event": "device.event",
    "STICK": "device.memory", "DeviceError": "device.memory", "DeviceOutOfMemory": "device.memory",
    "DeviceTensor": "device.memory",
    "D2H": "device.program", "H2D": "device.program", "Compute": "device.program",
    "HostCompute": "device.program", "JobPlan": "device.program", "LaunchHandle": "device.program",
    "Program": "device.program", "Slot": "device.program",
    "DeviceCommandError": "device.stream", "Stream": "device.stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'device' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
