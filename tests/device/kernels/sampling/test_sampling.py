import numpy as np
import pytest
from scipy import stats

from spyre_serve.device.kernels.sampling import (
    BANNED,
    add_logit_bias,
    apply_token_mask,
    count_tokens,
    penalize_row,
    sample_rows,
    top_n_sigma,
    uniform,
)
from spyre_serve.device.kernels.sampling.select import _max, argmax
from spyre_serve.models.step.program import SAMPLE_ROW

V = 1000


def rows_of(s, **cols):
    """SAMPLE_ROW[s]: every row the padding defaults, then each given column (a scalar or a
    list per row)."""
    rows = np.full(s, SAMPLE_ROW.defaults, SAMPLE_ROW.dtype)
    for name, x in cols.items():
        rows[name] = x
    return rows


def _offsets(lists):
    offsets = np.zeros(len(lists) + 1, np.int32)
    offsets[1:] = np.cumsum([len(x) for x in lists])
    return offsets, np.array([t for x in lists for t in x], np.int32)


def _call(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, counter=None, k=0,
          presence=0.0, frequency=0.0, repetition=1.0, penalties=None, bans=None, n_sigma=-1.0):
    """Run `sample_rows` with per-row parameters given as scalars or lists.

    penalties: per row a dict {token_id: output_count} (count 0 = prompt only), put in the
    row's slot of the tables; bans: per row a list of token ids it may not sample."""
    s, v = logits.shape
    counts, prompt = np.zeros((s, v), np.int32), np.zeros((s, v), np.int32)
    for i, pen in enumerate(penalties or []):
        for t, c in pen.items():
            prompt[i, t], counts[i, t] = 1, c
    rows = rows_of(s, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   top_n_sigma=n_sigma, seed=seed, counter=np.arange(s) if counter is None else counter,
                   presence=presence, frequency=frequency, repetition=repetition,
                   pen_slot=np.arange(s))
    ids = np.full(s, -5, np.int32)
    lp = np.full(s, np.nan, np.float32)
    top_ids = np.full((s, k), -5, np.int32)
    top_lp = np.full((s, k), np.nan, np.float32)
    sample_rows(ids, lp, top_ids, top_lp, logits, rows, counts, prompt,
                *_offsets(bans or [[] for _ in range(s)]), np.zeros((0, (v + 31) // 32), np.int32),
                *_offsets([[] for _ in range(s)]), np.zeros(0, np.float32))
    return ids, lp, top_ids, top_lp


def _logits(s, v=V, seed=0, spread=3.0):
    return np.random.default_rng(seed).standard_normal((s, v), dtype=np.float32) * spread


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _repeat(row, n):
    return np.ascontiguousarray(np.broadcast_to(row, (n, row.shape[0])))


# --- reference support sets (numpy, full sort) ------------------------------

def _probs(row, temperature):
    z = row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def _support_top_k(row, k):
    return set(np.argsort(-row)[:k].tolist())


def _support_top_p(row, top_p, temperature=1.0):
    p = _probs(row, temperature)
    order = np.argsort(-p)
    c = np.cumsum(p[order])
    n = int(np.searchsorted(c, top_p * c[-1])) + 1  # smallest prefix reaching top_p
    return set(order[:n].tolist())


def _support_min_p(row, min_p, temperature=1.0):
    p = _probs(row, temperature)
    return set(np.nonzero(p >= min_p * p.max())[0].tolist())


# --- greedy -----------------------------------------------------------------

def test_temperature_zero_is_argmax():
    logits = _logits(9)
    ids, _, _, _ = _call(logits, temperature=0.0)
    np.testing.assert_array_equal(ids, logits.argmax(1))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 256, 257, 1000, 49152])
def test_argmax_and_max_are_numpys_first_largest(n):
    """The blocked argmax (lane maxima per block of 256) against np.argmax: the first of tied
    largest values across and inside blocks, lengths off the lane and block sizes, -inf."""
    rng = np.random.default_rng(n)
    for trial in range(6):
        z = rng.integers(-5, 5, n).astype(np.float32)     # many ties
        if trial == 1:
            z = rng.standard_normal(n).astype(np.float32)
        if trial == 2:
            z[:] = -np.inf
        if trial == 3:
            z[-1] = 100.0                                  # the largest in the last, short block
        if trial == 4 and n > 300:
            z[[3, 256, 299]] = 50.0                        # ties in two blocks: the first wins
        arg, value = argmax(z)
        assert (arg, value) == (int(np.argmax(z)), z.max()), trial
        assert _max(z) == z.max()


def test_top_k_one_is_argmax_at_any_temperature():
    logits = _logits(9, seed=1)
    ids, _, _, _ = _call(logits, temperature=1.5, top_k=1)
    np.testing.assert_array_equal(ids, logits.argmax(1))


