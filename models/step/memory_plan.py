"""The device memory a runner plans once: step buffers first, then the KV cache from what is left.

    workspace     WORKSPACE (models/step/program.py) placed for the largest bucket, zeroed;
                  every bucket's views are prefixes of its fields
    inputs        INPUTS at the largest dims: a launch packs its own, smaller placement from
                  the start of it
    outputs x 2   OUTPUTS at (SMAX, KMAX): launches alternate between them, so step N+1
                  reads step N's samples while step N's are read back
    states        a hybrid model's: per Mamba layer, its conv and SSM states of every state
                  slot (device/kernels/mamba.py), zeroed
    kv cache      models/step/kv_cache.py: num_kv_blocks, or kv_cache_fraction of the largest
                  free block left
    layer table   each layer's weight and KV cache addresses (models/step/weights.py)

`memory_plan` gives the bytes of each, as `spyre-serve warmup` prints them; their sizes come from
models/sizing/fit.py, which `spyre-serve plan` computes from a config alone.
"""

from __future__ import annotations

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.sizing.fit import Capacity, buffer_bytes, workspace_dims  # noqa: F401  (Capacity, workspace_dims: this module's interface)
from spyre_serve.models.step.buffer_layout import Layout, Placement
from spyre_serve.models.step.kv_cache import KVCache
from spyre_serve.models.step.program import INPUTS, OUTPUTS, WORKSPACE
from spyre_serve.models.step.weights import ModelWeights, build_layer_table


class StepMemory:
    """The runner's planned device memory (see the module docstring); `free()` gives it back."""

    def __init__(self, card: Card, cfg: GraniteConfig, weights: ModelWeights, cap: Capacity,
                 block_size: int, num_kv_blocks: int | None, kv_cache_fraction: float,
                 kv_cache_dtype: str = "float32",
                 lora_columns: list[tuple[int, int, int]] | None = None, state_slots: int = 0):
        self.card = card
        self.inputs_layout: Layout = INPUTS
        self.outputs_layout: Layout = OUTPUTS
        self.workspace_placement: Placement = WORKSPACE.place(workspace_dims(cap, cfg))
        self._allocated: list[DeviceTensor] = []
        self.states: list[tuple[DeviceTensor, DeviceTensor]] = []
        sizes = buffer_bytes(cfg, cap)           # what `spyre-serve plan` counts (models/sizing/fit.py)
        try:
            self.workspace = self._alloc(sizes["workspace"], zero=True)
            self.inputs = self._alloc(sizes["inputs"])
            self.outputs = [self._alloc(sizes["output"], zero=True) for _ in range(2)]
            m = cfg.mamba
            self.states = [(self._alloc_f32(state_slots, *m.conv_state), self._alloc_f32(state_slots, *m.ssm_state))
                           for _ in cfg.mamba_layers]
            self.kv = KVCache(card, cfg, block_size, num_kv_blocks, kv_cache_fraction,
                              kv_cache_dtype)
            self.layer_table = build_layer_table(card, weights, self.kv.k, self.kv.v, lora_columns,
                                                 self.states)
            self._allocated.append(self.layer_table)
        except BaseException:
            self.free()
            raise

    def _alloc_f32(self, *shape: int) -> DeviceTensor:
        t = self.card.zeros(shape, np.float32)
        self._allocated.append(t)
        return t

    def _alloc(self, nbytes: int, zero: bool = False) -> DeviceTensor:
        t = self.card.zeros((nbytes,), np.uint8) if zero else self.card.empty((nbytes,), np.uint8)
        self._allocated.append(t)
        return t

    @property
    def scratch_bytes(self) -> int:
        """Device bytes of the workspace, I/O buffers and layer table (KV cache not included)."""
        return sum(t.nbytes for t in self._allocated)

    @property
    def plan(self) -> dict[str, int]:
        """Device bytes by use: 'workspace', 'io' (input and output buffers), 'layer_table',
        'kv_cache'. The first three add up to scratch_bytes; the weights belong to the model."""
        io = [self.inputs, *self.outputs]
        out = {"workspace": self.workspace.nbytes, "io": sum(t.nbytes for t in io),
               "layer_table": self.layer_table.nbytes, "kv_cache": self.kv.nbytes}
        if self.states:
            out["states"] = sum(t.nbytes for pair in self.states for t in pair)
        return out

    def workspace_bindings(self) -> dict[str, int]:
        """Address and length slots of every workspace field (the same for every launch)."""
        return self.workspace_placement.bindings(self.workspace.address)

    def workspace_field(self, name: str, n: int) -> DeviceTensor:
        """The first n float32 of workspace field `name`, to read back (logits, lsm)."""
        count = self.workspace_placement.count(name)
        if n > count:
            raise ValueError(f"workspace field {name} holds {count} elements, {n} asked")
        address = self.workspace.address + self.workspace_placement.offsets[name]
        return DeviceTensor(address, (n,), np.float32, self.card)

    def inputs_prefix(self, nbytes: int) -> DeviceTensor:
        """The first nbytes of the input buffer: where a launch's packed inputs go."""
        if nbytes > self.inputs.nbytes:
            raise ValueError(f"a step's inputs take {nbytes} bytes, the buffer holds "
                             f"{self.inputs.nbytes}")
        return DeviceTensor(self.inputs.address, (nbytes,), np.uint8, self.card)

    def free(self) -> None:
        for t in self._allocated:
            self.card.free(t)
        self._allocated = []
        if hasattr(self, "kv"):
            self.kv.free()
