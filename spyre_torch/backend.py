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

        return initialized()

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


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
        _libs.extend([lib, fallback])
        return True