def test_single_row_single_token_vocab():
    ids, lp, _, _ = _call(np.zeros((1, 1), np.float32), temperature=1.0)
    assert ids[0] == 0 and lp[0] == 0.0


# --- logprobs ---------------------------------------------------------------

def test_logprob_of_sampled_token_is_raw_log_softmax():
    logits = _logits(6, v=49159, seed=2)
    ids, lp, _, _ = _call(logits, temperature=0.7, top_k=20, repetition=1.3,
                          penalties=[{int(i): 2} for i in logits.argmax(1)])
    ref = _log_softmax(logits)[np.arange(6), ids]
    np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_logprobs_are_raw_top_k_sorted(k):
    logits = _logits(4, seed=3)
    _, _, top_ids, top_lp = _call(logits, temperature=0.0, k=k, frequency=5.0,
                                  penalties=[{int(logits[s].argmax()): 3} for s in range(4)])
    ref_ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_ids, ref_ids)
    np.testing.assert_allclose(top_lp, np.take_along_axis(_log_softmax(logits), ref_ids, 1),
                               rtol=1e-5, atol=1e-4)


def test_top_logprobs_wider_than_vocab_pad_with_minus_one():
    _, _, top_ids, top_lp = _call(np.array([[0.0, 1.0]], np.float32), k=3)
    assert top_ids.tolist() == [[1, 0, -1]]
    assert top_lp[0, 2] == -np.inf


# --- support restrictions ---------------------------------------------------

N_DRAWS = 3000


def _draws(row, **kw):
    ids, _, _, _ = _call(_repeat(row, N_DRAWS), counter=np.arange(N_DRAWS), **kw)
    return set(ids.tolist())


@pytest.mark.parametrize("k", [2, 7, 40])
def test_top_k_draws_stay_in_and_cover_top_k(k):
    row = _logits(1, seed=4, spread=0.5)[0]
    assert _draws(row, top_k=k) == _support_top_k(row, k)


def test_top_k_just_below_vocab_drops_only_the_smallest():
    row = np.array([0.3, -1.0, 0.2, 0.1, 0.0], np.float32)
    assert _draws(row, top_k=4) == {0, 2, 3, 4}


def test_top_k_larger_than_vocab_keeps_everything():
    row = np.array([0.3, -1.0, 0.2], np.float32)
    assert _draws(row, top_k=10) == {0, 1, 2}


@pytest.mark.parametrize("top_p", [0.2, 0.3, 0.5])
def test_top_p_draws_stay_in_and_cover_nucleus(top_p):
    row = _logits(1, seed=5, spread=2.0)[0]
    support = _support_top_p(row, top_p)
    assert 1 < len(support) < 40
    assert _draws(row, top_p=top_p) == support


@pytest.mark.parametrize("min_p", [0.1, 0.2, 0.5])
def test_min_p_draws_stay_in_and_cover_support(min_p):
    row = _logits(1, seed=6, spread=2.0)[0]
    support = _support_min_p(row, min_p, temperature=0.8)
    assert 1 < len(support) < 40
    assert _draws(row, min_p=min_p, temperature=0.8) == support


def _support_n_sigma(row, n):
    """llama.cpp's top-n-sigma (llama_sampler_top_n_sigma_apply): logits below the max minus n
    population standard deviations (over the logits not already -inf) go."""
    kept = row[row > BANNED].astype(np.float64)
    return set(np.nonzero(row >= kept.max() - n * kept.std())[0].tolist())


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_bans_what_llama_cpp_cuts(n):
    row = _logits(1, seed=11)[0]
    row[[3, 500]] = BANNED                              # banned before: outside the statistics
    z = row.copy()
    top_n_sigma(z, np.float32(n))
    assert set(np.nonzero(z > BANNED)[0].tolist()) == _support_n_sigma(row, n)
    kept = z > BANNED
    np.testing.assert_array_equal(z[kept], row[kept])  # the rest untouched


@pytest.mark.parametrize("n", [0.0, -1.0])
def test_top_n_sigma_at_or_below_zero_is_off(n):
    row = _logits(1, seed=12)[0]
    z = row.copy()
    top_n_sigma(z, np.float32(n))
    np.testing.assert_array_equal(z, row)


@pytest.mark.parametrize("n", [0.3, 1.5])
def test_top_n_sigma_draws_stay_in_and_cover_its_support(n):
    row = _logits(1, seed=13, spread=1.0)[0]
    assert _draws(row, n_sigma=n, temperature=1.3) == _support_n_sigma(row, n)


