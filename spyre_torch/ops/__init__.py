"""aten ops on the "spyre" device: each a launch of a prepared card program.

Every module registers its ops with `@aten("add.Tensor", ...)`; `register(lib)` hands them to
torch's dispatcher for the PrivateUse1 key, plus the CPU fallback for every other op. A card
implementation that meets a case its kernel does not cover (a dtype, a layout) raises
`NoCardKernel`, and that call runs on the CPU instead (counted like any fallback).

| module | ops |
| --- | --- |
| factory.py | empty, empty_strided, fill_, zero_, arange, resize_, set_, item, record_stream |
| copy.py | _copy_from (host <-> card through the streams, card <-> card through a kernel) |
| views.py | view, as_strided, _reshape_alias, view.dtype, unfold (metadata only) |
| elementwise.py | unary and binary math, comparisons, logical ops, where, masked_fill, clamp |
| reduce.py | sum, mean, prod, amax, amin, max, min, argmax, argmin, any, all, cumsum, softmax |
| linalg.py | mm, bmm, addmm, baddbmm, mv, linear (and linear_backward) |
| nn.py | embedding, scaled_dot_product_attention |
| index.py | index_select, index.Tensor, cat, isin |

Each op runs on its tensors' card, which is the thread's current card while it runs (several
cards: ops/devices.py; tensors of two cards raise torch's "Expected all tensors to be on the
same device"). Nothing here imports Numba or makes a card: that happens at the first spyre
tensor.
"""

from __future__ import annotations

import torch

from spyre_torch.ops import fallback
from spyre_torch.ops.devices import op_card
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.runtime import device_count, swap_index

_IMPLS: list[tuple[str, object]] = []


def aten(*names: str):
    """Register the decorated function as the spyre kernel of these aten ops."""
    def deco(fn):
        for name in names:
            _IMPLS.append((name, fn))
        return fn
    return deco


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


# ops that take tensors of two cards and choose each side's card themselves (ops/copy.py)
CROSS_CARD = frozenset({"_copy_from", "_copy_from_and_resize"})


def _wrap(name: str, fn):
    def call(args, kwargs):
        try:
            return fn(*args, **kwargs)
        except NoCardKernel as why:
            return fallback.run(_overload(name), args, kwargs, str(why))

    if name in CROSS_CARD:
        def kernel(*args, **kwargs):
            return call(args, kwargs)
    else:
        def kernel(*args, **kwargs):
            if device_count() == 1:
                return call(args, kwargs)
            prev = swap_index(op_card(name, args, kwargs))  # the op's card, current while it runs
            try:
                return call(args, kwargs)
            finally:
                swap_index(prev)
    kernel.__name__ = fn.__name__
    kernel.__qualname__ = f"spyre:{name}"
    return kernel


def register(lib: torch.library.Library, fallback_lib: torch.library.Library) -> None:
    from spyre_torch.ops import copy, elementwise, factory, index, linalg, nn, reduce, views  # noqa: F401

    for name, fn in _IMPLS:
        lib.impl(name, _wrap(name, fn), "PrivateUse1")
    fallback_lib.fallback(fallback.boxed, "PrivateUse1")
