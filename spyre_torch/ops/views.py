"""Views: new sizes, strides and offset over the same card storage; no launch, no copy.

torch's CPU kernels of these ops only build a tensor's metadata around the input's storage
(they never touch its bytes), so the spyre kernels are those, reached by redispatch. Views
built by composite ops (transpose, permute, expand, slice, select, unsqueeze...) come here
through `as_strided`.
"""

from __future__ import annotations

import torch

from spyre_torch.ops import aten

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_aten = torch.ops.aten


@aten("view")
def view(self, size):
    return _aten.view.default.redispatch(_CPU_KEYS, self, size)


@aten("view.dtype")
def view_dtype(self, dtype):
    return _aten.view.dtype.redispatch(_CPU_KEYS, self, dtype)


@aten("as_strided")
def as_strided(self, size, stride, storage_offset=None):
    return _aten.as_strided.default.redispatch(_CPU_KEYS, self, size, stride, storage_offset)


@aten("_reshape_alias")
def reshape_alias(self, size, stride):
    return _aten._reshape_alias.default.redispatch(_CPU_KEYS, self, size, stride)


@aten("unfold")
def unfold(self, dimension, size, step):
    return _aten.unfold.default.redispatch(_CPU_KEYS, self, dimension, size, step)
