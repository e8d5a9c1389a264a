"""compressed-tensors FP8 checkpoints: the schemes served and refused, and the weights with
their scales (a channel's, the tensor's) as the card's FP8 weights."""

import numpy as np
import pytest

from spyre_serve.device.kernels.formats import FMT_FP8
from spyre_serve.device.numerics import fp8_e4m3_decode, fp8_e4m3_encode
from spyre_serve.models.checkpoints.compressed_tensors import (
    QuantizationConfigError,
    fp8_weight_scheme,
    take_fp8_weights,
)
from spyre_serve.models.checkpoints.hf import widen_stored


def config(weights):
    return {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


FP8 = {"type": "float", "num_bits": 8, "strategy": "channel"}


def test_fp8_schemes_are_served_and_the_rest_refused_by_name():
    assert fp8_weight_scheme(None) is None
    assert fp8_weight_scheme(config(FP8)) == "channel"
    assert fp8_weight_scheme(config(FP8 | {"strategy": "tensor"})) == "tensor"
    with pytest.raises(QuantizationConfigError, match="'int' at 4 bits"):
        fp8_weight_scheme(config({"type": "int", "num_bits": 4, "strategy": "group"}))
    with pytest.raises(QuantizationConfigError, match="strategy 'block'"):
        fp8_weight_scheme(config(FP8 | {"strategy": "block"}))
    with pytest.raises(QuantizationConfigError, match="quant_method 'gptq'"):
        fp8_weight_scheme({"quant_method": "gptq"})


def bf16(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("per_channel", [True, False])
def test_weights_take_their_scales_and_the_scales_leave(per_channel):
    rng = np.random.default_rng(0)
    codes = fp8_e4m3_encode(rng.standard_normal((5, 64)) * 50)
    scale = np.array([2.0 ** -7, 0.0, 3 * 2.0 ** -9, 2.0 ** -5, 1.5] if per_channel else [0.25],
                     np.float32)
    stored = {"a.weight": ("F8_E4M3", codes),
              "a.weight_scale": ("BF16", bf16(scale).reshape(-1, 1) if per_channel else bf16(scale)),
              "a.input_scale": ("BF16", bf16([1.0])),
              "norm.weight": ("F32", np.ones(64, np.float32))}
    got = take_fp8_weights(stored, "ckpt", widen_stored)
    assert set(stored) == {"a.weight", "norm.weight"}          # the scales are consumed
    qw = got["a.weight"]
    assert qw.fmt == FMT_FP8 and (qw.q == codes).all()
    want = np.broadcast_to(scale[:, None], (5, 1)) * fp8_e4m3_decode(codes)
    np.testing.assert_array_equal(qw.dequantize(), want)


def test_a_weight_without_its_scale_is_refused():
    with pytest.raises(QuantizationConfigError, match="has no 'a.weight_scale'"):
        take_fp8_weights({"a.weight": ("F8_E4M3", np.zeros((2, 32), np.uint8))}, "ckpt", widen_stored)
