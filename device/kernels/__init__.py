"""Numba kernels of the emulated card: plain arrays in, outputs first.

All are `@njit(nogil=True, cache=True)` and callable from other njit code
(the model's step program). Signatures: docs/interfaces.md.
"""

from device.kernels.activation import swiglu
from device.kernels.attention import paged_attention, write_kv
from device.kernels.embedding import embedding
from device.kernels.gemm import gemm, gemm_bt
from device.kernels.norm import rmsnorm
from device.kernels.residual import residual_add
from device.kernels.rope import rope_inplace
from device.kernels.sampling import sample
from device.kernels.softmax import log_softmax, softmax

__all__ = [
    "embedding",
    "gemm",
    "gemm_bt",
    "log_softmax",
    "paged_attention",
    "residual_add",
    "rmsnorm",
    "rope_inplace",
    "sample",
    "softmax",
    "swiglu",
    "write_kv",
]
