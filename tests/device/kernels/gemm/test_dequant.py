"""dequantize_pair_bf16: two panels of a Q8_0 / Q4_0 / Q4_1 / K-quant weight as a bfloat16 weight's
panels, against numpy (device/layout.py's unpack_quantized, then its bfloat16 packing)."""

import numpy as np
import pytest

from spyre_serve.device.kernels.formats import FMT_BF16, FMT_FP8, FMT_Q8_0
from spyre_serve.device.kernels.gemm.dequant import dequantize_pair_bf16
from spyre_serve.device.kernels.simd import NR
from spyre_serve.device.layout import pack, pack_quantized, unpack_quantized
from tests.device.kernels.gemm.test_quantized import INT_QFMTS, random_weight


def as_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32 values (a padding column's d (0 - 8) is -0.0: equal to 0)."""
    return (bits.reshape(-1).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("fmt", INT_QFMTS)
def test_two_panels_are_the_dequantized_weight_rounded_to_bfloat16(fmt):
    n, k = 4 * NR + 5, 96
    packed = pack_quantized(random_weight(fmt, n, k, seed=fmt))
    w = unpack_quantized(packed, n, fmt)                         # [K, N] float32, GGML's values
    want = pack(w, FMT_BF16)                                     # [P, K, NR] bfloat16 bits
    out = np.full(2 * k * NR + 7, 0xFFFF, np.uint16)
    for p0, p1 in ((0, 1), (2, 4), (4, 4)):                      # the last panel is partial
        dequantize_pair_bf16(packed.reshape(-1), k, fmt, p0, p1, out)
        np.testing.assert_array_equal(as_float(out[:k * NR]), as_float(want[p0]))
        np.testing.assert_array_equal(as_float(out[k * NR:2 * k * NR]), as_float(want[p1]))
    assert (out[2 * k * NR:] == 0xFFFF).all()                    # nothing written past the pair


def test_what_it_does_not_widen_is_refused():
    packed = pack_quantized(random_weight(FMT_FP8, NR, 64))
    with pytest.raises(ValueError, match="integer block-quantized"):
        dequantize_pair_bf16(packed.reshape(-1), 64, FMT_FP8, 0, 0, np.empty(2 * 64 * NR, np.uint16))
    packed = pack_quantized(random_weight(FMT_Q8_0, NR, 64))
    with pytest.raises(ValueError, match="2 K NR long"):
        dequantize_pair_bf16(packed.reshape(-1), 64, FMT_Q8_0, 0, 0, np.empty(64 * NR, np.uint16))
