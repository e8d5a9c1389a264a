import numpy as np
import pytest
import torch

from spyre_serve.device.kernels.rope import rope_apply, rope_inplace, rope_tables, split_rope


def _reference(x, positions, theta):
    # transformers: inv_freq = 1 / theta ** (arange(0, D, 2) / D); freqs in float32;
    # emb = cat(freqs, freqs); x * cos + rotate_half(x) * sin
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.from_numpy(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xt = torch.from_numpy(x)
    x1, x2 = xt[..., : d // 2], xt[..., d // 2:]
    rot = torch.cat((-x2, x1), dim=-1)
    return (xt * cos + rot * sin).numpy(), inv_freq.numpy()


@pytest.mark.parametrize("t,nh,d,theta", [(1, 1, 2, 10000.0), (3, 5, 6, 10000.0), (17, 4, 128, 1e7)])
def test_rope_matches_transformers(t, nh, d, theta):
    rng = np.random.default_rng(t)
    x = rng.standard_normal((t, nh, d), dtype=np.float32)
    positions = rng.integers(0, 5000, t).astype(np.int32)
    ref, inv_freq = _reference(x, positions, theta)
    rope_inplace(x, positions, inv_freq)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=2e-5)


def test_rope_position_zero_is_identity():
    x = np.random.default_rng(0).standard_normal((2, 3, 8), dtype=np.float32)
    before = x.copy()
    rope_inplace(x, np.zeros(2, np.int32), np.ones(4, np.float32))
    np.testing.assert_array_equal(x, before)


def test_rope_rejects_wrong_inv_freq_length():
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_inplace(x, np.zeros(2, np.int32), np.ones(3, np.float32))


def test_tables_once_then_apply_equals_the_one_call_rotation():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    positions = np.array([0, 7, 300, 4095, 2], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(4) / 4)).astype(np.float32)
    want = x.copy()
    rope_inplace(want, positions, inv_freq)
    cos, sin = np.empty((5, 4), np.float32), np.empty((5, 4), np.float32)
    rope_tables(cos, sin, positions, inv_freq)
    rope_apply(x, cos, sin)
    np.testing.assert_array_equal(x, want)


def test_split_rope_is_the_split_then_each_rotation():
    rng = np.random.default_rng(4)
    t, hq, hkv, d = 6, 4, 2, 8
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32)
    positions = np.array([3, 0, 9, 100, 5, 6], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(d // 2) / (d // 2))).astype(np.float32)
    cos, sin = np.empty((t, d // 2), np.float32), np.empty((t, d // 2), np.float32)
    rope_tables(cos, sin, positions, inv_freq)
    q, k, v = (np.empty((t, hq, d), np.float32), np.empty((t, hkv, d), np.float32),
               np.empty((t, hkv, d), np.float32))
    split_rope(q, k, v, qkv, cos, sin)
    want_q = np.ascontiguousarray(qkv[:, :hq * d]).reshape(t, hq, d)
    want_k = np.ascontiguousarray(qkv[:, hq * d:(hq + hkv) * d]).reshape(t, hkv, d)
    rope_inplace(want_q, positions, inv_freq)
    rope_inplace(want_k, positions, inv_freq)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, qkv[:, (hq + hkv) * d:].reshape(t, hkv, d))