def test_top_p_applies_after_top_k():
    row = _logits(1, seed=7, spread=0.3)[0]
    top = np.argsort(-row)[:20]
    sub = np.full_like(row, -np.inf)
    sub[top] = row[top]
    support = _support_top_p(sub, 0.5)
    assert _draws(row, top_k=20, top_p=0.5) == support


def test_top_p_with_ties_keeps_exact_count():
    # 10 equal tokens, top_p 0.35 needs exactly 4 of them (mass 0.4)
    row = np.zeros(10, np.float32)
    assert len(_draws(row, top_p=0.35)) == 4


# --- determinism ------------------------------------------------------------

def test_same_seed_and_counter_give_same_token_in_any_batch_position():
    target = _logits(1, seed=8, spread=0.5)[0]
    others = _logits(5, seed=9, spread=0.5)
    alone, _, _, _ = _call(target[None], top_p=0.9, seed=1234, counter=[17])
    for pos in range(6):
        batch = np.insert(others, pos, target, axis=0)
        seeds = np.arange(6) + 99
        seeds[pos] = 1234
        counters = np.arange(6) * 3
        counters[pos] = 17
        ids, _, _, _ = _call(batch, top_p=0.9, seed=seeds, counter=counters)
        assert ids[pos] == alone[0]


def test_different_counters_give_different_tokens():
    row = _logits(1, seed=10, spread=0.1)[0]
    assert len(_draws(row)) > 100


def test_different_seeds_give_different_tokens():
    row = _logits(1, seed=11, spread=0.1)[0]
    ids, _, _, _ = _call(_repeat(row, 200), seed=np.arange(200), counter=np.zeros(200))
    assert len(set(ids.tolist())) > 50


def test_uniform_is_in_unit_interval_and_seed_sensitive():
    us = [uniform(np.uint64(s), c) for s in range(50) for c in range(50)]
    assert min(us) >= 0.0 and max(us) < 1.0
    assert len(set(us)) == len(us)


# --- distribution -----------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_match_softmax_chi_square(temperature):
    row = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5], np.float32)
    n = 40000
    ids, _, _, _ = _call(_repeat(row, n), temperature=temperature, seed=42, counter=np.arange(n))
    observed = np.bincount(ids, minlength=row.size)
    expected = _probs(row, temperature) * n
    _, pvalue = stats.chisquare(observed, expected)
    assert pvalue > 1e-3


# --- penalties --------------------------------------------------------------

def _penalized(row, pen, presence, frequency, repetition):
    """vLLM's rule on one row, pen {token: output count} (count 0: prompt only)."""
    prompt = [t for t, c in pen.items() if c == 0]
    output = [t for t, c in pen.items() for _ in range(c)]
    return vllm_apply_penalties(row[None], [prompt], [output], [presence], [frequency],
                                [repetition])[0]


def vllm_apply_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition):
    """vLLM's apply_penalties (vllm/model_executor/layers/utils.py, with the torch form of
    apply_repetition_penalties) in numpy float32: logits [S, V]; per row the prompt's and
    the output's token ids and the three penalties."""
    out = np.array(logits, np.float32)
    s_n, v_n = out.shape
    for s in range(s_n):
        prompt_mask = np.zeros(v_n, bool)
        prompt_mask[np.asarray(prompt_ids[s], np.int64)] = True
        counts = np.bincount(np.asarray(output_ids[s], np.int64), minlength=v_n)
        output_mask = counts > 0
        penalties = np.where(prompt_mask | output_mask, np.float32(repetition[s]), np.float32(1.0))
        penalties = penalties.astype(np.float32)
        out[s] *= np.where(out[s] > 0, np.float32(1.0) / penalties, penalties).astype(np.float32)
        out[s] -= np.float32(frequency[s]) * counts.astype(np.float32)
        out[s] -= np.float32(presence[s]) * output_mask.astype(np.float32)
    return out


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.7, 1.0),
                                                           (0.0, 0.0, 2.0), (0.4, 0.3, 1.3)])
def test_penalties_match_reference_under_greedy(presence, frequency, repetition):
    rng = np.random.default_rng(12)
    logits = _logits(40, v=50, seed=13, spread=1.0)
    pens = []
    for _ in range(40):
        toks = rng.choice(50, size=8, replace=False)
        pens.append({int(t): int(c) for t, c in zip(toks, rng.integers(0, 4, 8), strict=True)})
    ids, _, _, _ = _call(logits, temperature=0.0, presence=presence, frequency=frequency,
                         repetition=repetition, penalties=pens)
    ref = [int(np.argmax(_penalized(logits[s], pens[s], presence, frequency, repetition)))
           for s in range(40)]
    assert ids.tolist() == ref
    assert ids.tolist() != logits.argmax(1).tolist()  # the penalties changed something


