"""Q4_K and Q6_K, which gguf's package dequantizes but cannot quantize: blocks packed by the
tests' own packers (written from GGML's block layouts and scalar dequantizers) decode through
gguf's dequantizer, the one the loader uses, to exactly the values the C code gives them,
and through transformers' torch dequantizer (a third, independent reading) too."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from tests.models.gguf_files import Q, pack_q4_k, pack_q6_k

PACKERS = {Q.Q4_K: (pack_q4_k, 144), Q.Q6_K: (pack_q6_k, 210)}


def weights(rows=6, cols=512, seed=0):
    """float32[rows, cols], with one row of zeros and one of a single sign (edge cases of
    the scales and mins), the rest normal with outliers."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[1] = 0.0
    w[2] = np.abs(w[2])
    w[3, ::97] = 0.9
    return w


@pytest.mark.parametrize("qtype", list(PACKERS))
def test_packed_blocks_decode_exactly_as_ggml_defines_them(qtype):
    pack, block_bytes = PACKERS[qtype]
    w = weights()
    raw, values = pack(w)
    assert raw.dtype == np.uint8 and raw.shape == (6, 512 // 256 * block_bytes)
    np.testing.assert_array_equal(dequantize(raw, qtype), values)


@pytest.mark.parametrize("qtype", list(PACKERS))
def test_packed_values_are_close_to_the_weights(qtype):
    """The packers quantize (so the parity models stay varied): the error is within a
    quantization step of each row's range."""
    w = weights(seed=1)
    _, values = PACKERS[qtype][0](w)
    levels = 15 if qtype == Q.Q4_K else 63
    for row, got in zip(w, values, strict=True):
        step = (row.max() - min(row.min(), 0)) / levels
        assert np.abs(got - row).max() <= step + 1e-7
    assert not values[1].any()


@pytest.mark.parametrize("qtype", list(PACKERS))
def test_transformers_dequantizes_the_same_blocks_to_the_same_values(qtype):
    torch = pytest.importorskip("torch")
    theirs = pytest.importorskip("transformers.integrations.gguf.dequant",
                                 reason="transformers < 5 has no torch GGUF dequantizer")
    raw, values = PACKERS[qtype][0](weights(seed=2))
    got = theirs.dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).numpy()
    np.testing.assert_allclose(got.reshape(values.shape), values, rtol=1e-6, atol=1e-7)
