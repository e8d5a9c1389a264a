"""The online-softmax block update both attention kernels share, against numpy's softmax of
all the blocks at once, a row that sees only masked scores (in the first blocks, or in all)
included."""

import numpy as np
import pytest

from spyre_serve.device.kernels.attention.online_softmax import NEG_BIG, online_softmax_block


def run_blocks(scores, v, block):
    """Fold scores [nq, n] and values v [n, dv] block by block; acc / denom (0 where none)."""
    nq, n = scores.shape
    m = np.full(nq, NEG_BIG, np.float32)
    denom = np.zeros(nq, np.float32)
    acc = np.zeros((nq, v.shape[1]), np.float32)
    bits = np.empty(2 * nq, np.int32)
    for k0 in range(0, n, block):
        s = scores[:, k0:k0 + block].copy()       # the update overwrites it with the weights
        online_softmax_block(s, m, denom, acc, bits)
        acc += s @ v[k0:k0 + block]
    out = np.zeros_like(acc)
    seen = denom > 0
    out[seen] = acc[seen] / denom[seen, None]
    return out, denom


def reference(scores, v):
    """softmax(scores) @ v in float64, a row with no visible score giving 0."""
    s = scores.astype(np.float64)
    visible = s > NEG_BIG / 2
    out = np.zeros((s.shape[0], v.shape[1]))
    for r in range(s.shape[0]):
        if visible[r].any():
            w = np.where(visible[r], np.exp(s[r] - s[r][visible[r]].max()), 0.0)
            out[r] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_blocks_fold_to_the_softmax_of_the_whole_row(block):
    rng = np.random.default_rng(block)
    scores = (rng.standard_normal((6, 50)) * 4).astype(np.float32)
    v = rng.standard_normal((50, 8)).astype(np.float32)
    scores[1, :30] = NEG_BIG               # masked in the first blocks, visible later
    scores[2, 7] = NEG_BIG                 # one masked key
    scores[3, :] = NEG_BIG                 # nothing visible at all
    got, denom = run_blocks(scores, v, block)
    np.testing.assert_allclose(got, reference(scores, v), rtol=2e-5, atol=2e-6)
    assert denom[3] == 0.0 and np.all(got[3] == 0.0)


def test_a_fully_masked_block_leaves_the_running_state_alone():
    m = np.array([1.5, NEG_BIG], np.float32)
    denom = np.array([2.0, 0.0], np.float32)
    acc = np.ones((2, 3), np.float32)
    scores = np.full((2, 4), NEG_BIG, np.float32)
    online_softmax_block(scores, m, denom, acc, np.empty(4, np.int32))
    assert m.tolist() == [1.5, NEG_BIG] and denom.tolist() == [2.0, 0.0]
    assert np.all(acc == 1.0) and np.all(scores == 0.0)


def test_a_scratch_too_short_is_refused_naming_the_sizes():
    scores = np.zeros((2, 4), np.float32)
    m, denom, acc = np.full(2, NEG_BIG, np.float32), np.zeros(2, np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="needs 2 nq values"):
        online_softmax_block(scores, m, denom, acc, np.empty(3, np.int32))
