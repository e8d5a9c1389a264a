"""device/kernels/lora.py against its numpy reference."""

import numpy as np
import pytest

from spyre_serve.device.kernels.lora import lora_modules_at


def lora_reference(y, x, a, b, scales, slots, col0, ranks=None):
    """y[t, col0:col0+N] += scales[s] * (x[t] @ a[s, :r_s].T) @ b[s, :r_s] for each row of slot
    s >= 0 (a [NSLOT, R, K], b [NSLOT, R, N]; r_s = ranks[s], R by default)."""
    out = y.astype(np.float64)
    n = b.shape[2]
    for t, s in enumerate(slots):
        if s >= 0:
            rs = a.shape[1] if ranks is None else int(ranks[s])
            out[t, col0:col0 + n] += scales[s] * (x[t].astype(np.float64) @ a[s, :rs].T) @ b[s, :rs]
    return out


def _placed(card, *arrays):
    """Each array copied into the card's arena: their byte addresses."""
    out = []
    for v in arrays:
        t = card.empty(v.shape, np.float32)
        t.numpy()[...] = v
        out.append(t.address)
    return out


def _module(card, a, b, scales, col0):
    """A module row of lora_modules_at: a, b and scales placed in the arena."""
    return (*_placed(card, a, b, scales), a.shape[2], b.shape[2], col0)


def _ranks(a, ranks=None):
    """The slots' ranks (R each by default), float32 as the arena holds them."""
    return np.full(a.shape[0], a.shape[1], np.float32) if ranks is None else np.asarray(ranks, np.float32)


def lora_apply(card, y, x, a, b, scales, slots, col0, ranks=None):
    """lora_modules_at with one module."""
    modules = np.array([_module(card, a, b, scales, col0)], np.int64)
    lora_modules_at(y, x, card.memory.view(np.float32), modules, _ranks(a, ranks), slots, a.shape[0],
                    a.shape[1])


def _case(rng, t_rows=9, k=48, r=8, n=40, nslot=3, extra=24):
    x = rng.standard_normal((t_rows, k), dtype=np.float32)
    a = rng.standard_normal((nslot, r, k), dtype=np.float32)
    b = rng.standard_normal((nslot, r, n), dtype=np.float32)
    y = rng.standard_normal((t_rows, n + extra), dtype=np.float32)
    scales = np.array([0.5, 2.0, 0.0], np.float32)[:nslot]
    return x, a, b, y, scales


@pytest.mark.parametrize("slots", [
    [-1] * 9,                             # no adapter: y unchanged
    [0] * 9,                              # one group
    [1, 1, 1, -1, 0, 0, 2, 1, 1],         # groups of several slots, a zero scale, base rows
    [0, 1, 0, 1, 0, 1, 0, 1, 0],          # one row per group
])
@pytest.mark.parametrize("col0", [0, 24])
def test_lora_apply_matches_reference(card, slots, col0):
    rng = np.random.default_rng(1)
    x, a, b, y, scales = _case(rng)
    slots = np.array(slots, np.int32)
    ref = lora_reference(y, x, a, b, scales, slots, col0)
    lora_apply(card, y, x, a, b, scales, slots, col0)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)


def test_a_slot_reads_only_its_own_ranks_rows(card):
    """Slots of rank 8 holding adapters of rank 3, 8 and 1: the rows past a slot's rank are
    never read (NaN there would show in y)."""
    rng = np.random.default_rng(2)
    x, a, b, y, scales = _case(rng)
    scales[2] = 1.5
    ranks = np.array([3, 8, 1], np.float32)
    for s, rs in enumerate(ranks.astype(int)):
        a[s, rs:] = np.nan
        b[s, rs:] = np.nan
    slots = np.array([0, 1, 2, 0, -1, 2, 1, 0, 0], np.int32)
    ref = lora_reference(y, x, a, b, scales, slots, 0, ranks)
    lora_apply(card, y, x, a, b, scales, slots, 0, ranks)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)


def test_lora_apply_refuses_what_does_not_fit(card):
    rng = np.random.default_rng(4)
    x, a, b, y, scales = _case(rng)
    with pytest.raises(IndexError, match="slot past the arena"):
        lora_apply(card, y, x, a, b, scales, np.full(9, 3, np.int32), 0)
    with pytest.raises(ValueError, match="do not chain"):
        lora_apply(card, y, x, a, b, scales, np.zeros(9, np.int32), 30)
    with pytest.raises(ValueError, match="do not chain"):
        lora_apply(card, y, np.ascontiguousarray(x[:, :40]), a, b, scales, np.zeros(9, np.int32), 0)
    with pytest.raises(ValueError, match="rows of x, y and slots"):
        lora_apply(card, y, x, a, b, scales, np.zeros(4, np.int32), 0)
    with pytest.raises(ValueError, match="rank is past the arena"):
        lora_apply(card, y, x, a, b, scales, np.zeros(9, np.int32), 0, np.array([8, 9, 1], np.float32))


def test_lora_modules_at_applies_each_module_to_its_columns(card):
    """Three modules reading one x, writing side by side in y (a fused QKV's q, k, v), with
    scales of their own (a module an adapter skips: 0), in one call; rows of a slot apart."""
    rng = np.random.default_rng(5)
    k, r, nslot, widths = 48, 8, 3, (40, 16, 16)
    x = rng.standard_normal((9, k), dtype=np.float32)
    y = rng.standard_normal((9, sum(widths)), dtype=np.float32)
    slots = np.array([1, 0, 1, -1, 2, 0, 1, -1, 2], np.int32)
    ranks = np.array([8, 4, 2], np.float32)
    modules, ref, col0 = [], y.astype(np.float64), 0
    f32 = card.memory.view(np.float32)
    for m, n in enumerate(widths):
        a = rng.standard_normal((nslot, r, k), dtype=np.float32)
        b = rng.standard_normal((nslot, r, n), dtype=np.float32)
        scales = np.array([0.5, 0.0 if m == 1 else 2.0, 1.5], np.float32)
        modules.append(_module(card, a, b, scales, col0))
        ref = lora_reference(ref, x, a, b, scales, slots, col0, ranks)
        col0 += n
    lora_modules_at(y, x, f32, np.array(modules, np.int64), ranks, slots, nslot, r)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)
