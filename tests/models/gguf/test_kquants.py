"""Q4_K and Q6_K, which gguf's package dequantizes but cannot quantize: blocks packed by the
tests' own packers (written from GGML's block layouts and scalar dequantizers) decode through
gguf's dequantizer to exactly the values the C code gives them, and through transformers'
torch dequantizer (a third, independent reading) too. Then every type the card serves at its
width (the K-quants, Q5_0 and Q5_1 among them) read by the loader as gguf's dequantizer reads
the same random blocks, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf.quants import dequantize

from spyre_serve.device.layout import pack_quantized, unpack_quantized
from spyre_serve.models.gguf.file import quantized_tensor, read_gguf
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


# ---------------------------------------------------------------- served at their width

KEPT = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_0, Q.Q4_1]


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes] of ``qtype`` blocks whose every byte is random but the float16 scales
    (finite, either sign; a K-quant's dmin too): every quant, scale and bit pattern occurs."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    halves = {Q.Q6_K: [208]}.get(qtype, [0, 2] if qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_1, Q.Q5_1) else [0])
    for at in halves:
        raw[:, :, at:at + 2] = (rng.standard_normal((rows, cols // block, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", KEPT)
def test_every_kept_type_reads_as_ggmls_dequantizer_gives_it(tmp_path, qtype):
    """The loader's quants and scales (a device.layout.QuantizedWeight, in the card's record
    of the type), dequantized and packed on the card, give bit for bit what gguf's dequantizer
    (the C code's port, above) gives the same bytes; K 512: two super-blocks a row."""
    rows, cols = 19, 512
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_gguf(tmp_path / "t.gguf")
    qw = quantized_tensor(f, f.tensors["t.weight"])
    want = dequantize(raw, qtype)
    assert qw.shape == want.shape == (rows, cols)
    np.testing.assert_array_equal(qw.dequantize(), want)
    np.testing.assert_array_equal(unpack_quantized(pack_quantized(qw), rows, qw.fmt), want.T)