def test_prompt_only_tokens_get_repetition_but_not_presence_penalty():
    row = np.array([[1.0, 0.9, -3.0]], np.float32)
    # token 0 seen in the prompt only: repetition 1.2 -> 0.833 < 0.9, presence ignored
    ids, _, _, _ = _call(row, temperature=0.0, presence=10.0, repetition=1.2, penalties=[{0: 0}])
    assert ids[0] == 1
    ids, _, _, _ = _call(row, temperature=0.0, presence=10.0, penalties=[{0: 0}])
    assert ids[0] == 0


def test_penalties_change_sampled_distribution():
    row = np.zeros(4, np.float32)
    ids, _, _, _ = _call(_repeat(row, 2000), frequency=100.0, counter=np.arange(2000),
                         penalties=[{0: 1, 1: 2}] * 2000)
    assert set(ids.tolist()) == {2, 3}


# --- validation -------------------------------------------------------------

def test_rejects_top_p_zero():
    with pytest.raises(ValueError, match="top_p"):
        _call(_logits(1), top_p=0.0)


def test_rejects_per_row_array_of_wrong_length():
    logits = _logits(2)
    counts = np.zeros((1, V), np.int32)
    with pytest.raises(ValueError, match="per-row"):
        sample_rows(np.empty(2, np.int32), np.empty(2, np.float32), np.empty((2, 0), np.int32),
                    np.empty((2, 0), np.float32), logits, rows_of(1), counts, counts.copy(),
                    *_offsets([[], []]), np.zeros((0, 32), np.int32), *_offsets([[], []]),
                    np.zeros(0, np.float32))


def test_sample_rows_is_callable_from_njit_code():
    from numba import njit

    @njit
    def step(ids, lp, tid, tlp, logits, rows, counts, prompt, bo, bi, words, zo, zi, zf):
        sample_rows(ids, lp, tid, tlp, logits, rows, counts, prompt, bo, bi, words, zo, zi, zf)

    logits = _logits(3)
    ids = np.empty(3, np.int32)
    top = logits.argmax(1).astype(np.int32)
    counts = np.zeros((0, V), np.int32)
    step(ids, np.empty(3, np.float32), np.empty((3, 2), np.int32), np.empty((3, 2), np.float32),
         logits, rows_of(3), counts, counts, *_offsets([[int(t)] for t in top]),
         np.zeros((0, 32), np.int32), *_offsets([[]] * 3), np.zeros(0, np.float32))
    ref = [int(np.argmax(_banned(logits[s], [top[s]]))) for s in range(3)]
    assert ids.tolist() == ref


def test_minus_inf_logits_are_never_drawn_and_have_minus_inf_logprob():
    row = np.array([0.0, -np.inf, 1.0, -np.inf, 0.5], np.float32)
    ids, lp, top_ids, top_lp = _call(_repeat(row, 500), counter=np.arange(500), k=5)
    assert set(ids.tolist()) == {0, 2, 4}
    np.testing.assert_allclose(lp, _log_softmax(row[None])[0, ids], rtol=1e-5)
    assert top_ids[0].tolist() == [2, 4, 0, 1, 3]
    assert np.all(np.isneginf(top_lp[:, 3:]))


# --- bans (min_tokens: EOS and stop tokens may not be sampled yet) ----------

def _banned(row, ban):
    """The row with the banned tokens at -inf (the reference)."""
    z = row.astype(np.float64).copy()
    z[list(ban)] = -np.inf
    return z


def test_a_banned_argmax_is_never_chosen_by_greedy():
    rng = np.random.default_rng(20)
    logits = _logits(40, v=60, seed=21, spread=1.0)
    bans = []
    for s in range(40):
        order = np.argsort(-logits[s])
        ban = [int(t) for t in order[:rng.integers(1, 4)]]           # the top 1..3
        ban += [int(t) for t in rng.choice(60, size=3)] + [ban[0]]  # others, a duplicate
        bans.append(ban)
    ids, lp, _, _ = _call(logits, temperature=0.0, bans=bans)
    ref = [int(np.argmax(_banned(logits[s], bans[s]))) for s in range(40)]
    assert ids.tolist() == ref
    assert not any(ids[s] in bans[s] for s in range(40))
    # the logprob stays the one of the raw distribution
    np.testing.assert_allclose(lp, _log_softmax(logits)[np.arange(40), ids], rtol=1e-5, atol=1e-5)


def test_the_ban_applies_after_the_penalties():
    row = np.array([[1.0, 0.9, 0.8, -3.0]], np.float32)
    # the penalty moves the top to token 1, the ban then removes it: token 2
    ids, _, _, _ = _call(row, temperature=0.0, frequency=1.0, penalties=[{0: 1}], bans=[[1]])
    assert ids[0] == 2


