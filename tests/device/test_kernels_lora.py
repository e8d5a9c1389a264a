"""device/kernels/lora.py against its numpy reference."""

import numpy as np
import pytest

from spyre_serve.device.kernels.lora import lora_modules_at


def lora_reference(y, x, a, b, scales, slots, col0):
    """y[t, col0:col0+N] += scales[s] * (x[t] @ a[s]) @ b[s] for each row of slot s >= 0."""
    out = y.astype(np.float64)
    n = b.shape[2]
    for t, s in enumerate(slots):
        if s >= 0:
            out[t, col0:col0 + n] += scales[s] * (x[t].astype(np.float64) @ a[s]) @ b[s]
    return out


def _placed(card, *arrays):
    """Each array copied into the card's arena: their byte addresses."""
    out = []
    for v in arrays:
        t = card.empty(v.shape, np.float32)
        t.numpy()[...] = v
        out.append(t.address)
    return out


def lora_apply(card, y, x, a, b, scales, slots, col0):
    """lora_modules_at with one module: a, b and scales placed in the arena."""
    modules = np.array([[*_placed(card, a, b, scales), a.shape[1], b.shape[2], col0]], np.int64)
    lora_modules_at(y, x, card.memory.view(np.float32), modules, slots, a.shape[0], a.shape[2])


def _case(rng, t_rows=9, k=48, r=8, n=40, nslot=3, extra=24):
    x = rng.standard_normal((t_rows, k), dtype=np.float32)
    a = rng.standard_normal((nslot, k, r), dtype=np.float32)
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


def test_zero_padded_rank_adds_exactly_the_lower_rank(card):
    """A rank-3 adapter padded to rank 8 gives its rank-3 update (the padding adds zeros)."""
    rng = np.random.default_rng(2)
    x, a, b, y, scales = _case(rng, nslot=2)
    a[:, :, 3:] = 0.0
    b[:, 3:, :] = 0.0
    slots = np.zeros(9, np.int32)
    ref = lora_reference(y, x, a[:, :, :3], b[:, :3], scales, slots, 0)
    lora_apply(card, y, x, a, b, scales, slots, 0)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)


def test_lora_at_reads_the_arena(card):
    rng = np.random.default_rng(3)
    x, a, b, y, scales = _case(rng)
    slots = np.array([2, 2, 0, 0, 0, 1, -1, -1, 1], np.int32)
    ref = lora_reference(y, x, a, b, scales, slots, 24)
    modules = np.array([[*_placed(card, a, b, scales), 48, 40, 24]], np.int64)
    lora_modules_at(y, x, card.memory.view(np.float32), modules, slots, 3, 8)
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


def test_lora_modules_at_applies_each_module_to_its_columns(card):
    """Three modules reading one x, writing side by side in y (a fused QKV's q, k, v), with
    scales of their own (a module an adapter skips: 0), in one call; rows of a slot apart."""
    rng = np.random.default_rng(5)
    k, r, nslot, widths = 48, 8, 3, (40, 16, 16)
    x = rng.standard_normal((9, k), dtype=np.float32)
    y = rng.standard_normal((9, sum(widths)), dtype=np.float32)
    slots = np.array([1, 0, 1, -1, 2, 0, 1, -1, 2], np.int32)
    modules, ref, col0 = [], y.astype(np.float64), 0
    f32 = card.memory.view(np.float32)
    for m, n in enumerate(widths):
        a = rng.standard_normal((nslot, k, r), dtype=np.float32)
        b = rng.standard_normal((nslot, r, n), dtype=np.float32)
        scales = np.array([0.5, 0.0 if m == 1 else 2.0, 1.5], np.float32)
        modules.append((*_placed(card, a, b, scales), k, n, col0))
        ref = lora_reference(ref, x, a, b, scales, slots, col0)
        col0 += n
    lora_modules_at(y, x, f32, np.array(modules, np.int64), slots, nslot, r)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)
