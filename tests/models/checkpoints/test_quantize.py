"""--quantization int8 and fp8: one scale per output channel, its float16 value in every block
of 32; int8 symmetric integers, fp8 E4M3 codes."""

import numpy as np
import pytest

from spyre_serve.device.kernels.formats import FMT_FP8, FMT_Q8_0
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.numerics import fp8_e4m3_decode, fp8_e4m3_encode
from spyre_serve.models.checkpoints.quantize import (
    quantize_fp8_per_channel,
    quantize_int8_per_channel,
    quantize_matrices,
)


def test_int8_per_channel_is_symmetric_with_one_scale_a_row():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((9, 96)) * rng.uniform(0.01, 3, (9, 1))).astype(np.float32)
    w[4] = 0.0                                          # a row of zeros quantizes to zeros
    qw = quantize_int8_per_channel(w)
    assert qw.fmt == FMT_Q8_0 and qw.q.dtype == np.int8 and qw.m is None
    assert np.abs(qw.q).max() <= 127
    assert (qw.d == qw.d[:, :1]).all()                  # the channel's scale, in every block
    d = (np.abs(w).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(qw.d[:, 0].astype(np.float32), d)
    np.testing.assert_array_equal(qw.q[4], 0)
    # each value within half a step of its quantized value (the step rounded to float16)
    err = np.abs(qw.dequantize() - w)
    assert (err <= d[:, None] * 0.5 * (1 + 2 ** -10) + 1e-12).all()
    # the largest value of a row lands on +-127 (or next to it: the float16 scale rounds)
    assert (np.abs(qw.q).max(axis=1)[np.arange(9) != 4] >= 126).all()


def test_fp8_per_channel_scales_each_row_to_448():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((9, 96)) * rng.uniform(0.01, 3, (9, 1))).astype(np.float32)
    w[4] = 0.0
    w[7, 5] = 1e-7                                      # a value far under the row's range: 0
    qw = quantize_fp8_per_channel(w)
    assert qw.fmt == FMT_FP8 and qw.q.dtype == np.uint8 and qw.m is None
    assert (qw.d == qw.d[:, :1]).all()
    d = (np.abs(w).max(axis=1) / 448).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(qw.d[:, 0].astype(np.float32), d)
    np.testing.assert_array_equal(qw.q[4], 0)
    safe = np.where(d == 0, 1, d)[:, None]
    np.testing.assert_array_equal(qw.q[np.arange(9) != 4],
                                  fp8_e4m3_encode(w / safe)[np.arange(9) != 4])
    np.testing.assert_array_equal(qw.dequantize(), d[:, None] * fp8_e4m3_decode(qw.q))
    # E4M3 keeps 3 mantissa bits: each value within 1/16 of itself (above the subnormals)
    big = np.abs(w) >= d[:, None] * 2.0 ** -6
    assert (np.abs(qw.dequantize() - w)[big] <= np.abs(w)[big] * (2.0 ** -4) * (1 + 2 ** -9)).all()
    assert (qw.q.astype(np.int32) & 0x7F).max() <= 0x7E        # never a NaN code


def test_only_matrices_are_quantized():
    tensors = {"a.weight": np.ones((4, QB), np.float32), "norm.weight": np.ones(QB, np.float32)}
    out = quantize_matrices(tensors, "int8")
    assert out["a.weight"].name == "Q8_0" and out["norm.weight"] is tensors["norm.weight"]
    assert quantize_matrices(tensors, "fp8")["a.weight"].name == "FP8_E4M3"
    with pytest.raises(ValueError, match="one of int8, fp8"):
        quantize_matrices(tensors, "int4")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_int8_per_channel(np.ones((2, 40), np.float32))
