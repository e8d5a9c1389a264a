"""spyre_torch: the emulated Spyre card as a native PyTorch device, "spyre".

    import torch
    x = torch.ones(4, device="spyre")          # storage in the card's arena
    model.to("spyre")                          # transformers' Granite / Llama run op by op
    torch.spyre.synchronize(); torch.spyre.memory_allocated()

Registered through torch's PrivateUse1 slot (backend.py) by torch's device-backend autoload:
the `torch.backends` entry point of this package calls `_autoload` during `import torch`. With
`TORCH_DEVICE_BACKEND_AUTOLOAD=0`, `import spyre_torch` registers it. The card itself (and
Numba) is only made on first use (runtime.py).

| file | what |
| --- | --- |
| `backend.py` | registration: rename, hooks, device guard, `torch.spyre`, the aten kernels |
| `api.py` | `torch.spyre`: devices, properties, seeds, streams, events, memory, counters |
| `runtime.py` | the card made on first use: streams, current stream, tensor blocks, programs |
| `memory.py` | tensor storage in the arena (device pointers), memory statistics |
| `streams.py` | `torch.spyre.Stream`, `Event`, `stream()` on the card's streams and events |
| `dtypes.py` | torch / numpy / kernel dtype codes |
| `ops/` | the aten kernels (one launch of a prepared program each) and the CPU fallback |
| `kernels/` | the Numba program entries those launches run |
| `eager.py` | transformers' model run eagerly on "spyre": prefill and decode steps (benchmarks) |
| `smi.py` | `spyre-smi`, aiu-smi's view of a card: from a server's /metrics or this process |
"""

_state = {"busy": False}


def register() -> bool:
    """Make "spyre" a torch device (idempotent); raises what goes wrong."""
    from spyre_torch.backend import register as _register

    return _register()


def _autoload() -> None:
    """torch's device-backend autoload calls this during `import torch` (cheap: no card).
    Whatever goes wrong here must not break `import torch` for a process that never uses
    the card: a failure is a warning, and "spyre" stays unregistered."""
    if _state["busy"]:  # `import torch` from inside our own registration: it finishes after
        return
    _state["busy"] = True
    try:
        register()
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"spyre: the spyre device could not be registered: {e!r}", stacklevel=2)
    finally:
        _state["busy"] = False


_autoload()  # `import spyre_torch` registers too (TORCH_DEVICE_BACKEND_AUTOLOAD=0)
