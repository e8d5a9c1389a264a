"""gemm_packed against numpy on the same (widened) weights, with float32 inputs and with inputs
rounded to 16 bits (on this host's level: bfloat16 pairs by vdpbf16ps or AMX where it has
them); round_to_format against torch. tests/device/test_isa.py runs the lower levels."""

import numpy as np
import pytest
import torch

from spyre_serve.device.isa import current
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_DLF16, FMT_F16, FMT_F32, packed_size
from spyre_serve.device.kernels.gather import gather_columns
from spyre_serve.device.kernels.gemm.inputs import (
    ACT_F32,
    MODE_DOT,
    MODE_DOT_ROWS,
    PANEL_ROWS,
    gemm_inputs,
    round_to_format,
)
from spyre_serve.device.kernels.gemm.packed import gemm_packed
from spyre_serve.device.layout import pack, to_bf16_bits, unpack
from spyre_serve.device.numerics import dlfloat16_round

FMTS = [FMT_F32, FMT_BF16, FMT_F16, FMT_DLF16]
TORCH = {FMT_BF16: torch.bfloat16, FMT_F16: torch.float16}


def rounded(x: np.ndarray, fmt: int) -> np.ndarray:
    """x rounded to a 16-bit format by its reference: torch's cast, DLFloat16's host encoder
    (tests/device/test_numerics.py checks it against the format's specification)."""
    if fmt == FMT_DLF16:
        return dlfloat16_round(x)
    return torch.from_numpy(x).to(TORCH[fmt]).float().numpy()
# rows: one (GEMV), two, a partial tile, more than a block of k, the largest bucket
SHAPES = [(1, 64, 32), (2, 65, 33), (7, 129, 300), (33, 257, 1), (33, 300, 257), (512, 96, 80),
          (3, 45, 47), (16, 33, 31), (40, 577, 17), (512, 97, 81)]


def _case(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_packed_matches_numpy_on_the_stored_weights(m, k, n, fmt):
    a, w = _case(m, k, n)
    panels = pack(w, fmt)
    want = a.astype(np.float64) @ unpack(panels, n, fmt, k).astype(np.float64)
    out = np.full((m, n), np.nan, np.float32)
    gemm_packed(out, a, panels.reshape(-1), k, n, fmt, ACT_F32)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (2, 65, 33), (7, 129, 301), (33, 257, 17)])
def test_16_bit_weights_widened_are_the_float32_gemm_of_their_values(m, k, n, fmt):
    """With float32 inputs a 16-bit weight (bfloat16 in pairs of rows) sums the same products
    in the same order as the float32 GEMM of its values: bit for bit."""
    a, w = _case(m, k, n, seed=3)
    panels = pack(w, fmt)
    out, ref = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    gemm_packed(out, a, panels.reshape(-1), k, n, fmt, ACT_F32)
    values = np.ascontiguousarray(unpack(panels, n, fmt, k))
    gemm_packed(ref, a, pack(values, FMT_F32).reshape(-1), k, n, FMT_F32, ACT_F32)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("fmt", FMTS[1:])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_16_bit_inputs_are_rounded_once_and_multiplied_exactly(m, k, n, fmt):
    """Inputs rounded to the weight's format (as torch rounds), every product of two 16-bit
    values exact, the sums float32: numpy's float64 product of the rounded values within
    float32 summation error. Rows of 3 and more of a bfloat16 weight go through AMX on a level
    that has it, fewer through vdpbf16ps (avx512_bf16 and up)."""
    a, w = _case(m, k, n, seed=4)
    panels = pack(w, fmt)
    a16 = rounded(a, fmt).astype(np.float64)
    want = a16 @ unpack(panels, n, fmt, k).astype(np.float64)
    out = np.full((m, n), np.nan, np.float32)
    a_in = a.copy()
    gemm_packed(out, a_in, panels.reshape(-1), k, n, fmt, fmt)
    np.testing.assert_array_equal(a_in, a)                  # the inputs themselves untouched
    scale = np.abs(a16) @ np.abs(unpack(panels, n, fmt, k).astype(np.float64))
    assert np.all(np.abs(out - want) <= 4 * k * 2.0 ** -24 * scale + 1e-30), current().level


