"""Which card an op runs on: its spyre tensors' (all on one card, as torch requires of CUDA
tensors), else its `device` argument's, else the thread's current card.

torch's dispatcher makes no such check for a Python backend's kernels (the generated CUDA
wrappers do), and the card kernels take arena addresses: a tensor of another card would be read
at its address in the wrong arena. So every spyre op (ops/__init__.py's wrapper and the CPU
fallback) asks `op_card`, which raises torch's "Expected all tensors to be on the same device"
naming both cards, and runs with that card current (`runtime.on_card`). With one card there is
nothing to choose and the wrapper skips all this.
"""

from __future__ import annotations

import torch

from spyre_torch.runtime import current_index, index_of

_Tensor = torch.Tensor


def _seen(index, x, name: str):
    """The card of the spyre tensors so far, after tensor `x` (raises on a second card)."""
    if x.device.type != "spyre":
        return index
    i = x.device.index
    if index is not None and i != index:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                           f"devices, spyre:{index} and spyre:{i}! (spyre: {name} takes tensors of "
                           f"one card; move them with .to('spyre:{index}') first)")
    return i


def tensors_card(name: str, args, kwargs) -> int | None:
    """The card of the op's spyre tensors (in arguments and lists of them), None without any."""
    index = None
    for group in (args, kwargs.values()):
        for x in group:
            if isinstance(x, _Tensor):
                index = _seen(index, x, name)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    if isinstance(y, _Tensor):
                        index = _seen(index, y, name)
    return index


def op_card(name: str, args, kwargs) -> int:
    """The card the op runs on (see the module's docstring)."""
    index = tensors_card(name, args, kwargs)
    if index is not None:
        return index
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "spyre":
        return index_of(device)
    return current_index()
