"""The CPU fallback: an op with no card kernel runs on the CPU, its tensors copied across.

torch-spyre does the same. Each op that falls back is counted (`torch.spyre.fallback_counts()`,
op name -> calls) and warned about once. What cannot fall back fails at once, naming the op:
an op that returns a view of its input (a CPU copy is not a view of the card's tensor), and
every op when the fallback is off (`torch.spyre.set_cpu_fallback(False)` or
`SPYRE_TORCH_CPU_FALLBACK=0`).

Its results go to the card of the op's spyre tensors (tensors of two cards raise, as a card
kernel's would: ops/devices.py), or to its `device` argument's.

The fallback is registered for PrivateUse1 as a boxed kernel of every op (torch's dispatcher
uses it for ops with no spyre kernel and no composite one); ops with a card kernel call `run`
themselves for the dtypes or layouts their kernel does not cover (`NoCardKernel`).
"""

from __future__ import annotations

import collections
import os
import threading
import warnings

import torch
from torch.utils._pytree import tree_map

from spyre_torch.ops.devices import op_card

ENV = "SPYRE_TORCH_CPU_FALLBACK"

_counts: collections.Counter = collections.Counter()
_warned: set = set()
_lock = threading.Lock()
_state = {"enabled": os.environ.get(ENV, "1") != "0"}


class NoCardKernel(Exception):  # noqa: N818 - a signal, not an error: the op falls back
    """Raised by an op's card implementation for a case its kernel does not cover."""


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def reset_counts() -> None:
    with _lock:
        _counts.clear()


def set_enabled(enabled: bool) -> None:
    _state["enabled"] = bool(enabled)


def enabled() -> bool:
    return _state["enabled"]


def _is_spyre(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "spyre"


def _to_cpu(x):
    if _is_spyre(x):
        return x.cpu()
    if isinstance(x, torch.device) and x.type == "spyre":
        return torch.device("cpu")
    return x


def _to_card(device: torch.device):
    def to(x):
        return x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x
    return to


def run(op, args: tuple, kwargs: dict, reason: str = ""):
    """Run `op` on the CPU: spyre tensors copied to the host, results and mutated arguments
    copied back."""
    name = op.name()
    schema = op._schema
    card = torch.device("spyre", op_card(name, args, kwargs))  # where the results go back to
    if not _state["enabled"]:
        why = f" ({reason})" if reason else ""
        raise NotImplementedError(
            f"spyre: {name} has no card kernel{why} and the CPU fallback is off "
            f"(torch.spyre.set_cpu_fallback(True) or {ENV}=1 turns it on)")
    for ret in schema.returns:
        if ret.alias_info is not None and not ret.alias_info.is_write:
            raise NotImplementedError(
                f"spyre: {name} has no card kernel and returns a view of its input, which a CPU "
                f"copy cannot give")
    with _lock:
        _counts[name] += 1
        first = name not in _warned
        _warned.add(name)
    if first:
        why = f" ({reason})" if reason else ""
        warnings.warn(f"spyre: {name} has no card kernel{why}; it runs on the CPU with its "
                      f"tensors copied across (counted in torch.spyre.fallback_counts(); "
                      f"warned once per op)", stacklevel=3)
    cpu_args = tree_map(_to_cpu, args)
    cpu_kwargs = tree_map(_to_cpu, kwargs)
    if "generator" in kwargs or any(a.name == "generator" for a in schema.arguments):
        if cpu_kwargs.get("generator") is None:
            from spyre_torch import api

            cpu_kwargs["generator"] = api.generator()
    result = op(*cpu_args, **cpu_kwargs)

    # arguments the op wrote: copy back into the spyre tensors; remember which, by alias set
    written = {}
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args):
            original, cpu = args[i], cpu_args[i]
        elif arg.name in kwargs:
            original, cpu = kwargs[arg.name], cpu_kwargs[arg.name]
        else:
            continue
        if _is_spyre(original):
            if original.shape != cpu.shape:
                original.resize_(cpu.shape)
            original.copy_(cpu)
        for alias in arg.alias_info.before_set:
            written[alias] = original

    def back(ret, value):
        if ret.alias_info is not None and ret.alias_info.is_write:
            for alias in ret.alias_info.before_set:
                if alias in written:
                    return written[alias]
        return tree_map(_to_card(card), value)

    if len(schema.returns) == 1:
        return back(schema.returns[0], result)
    if not schema.returns:
        return result
    return tuple(back(r, v) for r, v in zip(schema.returns, result, strict=True))


def boxed(op, *args, **kwargs):
    """The PrivateUse1 fallback of every op without a spyre kernel."""
    return run(op, args, kwargs)
