"""Registration with torch: the PrivateUse1 slot renamed "spyre", its hooks, device guard,
device module (`torch.spyre`) and the aten kernels.

torch 2.13's Python-only path (`torch.utils.backend_registration.
_setup_privateuseone_for_python_backend`, as PyTorch's own
test/test_privateuseone_python_backend.py uses it): no C++ extension. Registration is cheap
(well under a millisecond for the ~200 kernels) and makes no card: `import torch` pays nothing
else.
"""

from __future__ import annotations

import threading
import warnings

import torch

NAME = "spyre"

_lock = threading.Lock()
_libs: list = []  # the torch.library.Library objects (they unregister when collected)


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index) -> bool:
        from spyre_torch.runtime import initialized

        return initialized(device_index)

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _storages_on_the_card() -> None:
    """`torch.UntypedStorage(n, device="spyre")` makes a card storage.

    torch builds a storage on a device through that device's C++ allocator, and the
    Python-only registration has no way to give PrivateUse1 one: torch would call a null
    allocator (a segfault). Storage moves go through that constructor (`storage.to("spyre")`,
    `storage.spyre()`, `torch.load(..., map_location="spyre")`), so it is diverted for the
    spyre device only; every other call reaches torch's own constructor unchanged."""
    base_new = torch._C.StorageBase.__new__

    def new(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == NAME:
            if len(args) != 1 or not isinstance(args[0], int) or set(kwargs) - {"device"}:
                raise RuntimeError("spyre: a storage on the card is made from a size in bytes: "
                                   "torch.UntypedStorage(nbytes, device='spyre')")
            from spyre_torch.memory import new_storage
            from spyre_torch.runtime import index_of

            return new_storage(args[0], index_of(device))
        return base_new(cls, *args, **kwargs)

    torch.UntypedStorage.__new__ = new


def registered() -> bool:
    return bool(_libs)


def register() -> bool:
    """Make "spyre" a torch device (once per process). False when the PrivateUse1 slot is
    already taken by another backend (then "spyre" is left alone, with a warning)."""
    with _lock:
        if _libs:
            return True
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            warnings.warn(f"spyre: torch's PrivateUse1 backend is already '{current}'; the spyre "
                          f"device is not registered", stacklevel=2)
            return False
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        from spyre_torch import api
        from spyre_torch.ops import register as register_ops

        _setup_privateuseone_for_python_backend(
            rename=NAME if current != NAME else None, backend_module=api, hook=_Hooks(),
            device_guard=_DeviceGuard())
        if current == NAME:  # renamed elsewhere: the module still needs registering
            torch._register_device_module(NAME, api)
        lib = torch.library.Library("aten", "IMPL")
        fallback = torch.library.Library("_", "IMPL")
        register_ops(lib, fallback)
        _storages_on_the_card()
        _libs.extend([lib, fallback])
        return True
