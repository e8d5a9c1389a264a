"""Weights quantized at load (`--quantization`, vLLM's flag): a float checkpoint's matrices
made 8-bit before they are placed on the card.

    int8   symmetric, one scale per output channel (Spyre's INT8 weights):
               d[n] = float16(max_k |W[n, k]| / 127),  q[n, k] = clip(round(W[n, k] / d[n]), ±127)
           placed in Q8_0's layout with the channel's scale in every block of 32, so the card's
           Q8_0 GEMM serves it (device/kernels/gemm/packed.py) and the model on the card is exactly
           the dequantized d[n] * q[n, k], computed with float32 activations.
    fp8    E4M3 with one scale per output channel (Spyre's FP8 weights; vLLM's dynamic fp8):
               d[n] = float16(max_k |W[n, k]| / 448),  q[n, k] = e4m3(W[n, k] / d[n])
           (round to nearest even, saturating at 448: device/numerics.py fp8_e4m3_encode), in
           Q8_0's records (FMT_FP8), widened in registers; the model is d[n] * e4m3(q[n, k]),
           computed with the checkpoint's float activations (no int8 inputs).

The norms stay float (in the width `--dtype` gives). A row whose largest value is below
float16's range (d rounds to 0) quantizes to zeros.
"""

from __future__ import annotations

import numpy as np

from spyre_serve.device.kernels.formats import FMT_FP8, FMT_Q8_0
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.layout import QuantizedWeight
from spyre_serve.device.numerics import FP8_E4M3_MAX, fp8_e4m3_encode


def _per_channel(w: np.ndarray, method: str, fmt: int, largest: float, encode) -> QuantizedWeight:
    """float [N, K] (K in whole blocks of 32) -> one float16 scale a row, d = max|row| /
    largest, and the row's codes encode(W / d) (a row of zeros: zeros), in Q8_0's records."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % QB:
        raise ValueError(f"{method} quantization needs rows in whole blocks of {QB}; a row has {k}")
    d16 = (np.abs(w).max(axis=1) / np.float32(largest)).astype(np.float16)        # [N]
    d = d16.astype(np.float32)[:, None]
    codes = encode(w / np.where(d == 0, np.float32(1), d))
    q = np.where(d == 0, 0, codes).astype(codes.dtype)
    return QuantizedWeight(fmt, q, np.repeat(d16[:, None], k // QB, axis=1))


def quantize_int8_per_channel(w: np.ndarray) -> QuantizedWeight:
    """float [N, K] (K in whole blocks of 32) -> int8 per output channel, in Q8_0's layout."""
    return _per_channel(w, "int8", FMT_Q8_0, 127,
                        lambda x: np.clip(np.rint(x), -127, 127).astype(np.int8))


def quantize_fp8_per_channel(w: np.ndarray) -> QuantizedWeight:
    """float [N, K] (K in whole blocks of 32) -> FP8 E4M3 per output channel (FMT_FP8)."""
    return _per_channel(w, "fp8", FMT_FP8, FP8_E4M3_MAX, fp8_e4m3_encode)


_METHODS = {"int8": quantize_int8_per_channel, "fp8": quantize_fp8_per_channel}
QUANTIZATIONS = tuple(_METHODS)


# a mixture of experts' stacked weights [E, N, K] (Granite MoE's names): one matrix an expert
EXPERT_STACKS = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")


def quantize_matrices(tensors: dict, method: str) -> dict:
    """Every 2-D float tensor (the embedding, the projections, a Mamba mixer's in_proj and
    out_proj, a router, an untied LM head) quantized by `method`, and each expert's matrix of
    an experts' stack (a list, one an expert); the rest (norms, the conv, A, D) as it is."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    quantize = _METHODS[method]

    def one(name: str, t):
        if not isinstance(t, np.ndarray):
            return t
        if t.ndim == 2:
            return quantize(t)
        if t.ndim == 3 and name.endswith(EXPERT_STACKS):
            return [quantize(t[e]) for e in range(t.shape[0])]
        return t

    return {name: one(name, t) for name, t in tensors.items()}