@pytest.mark.parametrize("m,k", [(1, 64), (17, 33), (40, 577), (512, 96), (16, 32), (48, 1536)])
def test_bfloat16_inputs_lie_in_micro_panels_for_the_dot_tiles_and_in_rows_for_amx(m, k):
    """The dot tiles' inputs: row r's values k, k + 1 (k even) in one 32-bit word at word
    ((r // PANEL_ROWS) * kp / 2 + k / 2) * PANEL_ROWS + r % PANEL_ROWS, zero past K and past M;
    AMX's, and fewer rows than a panel: rows of kp values. Both the nearest bfloat16 (numpy's
    reference rounding), ties to even included. The shapes take the vector blocks whole (16,
    32), with a tail of pairs and of rows (40, 577), none (17, 33), over both cores (48, 1536)."""
    if not current().at_least("avx512_bf16"):
        pytest.skip("bfloat16 pairs only on a level with vdpbf16ps")
    a = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
    bits = a.reshape(-1).view(np.uint32)
    bits[::7] = (bits[::7] & 0xFFFF0000) | 0x8000           # exact ties, both parities
    panels_in = gemm_inputs(a.reshape(-1), m, k, FMT_BF16, FMT_BF16, False)
    rows_in = gemm_inputs(a.reshape(-1), m, k, FMT_BF16, FMT_BF16, True)
    kp = panels_in[5]
    assert rows_in[6] == MODE_DOT_ROWS and kp >= k and kp % 2 == 0
    want = np.zeros((-(-m // PANEL_ROWS) * PANEL_ROWS, kp), np.uint16)
    want[:m, :k] = to_bf16_bits(a)
    np.testing.assert_array_equal(rows_in[4].reshape(m, kp), want[:m])
    if m < PANEL_ROWS:
        assert panels_in[6] == MODE_DOT_ROWS
        np.testing.assert_array_equal(panels_in[4].reshape(m, kp), want[:m])
        return
    assert panels_in[6] == MODE_DOT
    as_panels = want.reshape(-1, PANEL_ROWS, kp // 2, 2).transpose(0, 2, 1, 3).reshape(-1)
    np.testing.assert_array_equal(panels_in[4], as_panels)


def test_gemm_packed_k_past_one_block_accumulates_every_block():
    a, w = _case(3, 1000, 20)                 # 1000 = 3 blocks of 256 and a remainder
    out = np.empty((3, 20), np.float32)
    gemm_packed(out, a, pack(w, FMT_F32).reshape(-1), 1000, 20, FMT_F32, ACT_F32)
    np.testing.assert_allclose(out, a.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)


def test_gemm_packed_refuses_a_short_weight():
    a, w = _case(2, 8, 20)
    with pytest.raises(ValueError, match="too short"):
        gemm_packed(np.empty((2, 20), np.float32), a, np.zeros(packed_size(8, 20) - 1, np.float32),
                    8, 20, FMT_F32, ACT_F32)


@pytest.mark.parametrize("fmt", FMTS[1:])
def test_round_to_format_rounds_like_the_reference(fmt):
    x = (np.random.default_rng(2).standard_normal((37, 101)) * 50).astype(np.float32)
    want = rounded(x, fmt)
    round_to_format(x, fmt)
    np.testing.assert_array_equal(x, want)


def test_round_to_format_leaves_float32_alone():
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    y = x.copy()
    round_to_format(y, FMT_F32)
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("fmt", FMTS)
def test_gather_columns_reads_table_rows_from_the_panels(fmt):
    """The embedding lookup from the LM head's packed E.T gives the (stored) rows of E, scaled."""
    table = np.random.default_rng(4).standard_normal((37, 10), dtype=np.float32)   # E [V, H]
    panels = pack(table.T, fmt)                                                     # W = E.T
    ids = np.array([0, 36, 17, 17, 5], np.int32)
    out = np.empty((5, 10), np.float32)
    gather_columns(out, panels.reshape(-1), ids, 12.0, 10, 37, fmt)
    np.testing.assert_array_equal(out, unpack(panels, 37, fmt, 10).T[ids] * np.float32(12.0))


def test_gather_columns_refuses_an_id_outside_the_table():
    panels = pack(np.zeros((4, 8), np.float32), FMT_F32).reshape(-1)
    with pytest.raises(IndexError, match="out of range"):
        gather_columns(np.empty((1, 4), np.float32), panels, np.array([8], np.int32), 1.0, 4, 8, FMT_F32)
