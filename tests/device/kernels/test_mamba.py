"""The Mamba-2 kernels against a numpy reference (the recurrence in float64) and against
transformers' own functions (the chunked SSD scan a prompt takes, the state update a decode
token takes, the causal conv1d, the gated RMSNorm), over a ragged batch whose sequences start
from zeros or go on from a state."""

import numpy as np
import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from spyre_serve.device.kernels.mamba import gated_rmsnorm, mamba_conv, ssm_scan

K, H, P, N, G = 4, 6, 8, 16, 2      # conv width, heads, head dim, state size, groups
C = H * P + 2 * G * N               # the conv's channels: x, B, C


def _ragged(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ---- numpy references ----------------------------------------------------------------------

def conv_reference(x, w, bias, state):
    """One sequence: silu of the causal depthwise conv over [state; x]; the new state."""
    win = np.concatenate([state, x]).astype(np.float64)
    out = np.stack([bias + (w * win[t:t + K].T).sum(1) for t in range(len(x))])
    return out / (1 + np.exp(-out)), win[len(x):]


def scan_reference(x, dt, b, c, a, d, dt_bias, state):
    """One sequence, float64: the recurrence token by token; y [T, H * P], the new state."""
    state = state.astype(np.float64).copy()
    y = np.zeros((len(x), H * P))
    for t in range(len(x)):
        v = dt[t] + dt_bias
        delta = np.where(v > 20, v, np.log1p(np.exp(v)))
        for h in range(H):
            g = h // (H // G)
            bt, ct = b[t, g * N:(g + 1) * N], c[t, g * N:(g + 1) * N]
            xh = x[t, h * P:(h + 1) * P].astype(np.float64)
            state[h] = state[h] * np.exp(delta[h] * a[h]) + delta[h] * np.outer(xh, bt)
            y[t, h * P:(h + 1) * P] = state[h] @ ct + d[h] * xh
    return y, state


def gated_reference(y, z, w, group, eps):
    v = y.astype(np.float64) * (z / (1 + np.exp(-z.astype(np.float64))))
    g = v.reshape(len(v), -1, group)
    g = g / np.sqrt((g ** 2).mean(-1, keepdims=True) + eps)
    return w * g.reshape(v.shape)


# ---- inputs ----------------------------------------------------------------------------------

def conv_inputs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sum(lengths), C), dtype=np.float32)
    w = rng.standard_normal((C, K), dtype=np.float32) * 0.5
    bias = rng.standard_normal(C, dtype=np.float32) * 0.1
    states = rng.standard_normal((len(lengths) + 2, K - 1, C), dtype=np.float32)
    return x, w, bias, states


def scan_inputs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    t = sum(lengths)
    x = rng.standard_normal((t, H * P), dtype=np.float32)
    dt = rng.standard_normal((t, H), dtype=np.float32)
    b = rng.standard_normal((t, G * N), dtype=np.float32) * 0.5
    c = rng.standard_normal((t, G * N), dtype=np.float32) * 0.5
    a = -np.exp(rng.standard_normal(H, dtype=np.float32))
    d = rng.standard_normal(H, dtype=np.float32)
    dt_bias = rng.standard_normal(H, dtype=np.float32) * 0.5
    states = rng.standard_normal((len(lengths) + 2, H, P, N), dtype=np.float32) * 0.1
    return x, dt, b, c, a, d, dt_bias, states


# ---- the kernels against numpy -------------------------------------------------------------

