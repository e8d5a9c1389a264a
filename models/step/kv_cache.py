"""The paged KV cache on the card: per layer K transposed [NB + 1, Hkv, D, BS] and V
[NB + 1, Hkv, BS, D] (each block a GEMM tile's weight as it stands: device/kernels/attention/paged.py), float32
or 16-bit (`dtype`: bfloat16 / float16 / DLFloat16 values as uint16 bits, half the bytes a token; the
kernels round on write and widen on read, device/kernels/attention/paged.py).

Blocks 0..NB-1 belong to sequences (the server's block manager hands them out by number);
block NB is a trash block where the padding rows of a bucket write their K/V when they are
computed (a launch with no rows at all, warmup's: otherwise the step program runs on the
step's own rows only), so the step program never needs a branch for them. NB comes from a
memory budget, a fraction of the device memory still free (after weights and program
scratch), or is given.
"""

from __future__ import annotations

import numpy as np

from spyre_serve.device import Card, DeviceOutOfMemory, DeviceTensor
from spyre_serve.device.kernels.formats import FORMATS
from spyre_serve.models.config import GraniteConfig

DTYPES = ("float32", "bfloat16", "float16", "dlfloat16")


def block_bytes(config: GraniteConfig, block_size: int, dtype: str = "float32") -> int:
    """Bytes one block costs across the layers with attention (a hybrid's Mamba layers keep
    states instead: models/step/memory_plan.py), K and V."""
    return 2 * len(config.attention_layers) * block_size * config.kv_size * (4 if dtype == "float32" else 2)


def resolve_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The KV cache's format: "auto" keeps float32 with float32 compute (exact, as
    transformers) and stores 16 bits otherwise (the 16-bit compute's own format; bfloat16
    beside int8 compute, as llama.cpp keeps a 16-bit cache; DLFloat16 beside DLFloat16 compute,
    as the card keeps fp16 tensors); or one of DTYPES, as given."""
    if kv_cache_dtype == "auto":
        return compute_dtype if compute_dtype in ("float32", "float16", "dlfloat16") else "bfloat16"
    if kv_cache_dtype not in DTYPES:
        raise ValueError(f"KV cache dtype must be one of auto, {', '.join(DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return kv_cache_dtype


def free_device_bytes(card: Card) -> int:
    """Bytes the allocator can still hand out in one piece."""
    return int(card.allocator.stats().largest_free)


def blocks_for_budget(card: Card, config: GraniteConfig, block_size: int, fraction: float,
                      dtype: str = "float32") -> int:
    """Blocks that fit in `fraction` of the free device memory (one trash block included)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction}")
    budget = int(free_device_bytes(card) * fraction)
    # Each layer's K and V are separate allocations: leave room for 128-byte alignment.
    per_tensor_pad = 128 * 2 * len(config.attention_layers)
    n = (budget - per_tensor_pad) // block_bytes(config, block_size, dtype) - 1
    if n < 1:
        raise DeviceOutOfMemory(requested=2 * block_bytes(config, block_size, dtype),
                                free=budget, largest_free=free_device_bytes(card),
                                capacity=card.capacity)
    return int(n)


class KVCache:
    """K^T and V per layer, [NB + 1, Hkv, D, BS] and [NB + 1, Hkv, BS, D] of `dtype`; block NB is
    the padding trash block. BS and D are multiples of 16 (the tiles' width)."""

    def __init__(self, card: Card, config: GraniteConfig, block_size: int = 64,
                 num_blocks: int | None = None, fraction: float = 0.9, dtype: str = "float32"):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if block_size % 16 or config.head_dim % 16:
            raise ValueError(f"the KV cache needs the block size and head dim in multiples of 16, "
                             f"got {block_size} and {config.head_dim}")
        if dtype not in DTYPES:
            raise ValueError(f"KV cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.fmt = FORMATS[dtype]                            # the kernels' format code
        if num_blocks is None:
            num_blocks = blocks_for_budget(card, config, block_size, fraction, dtype)
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_blocks}")
        self.card = card
        self.block_size = block_size
        self.num_blocks = int(num_blocks)                   # NB usable blocks
        self.trash_block = self.num_blocks                  # index of the padding block
        nbt, hkv, d = self.num_blocks + 1, config.num_key_value_heads, config.head_dim
        self.k: list[DeviceTensor] = []                     # per attention layer [NB + 1, Hkv, D, BS]
        self.v: list[DeviceTensor] = []                     # per layer [NB + 1, Hkv, BS, D]
        try:
            storage = np.float32 if dtype == "float32" else np.uint16
            for _ in config.attention_layers:
                self.k.append(card.empty((nbt, hkv, d, block_size), storage))
                self.v.append(card.empty((nbt, hkv, block_size, d), storage))
        except BaseException:
            self.free()
            raise
        self.nbytes = sum(t.nbytes for t in self.k + self.v)

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds when every block is used."""
        return self.num_blocks * self.block_size

    def free(self) -> None:
        for t in self.k + self.v:
            self.card.free(t)
        self.k, self.v = [], []