@pytest.mark.parametrize("kw", [{}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.3},
                                {"top_k": 4, "top_p": 0.8, "temperature": 0.7}])
def test_banned_tokens_are_never_drawn_and_the_rest_keeps_its_support(kw):
    row = _logits(1, seed=22, spread=0.8)[0][:30].copy()
    order = np.argsort(-row)
    ban = [int(order[0]), int(order[2])]
    z = _banned(row, ban)
    t = kw.get("temperature", 1.0)
    if "top_k" in kw:
        z = np.where(np.isin(np.arange(30), np.argsort(-z)[:kw["top_k"]]), z, -np.inf)
    if "min_p" in kw:
        ref = _support_min_p(z, kw["min_p"], temperature=t)
    elif "top_p" in kw:
        ref = _support_top_p(z, kw["top_p"], temperature=t)
    else:
        ref = set(np.nonzero(np.isfinite(z))[0].tolist())
    got = _draws(row, bans=[ban] * N_DRAWS, **kw)
    assert not got & set(ban)
    assert got == ref


def test_a_ban_keeps_the_raw_top_logprobs():
    logits = _logits(3, seed=23)
    top = logits.argmax(1)
    _, _, top_ids, top_lp = _call(logits, temperature=0.0, k=2, bans=[[int(t)] for t in top])
    assert top_ids[:, 0].tolist() == top.tolist()
    np.testing.assert_allclose(top_lp[:, 0], _log_softmax(logits)[np.arange(3), top], rtol=1e-5)


def test_draws_with_a_ban_match_the_renormalized_softmax():
    row = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5], np.float32)
    n = 40000
    ids, _, _, _ = _call(_repeat(row, n), seed=43, counter=np.arange(n), bans=[[0, 7]] * n)
    observed = np.bincount(ids, minlength=row.size)
    expected = np.exp(_banned(row, [0, 7]) - row.max())
    expected = expected / expected.sum() * n
    assert observed[0] == observed[7] == 0
    _, pvalue = stats.chisquare(observed[1:7], expected[1:7])
    assert pvalue > 1e-3


def test_a_row_banning_every_token_samples_without_its_ban():
    logits = _logits(2, v=4, seed=24)
    ids, _, _, _ = _call(logits, temperature=0.0, bans=[[0, 1, 2, 3, 3], [int(logits[1].argmax())]])
    assert ids[0] == logits[0].argmax()
    assert ids[1] == np.argmax(_banned(logits[1], [logits[1].argmax()]))


def test_a_ban_on_one_row_leaves_the_others_alone():
    logits = _logits(5, seed=25)
    free, _, _, _ = _call(logits, top_p=0.9)
    bans = [[], [int(free[1])], [], [], []]
    ids, _, _, _ = _call(logits, top_p=0.9, bans=bans)
    assert ids[1] != free[1]
    assert ids[[0, 2, 3, 4]].tolist() == free[[0, 2, 3, 4]].tolist()
    empty, _, _, _ = _call(logits, top_p=0.9, bans=[[]] * 5)
    assert empty.tolist() == free.tolist()


def test_rejects_a_banned_token_out_of_vocab():
    with pytest.raises(IndexError, match="token id out of range"):
        _call(_logits(1, v=10), bans=[[10]])


def test_rejects_ban_offsets_of_the_wrong_length():
    logits = _logits(2, v=10)
    counts = np.zeros((0, 10), np.int32)
    with pytest.raises(ValueError, match="offsets"):
        sample_rows(np.empty(2, np.int32), np.empty(2, np.float32), np.empty((2, 0), np.int32),
                    np.empty((2, 0), np.float32), logits, rows_of(2), counts, counts,
                    np.zeros(2, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32),
                    *_offsets([[], []]), np.zeros(0, np.float32))


# --- penalty state on the card: count_tokens and sample_rows ----------

def _state_call(logits, pen_slot, counts, prompt, temperature=0.0, presence=0.0, frequency=0.0,
                repetition=1.0, bans=None, seed=7, masks=None, biases=None):
    """masks: per row an int32[ceil(V/32)] bitmask or None; biases: per row {id: bias}."""
    s, v = logits.shape
    mask_row, words = _mask_args(s, v, masks)
    rows = rows_of(s, temperature=temperature, seed=seed, counter=np.arange(s),
                   presence=presence, frequency=frequency, repetition=repetition,
                   pen_slot=pen_slot, mask_row=mask_row)
    ids, lp = np.full(s, -5, np.int32), np.full(s, np.nan, np.float32)
    sample_rows(ids, lp, np.zeros((s, 0), np.int32), np.zeros((s, 0), np.float32), logits, rows,
                counts, prompt, *_offsets(bans or [[] for _ in range(s)]), words,
                *_bias_args(s, biases))
    return ids, lp