@pytest.mark.parametrize("lengths,reset", [([5, 1, 40], [1, 0, 1]), ([1, 1, 1], [0, 0, 0]), ([70], [0])])
def test_conv_matches_numpy_for_each_sequence_and_leaves_its_last_inputs(lengths, reset):
    x, w, bias, states = conv_inputs(lengths)
    slots = np.arange(len(lengths), dtype=np.int32)[::-1] + 1       # not the work order
    before = states.copy()
    out = np.full_like(x, np.nan)
    mamba_conv(out, x, w, bias, states, _ragged(lengths), slots, np.array(reset, np.int8))
    start = _ragged(lengths)
    for s, slot in enumerate(slots):
        st0 = np.zeros_like(before[slot]) if reset[s] else before[slot]
        want, want_state = conv_reference(x[start[s]:start[s + 1]], w, bias, st0)
        np.testing.assert_allclose(out[start[s]:start[s + 1]], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(states[slot], want_state, rtol=0, atol=0)
    np.testing.assert_array_equal(states[0], before[0])                # a slot no sequence holds


@pytest.mark.parametrize("lengths,reset", [([5, 1, 40], [1, 0, 1]), ([1, 1], [0, 0]), ([300], [1])])
def test_scan_matches_the_recurrence_for_each_sequence_and_leaves_its_state(lengths, reset):
    x, dt, b, c, a, d, dt_bias, states = scan_inputs(lengths)
    slots = np.arange(len(lengths), dtype=np.int32) + 1
    before = states.copy()
    y = np.full_like(x, np.nan)
    ssm_scan(y, x, dt, b, c, a, d, dt_bias, np.float32(0.0), np.float32(np.inf), states,
             _ragged(lengths), slots, np.array(reset, np.int8))
    start = _ragged(lengths)
    for s, slot in enumerate(slots):
        rows = slice(start[s], start[s + 1])
        st0 = np.zeros_like(before[slot]) if reset[s] else before[slot]
        want, want_state = scan_reference(x[rows], dt[rows], b[rows], c[rows], a, d, dt_bias, st0)
        np.testing.assert_allclose(y[rows], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(states[slot], want_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(states[0], before[0])


def test_a_prompt_in_two_chunks_is_the_prompt_in_one():
    x, dt, b, c, a, d, dt_bias, states = scan_inputs([50])
    one, two = states.copy(), states.copy()
    y1, y2 = np.empty_like(x), np.empty_like(x)
    args = (a, d, dt_bias, np.float32(0.0), np.float32(np.inf))
    ssm_scan(y1, x, dt, b, c, *args, one, _ragged([50]), np.array([1], np.int32), np.array([1], np.int8))
    for rows, reset in ((slice(0, 32), 1), (slice(32, 50), 0)):
        n = rows.stop - rows.start
        ssm_scan(y2[rows], x[rows], dt[rows], b[rows], c[rows], *args, two, _ragged([n]),
                 np.array([1], np.int32), np.array([reset], np.int8))
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(one, two)


def test_dt_limits_clamp_the_step():
    x, dt, b, c, a, d, dt_bias, states = scan_inputs([3])
    y = np.empty_like(x)
    ssm_scan(y, x, dt, b, c, a, d, dt_bias, np.float32(0.25), np.float32(0.25), states, _ragged([3]),
             np.array([0], np.int32), np.array([1], np.int8))
    state = np.zeros((H, P, N))
    want = np.zeros((3, H * P))
    for t in range(3):
        for h in range(H):
            g = h // (H // G)
            xh = x[t, h * P:(h + 1) * P].astype(np.float64)
            state[h] = state[h] * np.exp(0.25 * a[h]) + 0.25 * np.outer(xh, b[t, g * N:(g + 1) * N])
            want[t, h * P:(h + 1) * P] = state[h] @ c[t, g * N:(g + 1) * N] + d[h] * xh
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [8, 48])
def test_gated_rmsnorm_matches_numpy(group):
    rng = np.random.default_rng(group)
    y = rng.standard_normal((7, 48), dtype=np.float32)
    z = rng.standard_normal((7, 48), dtype=np.float32) * 3
    w = rng.standard_normal(48, dtype=np.float32)
    out = np.full_like(y, np.nan)
    gated_rmsnorm(out, y, z, w, group, 1e-6)
    np.testing.assert_allclose(out, gated_reference(y, z, w, group, 1e-6), rtol=1e-4, atol=1e-5)


def test_shapes_that_disagree_are_refused():
    x, w, bias, states = conv_inputs([2])
    with pytest.raises(ValueError, match="states are not"):
        mamba_conv(np.empty_like(x), x, w, bias, states[:, :1], _ragged([2]), np.zeros(1, np.int32),
                   np.ones(1, np.int8))
    y = np.empty((2, 10), np.float32)
    with pytest.raises(ValueError, match="group does not divide"):
        gated_rmsnorm(y, y, y, np.ones(10, np.float32), 4, 1e-6)


# ---- the kernels against transformers' Mamba-2 functions ------------------------------------

def test_a_prompt_then_decode_tokens_match_transformers():
    """A 300-token prompt (over transformers' 256-token SSD chunk) from a given state, then two
    decode tokens: the chunked scan and the state update, against ours."""
    x, dt, b, c, a, d, dt_bias, states = scan_inputs([302], seed=3)
    t = lambda v: torch.from_numpy(np.ascontiguousarray(v))                   # noqa: E731
    init = states[0].copy()
    y_hf, state_hf = hf.mamba2_chunk_scan(
        t(x[:300]).view(1, 300, H, P), t(dt[:300])[None], t(a), t(b[:300]).view(1, 300, G, N),
        t(c[:300]).view(1, 300, G, N), chunk_size=256, D=t(d), dt_bias=t(dt_bias), initial_states=t(init)[None],
        dt_softplus=True, return_final_states=True)
    ours = np.empty_like(x)
    ssm_scan(ours[:300], x[:300], dt[:300], b[:300], c[:300], a, d, dt_bias, np.float32(0.0), np.float32(np.inf),
             states, _ragged([300]), np.array([0], np.int32), np.array([0], np.int8))
    np.testing.assert_allclose(ours[:300], y_hf.reshape(300, H * P).numpy(), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(states[0], state_hf[0].numpy(), rtol=2e-3, atol=2e-3)
    state = state_hf.clone()
    for i in (300, 301):
        out = hf.mamba2_selective_state_update(
            state, t(x[i]).view(1, H, P), t(dt[i])[None, :, None].expand(1, H, P), t(a)[:, None, None].expand(H, P, N),
            t(b[i]).view(1, G, N), t(c[i]).view(1, G, N), t(d)[:, None].expand(H, P),
            dt_bias=t(dt_bias)[:, None].expand(H, P), dt_softplus=True)
        ssm_scan(ours[i:i + 1], x[i:i + 1], dt[i:i + 1], b[i:i + 1], c[i:i + 1], a, d, dt_bias, np.float32(0.0),
                 np.float32(np.inf), states, _ragged([1]), np.array([0], np.int32), np.array([0], np.int8))
        np.testing.assert_allclose(ours[i], out.reshape(-1).numpy(), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(states[0], state[0].numpy(), rtol=2e-3, atol=2e-3)


def test_conv_prefill_then_decode_match_transformers():
    x, w, bias, states = conv_inputs([9])
    t = lambda v: torch.from_numpy(np.ascontiguousarray(v))                   # noqa: E731
    want = hf.causal_conv1d_fn(t(x[:8]).T[None], t(w), t(bias), activation="silu")[0].T.numpy()
    out = np.empty_like(x)
    mamba_conv(out[:8], x[:8], w, bias, states, _ragged([8]), np.array([1], np.int32), np.array([1], np.int8))
    np.testing.assert_allclose(out[:8], want, rtol=1e-5, atol=1e-5)
    conv_state = t(x[8 - (K - 1):8].T.copy())[None]                          # transformers' [1, C, K - 1]
    want = hf.causal_conv1d_update(t(x[8:9]).T[None], conv_state, t(w), t(bias), activation="silu")[0].T.numpy()
    mamba_conv(out[8:], x[8:], w, bias, states, _ragged([1]), np.array([1], np.int32), np.array([0], np.int8))
    np.testing.assert_allclose(out[8:], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(states[1], conv_state[0].numpy().T)        # both hold the last K - 1 inputs


def test_gated_rmsnorm_matches_transformers():
    rng = np.random.default_rng(5)
    y = rng.standard_normal((4, 64), dtype=np.float32)
    z = rng.standard_normal((4, 64), dtype=np.float32)
    norm = hf.GraniteMoeHybridRMSNormGated(64, group_size=32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.standard_normal(64, dtype=np.float32)))
        want = norm(torch.from_numpy(y), torch.from_numpy(z)).numpy()
    out = np.empty_like(y)
    gated_rmsnorm(out, y, z, norm.weight.detach().numpy(), 32, 1e-6)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
