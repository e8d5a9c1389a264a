"""The emulated Spyre card: memory, allocator, streams, events, programs, kernels.

Knows bytes, addresses and kernels; nothing of language models. See README.md
in this folder for the call-by-call map to CUDA/torch. Importing it changes nothing of the
process and imports nothing yet (each name below loads its module when first used): an entry
point calls `device.process.configure()` first (threads, ISA level, compile cache), before
any kernel is imported.
"""

from importlib import import_module

_EXPORTS = {
    "AllocatorStats": "allocator", "CachingAllocator": "allocator",
    "Card": "card", "Counters": "counters", "Event": "event",
    "STICK": "memory", "DeviceError": "memory", "DeviceOutOfMemory": "memory",
    "DeviceTensor": "memory",
    "D2H": "program", "H2D": "program", "Compute": "program",
    "HostCompute": "program", "JobPlan": "program", "LaunchHandle": "program",
    "Program": "program", "Slot": "program",
    "DeviceCommandError": "stream", "Stream": "stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spyre_serve.device' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