def _mask_args(s, v, masks):
    masks = masks or [None] * s
    rows = [m for m in masks if m is not None]
    words = np.array(rows, np.int32).reshape(len(rows), (v + 31) // 32)
    mask_row, m = np.full(s, -1, np.int32), 0
    for i, mask in enumerate(masks):
        if mask is not None:
            mask_row[i], m = m, m + 1
    return mask_row, words


def _bias_args(s, biases):
    biases = biases or [{} for _ in range(s)]
    offsets = np.zeros(s + 1, np.int32)
    offsets[1:] = np.cumsum([len(b) for b in biases])
    return (offsets, np.array([t for b in biases for t in b], np.int32),
            np.array([x for b in biases for x in b.values()], np.float32))


def bitmask(allowed, v):
    """llguidance's bitmask (int32[ceil(V/32)]) allowing the token ids `allowed`."""
    bits = np.zeros((v + 31) // 32 * 32, np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def ref_apply_mask(z, words):
    """numpy reference of apply_token_mask."""
    v = z.shape[0]
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:v].astype(bool)
    out = z.copy()
    if allowed.any():
        out[~allowed] = BANNED
    return out


def _count(counts, prompt, steps):
    """Run count_tokens over steps: each a list of (slot, prompt_len, start_pos, tokens)."""
    for step in steps:
        tokens = np.array([t for _, _, _, toks in step for t in toks], np.int32)
        positions = np.array([p + j for _, _, p, toks in step for j in range(len(toks))], np.int32)
        query_start = np.zeros(len(step) + 1, np.int32)
        query_start[1:] = np.cumsum([len(toks) for *_, toks in step])
        count_tokens(counts, prompt, np.array([slot for slot, *_ in step], np.int32),
                     np.array([n for _, n, *_ in step], np.int32), query_start, positions, tokens)


def test_count_tokens_puts_the_prompt_in_the_mask_and_generated_tokens_in_the_counts():
    v = 50
    counts, prompt = np.full((3, v), 77, np.int32), np.full((3, v), 77, np.int32)  # stale slots
    p0, out0 = [4, 5, 4, 9, 1], [9, 9, 12, 4]       # slot 2: a prompt of 5, 4 generated
    p1 = [30, 31, 32, 33, 34, 35]                   # slot 0: a prompt of 6 in two chunks
    _count(counts, prompt, [
        [(2, 5, 0, p0), (0, 6, 0, p1[:4]), (-1, 3, 0, [7, 7, 7])],  # -1: no penalties, untouched
        [(2, 5, 5, out0[:1]), (0, 6, 4, p1[4:])],
        [(2, 5, 6, out0[1:3])],
        [(2, 5, 8, out0[3:]), (0, 6, 6, [30])],
    ])
    assert prompt[2].tolist() == np.isin(np.arange(v), p0).astype(np.int32).tolist()
    assert counts[2].tolist() == np.bincount(out0, minlength=v).tolist()
    assert prompt[0].tolist() == np.isin(np.arange(v), p1).astype(np.int32).tolist()
    assert counts[0].tolist() == np.bincount([30], minlength=v).tolist()
    assert (counts[1] == 77).all() and (prompt[1] == 77).all()


def test_a_recompute_from_position_zero_rebuilds_the_slot_without_double_counting():
    v = 20
    counts, prompt = np.zeros((1, v), np.int32), np.zeros((1, v), np.int32)
    _count(counts, prompt, [[(0, 3, 0, [1, 2, 3])], [(0, 3, 3, [5])], [(0, 3, 4, [5])]])
    before = counts.copy(), prompt.copy()
    _count(counts, prompt, [[(0, 3, 0, [1, 2, 3, 5, 5])]])   # preempted, recomputed whole
    assert counts.tolist() == before[0].tolist() and prompt.tolist() == before[1].tolist()
    assert counts[0, 5] == 2 and prompt[0, [1, 2, 3]].tolist() == [1, 1, 1]


def test_count_tokens_rejects_a_slot_or_token_out_of_range():
    counts, prompt = np.zeros((2, 10), np.int32), np.zeros((2, 10), np.int32)
    with pytest.raises(IndexError, match="slot or rows"):
        _count(counts, prompt, [[(2, 1, 0, [1])]])
    with pytest.raises(IndexError, match="token id"):
        _count(counts, prompt, [[(0, 1, 0, [10])]])


def _random_history(rng, v, n_prompt, n_out):
    return rng.integers(0, v, n_prompt).tolist(), rng.integers(0, v, n_out).tolist()


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.7, 1.0),
                                                           (0.0, 0.0, 1.7), (0.4, 0.3, 1.3),
                                                           (-0.5, -0.2, 0.8)])
