"""device/layout.py: weights packed once into panels, in float32 or 16-bit formats."""

import numpy as np
import pytest
import torch

from spyre_serve.device import Card, DeviceError
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_DLF16, FMT_F16, FMT_F32
from spyre_serve.device.kernels.simd import NR
from spyre_serve.device.layout import (
    decode,
    encode,
    format_code,
    pack,
    packed_shape,
    place_gemm_weight,
    unpack,
)

FMTS = [FMT_F32, FMT_BF16, FMT_F16, FMT_DLF16]


def _w(k, n, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k,n", [(1, 1), (5, 16), (7, 17), (33, 100)])
def test_unpack_inverts_pack_up_to_the_formats_rounding(k, n, fmt):
    w = _w(k, n)
    np.testing.assert_array_equal(unpack(pack(w, fmt), n, fmt, k), decode(encode(w, fmt), fmt))


def test_pack_lays_each_panel_out_k_major_with_zeros_past_n():
    w = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
    panels = pack(w, FMT_F32)
    assert panels.shape == packed_shape(3, 20) == (2, 3, NR)
    np.testing.assert_array_equal(panels[0, 1], w[1, :NR])                  # row k=1 of panel 0
    np.testing.assert_array_equal(panels[1, 2, :4], w[2, NR:])
    assert not panels[1, :, 4:].any()


def test_pack_keeps_bfloat16_rows_in_pairs_padded_to_whole_tiles():
    """Panel p holds (k // 2, column j, k % 2): the 2 rows of a column in one 32-bit lane, as
    vdpbf16ps and AMX's B tiles read them; K padded with zero rows to 32."""
    w = np.arange(5 * 20, dtype=np.float32).reshape(5, 20)
    panels = pack(w, FMT_BF16)
    assert panels.shape == packed_shape(5, 20, FMT_BF16) == (2, 32, NR)
    pairs = decode(panels, FMT_BF16).reshape(2, 16, NR, 2)
    np.testing.assert_array_equal(pairs[0, 1, :, 0], w[2, :NR])        # rows 2 and 3, panel 0
    np.testing.assert_array_equal(pairs[0, 1, :, 1], w[3, :NR])
    np.testing.assert_array_equal(pairs[1, 2, :4, 0], w[4, NR:])
    assert not pairs[1, 2, :, 1].any() and not pairs[:, 3:].any() and not pairs[1, :, 4:].any()


@pytest.mark.parametrize("fmt,torch_dtype", [(FMT_BF16, torch.bfloat16), (FMT_F16, torch.float16)])
def test_16_bit_encoding_rounds_to_nearest_even_as_torch(fmt, torch_dtype):
    x = (np.random.default_rng(1).standard_normal(4096) * 300).astype(np.float32)
    want = torch.from_numpy(x).to(torch_dtype).float().numpy()
    np.testing.assert_array_equal(decode(encode(x, fmt), fmt), want)


def test_place_gemm_weight_puts_the_panels_on_the_card():
    with Card(memory_bytes=1 << 20) as card:
        w = _w(9, 21)
        gw = place_gemm_weight(card, w, "bfloat16")
        assert (gw.k, gw.n, gw.fmt) == (9, 21, FMT_BF16)
        assert gw.tensor.dtype == np.uint16 and gw.nbytes == 2 * 32 * 2 * NR   # K 9 -> 32 rows
        assert gw.address % 128 == 0
        np.testing.assert_array_equal(gw.numpy(), decode(encode(w, FMT_BF16), FMT_BF16))


def test_unknown_weight_format_is_refused_naming_the_formats():
    with pytest.raises(DeviceError, match="'int8' is not one of"):
        format_code("int8")
