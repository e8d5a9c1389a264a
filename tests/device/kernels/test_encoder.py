"""The encoder kernels (device/kernels/encoder.py), each against a numpy reference written
beside it: embeddings, LayerNorm, bias, exact GELU, and bidirectional attention over a ragged
batch (padding rows zeroed, strided q/k/v views of a fused projection)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spyre_serve.device.kernels.encoder import (
    add_bias,
    bidirectional_attention,
    embed_rows,
    gelu,
    layernorm,
)


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- references ------------------------------------------------------------------------------

def layernorm_ref(x, w, b, eps):
    x = x.astype(np.float64)
    mean = x.mean(1, keepdims=True)
    var = ((x - mean) ** 2).mean(1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu_ref(x):
    x = x.astype(np.float64)
    return x * 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def attention_ref(q, k, v, query_start, scale):
    out = np.zeros(q.shape, np.float64)
    for s in range(len(query_start) - 1):
        r0, r1 = query_start[s], query_start[s + 1]
        for h in range(q.shape[1] if r1 > r0 else 0):
            scores = q[r0:r1, h].astype(np.float64) @ k[r0:r1, h].astype(np.float64).T * scale
            p = np.exp(scores - scores.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out[r0:r1, h] = p @ v[r0:r1, h]
    return out


# ---- tests -----------------------------------------------------------------------------------

def test_embed_rows_adds_word_type_and_position():
    r = rng(1)
    word = r.standard_normal((50, 24)).astype(np.float32)
    pos = r.standard_normal((20, 24)).astype(np.float32)
    type_row = r.standard_normal(24).astype(np.float32)
    tokens = np.array([3, 0, 49, 7, 7], np.int32)
    positions = np.array([2, 3, 4, 2, 19], np.int32)
    out = np.empty((5, 24), np.float32)
    embed_rows(out, word, pos, type_row, tokens, positions)
    np.testing.assert_array_equal(out, (word[tokens] + type_row) + pos[positions])


def test_embed_rows_refuses_an_id_outside_its_table():
    word, pos = np.zeros((4, 8), np.float32), np.zeros((6, 8), np.float32)
    out, type_row = np.empty((1, 8), np.float32), np.zeros(8, np.float32)
    with pytest.raises(IndexError, match="vocabulary"):
        embed_rows(out, word, pos, type_row, np.array([4], np.int32), np.array([0], np.int32))
    with pytest.raises(IndexError, match="position"):
        embed_rows(out, word, pos, type_row, np.array([0], np.int32), np.array([6], np.int32))


@pytest.mark.parametrize("rows", [3, 600])          # on this thread, and spread over the cores
def test_layernorm_matches_numpy(rows):
    r = rng(rows)
    x = (r.standard_normal((rows, 96)) * 3 + 1.5).astype(np.float32)
    w = r.standard_normal(96).astype(np.float32)
    b = r.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    layernorm(out, x, w, b, 1e-5)
    np.testing.assert_allclose(out, layernorm_ref(x, w, b, 1e-5), rtol=2e-5, atol=2e-5)
    layernorm(x, x, w, b, 1e-5)                      # in place
    np.testing.assert_array_equal(x, out)


def test_layernorm_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="bias length"):
        layernorm(np.empty((2, 8), np.float32), np.zeros((2, 8), np.float32),
                  np.ones(8, np.float32), np.zeros(7, np.float32), 1e-5)


@pytest.mark.parametrize("rows", [2, 900])
def test_add_bias_matches_numpy(rows):
    r = rng(rows + 1)
    x = r.standard_normal((rows, 80)).astype(np.float32)
    b = r.standard_normal(80).astype(np.float32)
    want = x + b
    add_bias(x, b)
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("rows", [2, 900])
def test_gelu_is_the_exact_erf_gelu(rows):
    r = rng(rows + 2)
    x = (r.standard_normal((rows, 64)) * 4).astype(np.float32)
    x[0, :4] = [0.0, -10.0, 10.0, -0.5]
    want = gelu_ref(x)
    gelu(x)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths", [[5, 1, 40], [70], [3, 0, 9]])
def test_bidirectional_attention_matches_numpy(lengths):
    r = rng(sum(lengths))
    hq, d, pad = 4, 16, 6
    real = sum(lengths)
    t = real + pad
    query_start = np.concatenate([[0], np.cumsum(lengths), [real]]).astype(np.int32)  # + an empty seq
    qkv = r.standard_normal((t, 3, hq, d)).astype(np.float32) * 2
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]          # strided views, as the step passes them
    out = np.full((t, hq, d), np.nan, np.float32)
    scale = 1.0 / math.sqrt(d)
    bidirectional_attention(out, q, k, v, query_start, scale)
    want = attention_ref(q, k, v, query_start, scale)
    np.testing.assert_allclose(out[:real], want[:real], rtol=2e-5, atol=2e-5)
    assert not out[real:].any()                        # padding rows: zeros
    qc, kc, vc = (np.ascontiguousarray(a) for a in (q, k, v))
    out2 = np.empty_like(out)
    bidirectional_attention(out2, qc, kc, vc, query_start, scale)
    np.testing.assert_array_equal(out2, out)


def test_bidirectional_attention_each_sequence_sees_only_itself():
    r = rng(5)
    q = r.standard_normal((6, 2, 16)).astype(np.float32)
    k = r.standard_normal((6, 2, 16)).astype(np.float32)
    v = r.standard_normal((6, 2, 16)).astype(np.float32)
    both = np.empty_like(q)
    bidirectional_attention(both, q, k, v, np.array([0, 2, 6], np.int32), 0.25)
    alone = np.empty((4, 2, 16), np.float32)
    bidirectional_attention(alone, q[2:], k[2:], v[2:], np.array([0, 4], np.int32), 0.25)
    np.testing.assert_array_equal(both[2:], alone)


def test_bidirectional_attention_refuses_a_ragged_table_past_t():
    z = np.zeros((4, 1, 16), np.float32)
    with pytest.raises(ValueError, match="query_start"):
        bidirectional_attention(z.copy(), z, z, z, np.array([0, 5], np.int32), 1.0)