def test_penalties_from_the_tables_are_vllms_bit_for_bit(presence, frequency, repetition):
    rng = np.random.default_rng(31)
    v, s = 64, 24
    logits = _logits(s, v=v, seed=32, spread=1.0)
    counts, prompt = np.zeros((s, v), np.int32), np.zeros((s, v), np.int32)
    hist = [_random_history(rng, v, int(rng.integers(1, 20)), int(rng.integers(0, 12)))
            for _ in range(s)]
    _count(counts, prompt, [[(i, len(p), 0, p + o) for i, (p, o) in enumerate(hist)]])
    want = vllm_apply_penalties(logits, [p for p, _ in hist], [o for _, o in hist],
                                [presence] * s, [frequency] * s, [repetition] * s)
    for i in range(s):
        z = np.empty(v, np.float32)
        penalize_row(z, logits[i], np.float32(presence), np.float32(frequency),
                        np.float32(repetition), counts[i], prompt[i])
        np.testing.assert_array_equal(z, want[i])
    ids, _ = _state_call(logits, np.arange(s), counts, prompt, presence=presence,
                         frequency=frequency, repetition=repetition)
    assert ids.tolist() == want.argmax(1).tolist()
    assert ids.tolist() != logits.argmax(1).tolist()  # the penalties changed something


def test_presence_and_frequency_count_generated_tokens_only_whatever_the_repetition():
    # token 0 is in the prompt only, token 1 was generated once: presence and frequency hit
    # token 1 alone, even with a repetition penalty (which hits both)
    row = np.array([[2.0, 1.9, 1.5]], np.float32)
    counts, prompt = np.zeros((1, 3), np.int32), np.zeros((1, 3), np.int32)
    _count(counts, prompt, [[(0, 1, 0, [0, 1])]])
    for repetition in (1.0, 1.05):
        ids, _ = _state_call(row, [0], counts, prompt, presence=5.0, repetition=repetition)
        assert ids[0] == 0
        ids, _ = _state_call(row, [0], counts, prompt, frequency=5.0, repetition=repetition)
        assert ids[0] == 0
    ids, _ = _state_call(row, [0], counts, prompt, repetition=1.5)   # 1.9/1.5 < 2/1.5 < 1.5
    assert ids[0] == 2


def test_a_row_without_a_slot_is_not_penalized_and_its_logprob_stays_raw():
    logits = _logits(3, v=40, seed=33)
    counts, prompt = np.zeros((1, 40), np.int32), np.zeros((1, 40), np.int32)
    counts[0, logits.argmax(1)] = 1
    ids, lp = _state_call(logits, [-1, 0, -1], counts, prompt, presence=100.0)
    assert ids[[0, 2]].tolist() == logits[[0, 2]].argmax(1).tolist()
    assert ids[1] != logits[1].argmax()
    np.testing.assert_allclose(lp, _log_softmax(logits)[np.arange(3), ids], atol=1e-5)


def test_sample_rows_bans_after_the_penalties_and_samples_the_same_as_the_lists():
    logits = _logits(6, v=30, seed=34)
    rng = np.random.default_rng(35)
    hist = [_random_history(rng, 30, 5, 6) for _ in range(6)]
    counts, prompt = np.zeros((6, 30), np.int32), np.zeros((6, 30), np.int32)
    _count(counts, prompt, [[(i, 5, 0, p + o) for i, (p, o) in enumerate(hist)]])
    pens = [{**{t: 0 for t in p}, **{int(t): int(c) for t, c in zip(*np.unique(o, return_counts=True),
                                                                     strict=True)}}
            for p, o in hist]
    bans = [[int(logits[i].argmax())] for i in range(6)]
    kw = dict(temperature=0.8, presence=0.3, frequency=0.4, repetition=1.2, bans=bans)
    lists, _, _, _ = _call(logits, counter=np.arange(6), penalties=pens, **kw)
    tables, _ = _state_call(logits, np.arange(6), counts, prompt, **kw)
    assert tables.tolist() == lists.tolist()
    assert all(t != b[0] for t, b in zip(tables, bans, strict=True))


def test_sample_rows_rejects_a_slot_out_of_range():
    counts = np.zeros((2, 10), np.int32)
    with pytest.raises(IndexError, match="pen_slot"):
        _state_call(_logits(1, v=10), [2], counts, counts.copy())


# --- grammar masks and logit bias (sample_rows) -------------------------

