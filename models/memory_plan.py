"""The device memory a runner plans once: step buffers first, then the KV cache from what is left.

    workspace     WORKSPACE (models/step_program.py) placed for the largest bucket, zeroed;
                  every bucket's views are prefixes of its fields
    inputs        INPUTS at the largest dims: a launch packs its own, smaller placement from
                  the start of it
    outputs x 2   OUTPUTS at (SMAX, KMAX): launches alternate between them, so step N+1
                  reads step N's samples while step N's are read back
    kv cache      models/kv_cache.py: num_kv_blocks, or kv_cache_fraction of the largest
                  free block left
    layer table   each layer's weight and KV cache addresses (models/weights.py)

`memory_plan` gives the bytes of each, as `spyre-serve warmup` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.models.buffer_layout import Layout, Placement
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.kv_cache import KVCache
from spyre_serve.models.step_program import INPUTS, KMAX, OUTPUTS, WORKSPACE
from spyre_serve.models.weights import ModelWeights, build_layer_table


@dataclass(frozen=True, slots=True)
class Capacity:
    """The largest step the buffers hold, in each dim they are sized by."""

    tmax: int        # token rows (the largest token bucket)
    smax: int        # sequences (the largest sequence bucket)
    rmax: int        # logit rows: every token row asked for, plus the sampling rows
    mbmax: int       # block-table width (max_model_len in blocks)
    nban_max: int    # banned ids: unique per sampling row, each < V
    nmw_max: int = 0     # grammar-mask words: a mask of ceil(V/32) words per sampling row
    nbias_max: int = 0   # logit-bias entries: unique per sampling row, each < V

    def input_dims(self) -> dict[str, int]:
        return {"T": self.tmax, "S": self.smax, "R": self.rmax, "MB": self.mbmax,
                "NBAN": self.nban_max, "NMW": self.nmw_max, "NBIAS": self.nbias_max}


def workspace_dims(cap: Capacity, cfg: GraniteConfig) -> dict[str, int]:
    """The dims WORKSPACE is declared in, for this capacity and model."""
    return {"TMAX": cap.tmax, "RMAX": cap.rmax, "SMAX": cap.smax,
            "H": cfg.hidden_size, "QD": cfg.q_size, "KD": cfg.kv_size,
            "I": cfg.intermediate_size, "V": cfg.vocab_size, "HALF_D": cfg.head_dim // 2}


class StepMemory:
    """The runner's planned device memory (see the module docstring); `free()` gives it back."""

    def __init__(self, card: Card, cfg: GraniteConfig, weights: ModelWeights, cap: Capacity,
                 block_size: int, num_kv_blocks: int | None, kv_cache_fraction: float,
                 kv_cache_dtype: str = "float32"):
        self.card = card
        self.inputs_layout: Layout = INPUTS
        self.outputs_layout: Layout = OUTPUTS
        self.workspace_placement: Placement = WORKSPACE.place(workspace_dims(cap, cfg))
        self._allocated: list[DeviceTensor] = []
        try:
            self.workspace = self._alloc(self.workspace_placement.nbytes, zero=True)
            self.inputs = self._alloc(INPUTS.place(cap.input_dims()).nbytes)
            out_bytes = OUTPUTS.place({"S": cap.smax, "K": KMAX, "P": cap.smax, "H": cfg.hidden_size}).nbytes
            self.outputs = [self._alloc(out_bytes, zero=True) for _ in range(2)]
            self.kv = KVCache(card, cfg, block_size, num_kv_blocks, kv_cache_fraction,
                              kv_cache_dtype)
            self.layer_table = build_layer_table(card, weights, self.kv.k, self.kv.v)
            self._allocated.append(self.layer_table)
        except BaseException:
            self.free()
            raise

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
        return {"workspace": self.workspace.nbytes, "io": sum(t.nbytes for t in io),
                "layer_table": self.layer_table.nbytes, "kv_cache": self.kv.nbytes}

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