@pytest.mark.parametrize("v", [1, 31, 32, 33, 1000, 8192])
def test_apply_token_mask_is_the_numpy_reference(v):
    rng = np.random.default_rng(v)
    for density in (0.0, 0.01, 0.5, 1.0):
        allowed = np.nonzero(rng.random(v) < density)[0]
        words = bitmask(allowed, v)
        z = rng.standard_normal(v).astype(np.float32)
        want = ref_apply_mask(z, words)
        got = z.copy()
        n = apply_token_mask(got, words)
        np.testing.assert_array_equal(got, want)
        assert n == len(allowed)


def test_apply_token_mask_matches_llguidance_numpy_helper():
    lln = pytest.importorskip("llguidance.numpy")
    v = 100
    words = bitmask([3, 40, 99], v)
    z = np.arange(v, dtype=np.float32)[None, :].copy()
    lln.apply_token_bitmask_inplace(z, words[None, :])
    got = np.arange(v, dtype=np.float32)
    apply_token_mask(got, words)
    assert np.isfinite(z[0]).nonzero()[0].tolist() == (got > BANNED).nonzero()[0].tolist() == [3, 40, 99]


def test_a_mask_restricts_greedy_and_random_draws_and_rows_without_one_are_free():
    v, s = 300, 4
    logits = _logits(s, v=v, seed=41)
    counts, prompt = np.zeros((1, v), np.int32), np.zeros((1, v), np.int32)
    allowed = [5, 17, 250]
    masks = [bitmask(allowed, v), None, bitmask([7], v), None]
    for temperature in (0.0, 1.0):
        for seed in range(20):
            ids, lp = _state_call(logits, [-1] * s, counts, prompt, temperature=temperature,
                                  seed=seed, masks=masks)
            assert ids[0] in allowed and ids[2] == 7
            np.testing.assert_allclose(lp, _log_softmax(logits)[np.arange(s), ids], atol=1e-5)
        if temperature == 0.0:
            assert ids[0] == allowed[int(np.argmax(logits[0, allowed]))]
            assert ids[[1, 3]].tolist() == logits[[1, 3]].argmax(1).tolist()


def test_the_mask_wins_over_a_ban_that_would_leave_nothing():
    v = 64
    logits = _logits(2, v=v, seed=42)
    counts, prompt = np.zeros((1, v), np.int32), np.zeros((1, v), np.int32)
    # row 0: the grammar allows only 9 (an EOS), min_tokens bans 9: 9 is sampled
    # row 1: the grammar allows 9 and 10, the ban takes 9: 10 is sampled
    ids, _ = _state_call(logits, [-1, -1], counts, prompt, bans=[[9], [9]],
                         masks=[bitmask([9], v), bitmask([9, 10], v)])
    assert ids.tolist() == [9, 10]


def test_logit_bias_is_added_before_the_penalties_and_moves_greedy():
    v = 50
    logits = _logits(3, v=v, seed=43)
    counts, prompt = np.zeros((3, v), np.int32), np.zeros((3, v), np.int32)
    low = [int(np.argmin(row)) for row in logits]
    ids, lp = _state_call(logits, [-1, -1, -1], counts, prompt,
                          biases=[{low[0]: 100.0}, {}, {int(logits[2].argmax()): -100.0}])
    assert ids[0] == low[0] and ids[1] == logits[1].argmax() and ids[2] != logits[2].argmax()
    np.testing.assert_allclose(lp, _log_softmax(logits)[np.arange(3), ids], atol=1e-5)  # raw
    # bias then repetition penalty (vLLM order): a positive biased logit is divided by r
    row = np.array([[1.0, 1.5]], np.float32)
    c, p = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32)
    p[0, 0] = 1                                   # token 0 is in the prompt
    ids, _ = _state_call(row, [0], c, p, repetition=2.0, biases=[{0: 1.5}])
    assert ids[0] == 1                            # (1 + 1.5) / 2 = 1.25 < 1.5
    z = row[0].copy()
    add_logit_bias(z, np.array([0], np.int32), np.array([1.5], np.float32))
    assert z.tolist() == [2.5, 1.5]


def test_sample_rows_rejects_bad_masks_and_biases():
    v = 40
    logits = _logits(1, v=v)
    counts = np.zeros((1, v), np.int32)
    with pytest.raises(IndexError, match="token id out of range"):
        _state_call(logits, [-1], counts, counts.copy(), biases=[{v: 1.0}])
    with pytest.raises(ValueError, match="not finite"):
        _state_call(logits, [-1], counts, counts.copy(), biases=[{1: np.inf}])
    with pytest.raises(IndexError, match="mask_row"):
        sample_rows(np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros((1, 0), np.int32),
                    np.zeros((1, 0), np.float32), logits, rows_of(1, mask_row=1), counts,
                    counts.copy(), *_offsets([[]]), np.zeros((1, 2), np.int32), *_offsets([[]]),
                    np.zeros(0, np.float32))
