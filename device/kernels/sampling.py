"""On-device sampling for a batch of rows of logits, and the per-sequence penalty state.

    sample(out_ids, out_logprobs, out_top_ids, out_top_logprobs,
           logits, temperature, top_k, top_p, min_p, seeds, counters,
           presence_penalty, frequency_penalty, repetition_penalty,
           penalty_offsets, penalty_ids, penalty_counts,
           ban_offsets=None, ban_ids=None)
    sample_with_state(out_ids, out_logprobs, out_top_ids, out_top_logprobs,
           logits, temperature, top_k, top_p, min_p, seeds, counters,
           presence_penalty, frequency_penalty, repetition_penalty,
           pen_slot, output_counts, prompt_mask, ban_offsets, ban_ids,
           mask_row, mask_words, bias_offsets, bias_ids, bias_values)
    apply_token_mask(z, words); add_logit_bias(z, ids, values)
    count_tokens(output_counts, prompt_mask, count_slot, prompt_lens,
                 query_start, positions, tokens)

Outputs (first):
    out_ids            int32[S]      sampled token of each row
    out_logprobs       float32[S]    its logprob under the raw distribution
                                     (log_softmax of the unpenalized, untempered logits)
    out_top_ids        int32[S, K]   the K most likely tokens of the raw distribution,
                                     most likely first (K may be 0)
    out_top_logprobs   float32[S, K] their raw logprobs
Inputs:
    logits             float32[S, V] (not modified)
    temperature        float32[S]    0 -> greedy (argmax of the penalized logits)
    top_k              int32[S]      0 -> off; 1 -> greedy
    top_p              float32[S]    in (0, 1]; 1 -> off
    min_p              float32[S]    in [0, 1]; 0 -> off
    seeds              uint64[S]     per-request seed
    counters           int64[S]      tokens the request generated so far
    presence_penalty   float32[S]    OpenAI: logit -= presence if the token was generated
    frequency_penalty  float32[S]    OpenAI: logit -= frequency * times it was generated
    repetition_penalty float32[S]    vLLM: a token seen in the prompt or generated has its
                                     logit scaled by 1/r if > 0, else by r; 1 -> off
  the tokens a row has seen, as lists (`sample`):
    penalty_offsets    int32[S+1]    row s owns penalty_ids[offsets[s]:offsets[s+1]]
    penalty_ids        int32[N]      tokens seen in the prompt or the output, unique per row
    penalty_counts     int32[N]      occurrences of each in the output (0: prompt only)
  or as per-sequence tables kept on the card (`sample_with_state`):
    pen_slot           int32[S]      the table row of each sampling row, -1: no penalties
    output_counts      int32[P, V]   per slot: times each token was generated
    prompt_mask        int32[P, V]   per slot: 1 where the token is in the prompt
  the bans:
    ban_offsets        int32[S+1]    optional in `sample` (both or neither): row s may not
    ban_ids            int32[M]      sample ban_ids[ban_offsets[s]:ban_offsets[s+1]] (vLLM's
                                     min_tokens: EOS and stop tokens); duplicates allowed
  the grammar masks and logit biases (`sample_with_state`):
    mask_row           int32[S]      row of mask_words holding row s's allowed tokens, -1: none
    mask_words         int32[M, W]   W = ceil(V / 32) words per mask: token t is allowed when
                                     bit t % 32 of word t // 32 is set (llguidance's bitmask)
    bias_offsets       int32[S+1]    row s adds bias_values[o[s]:o[s+1]] to the logits of
    bias_ids           int32[B]      bias_ids[o[s]:o[s+1]] (OpenAI's logit_bias; unique per row)
    bias_values        float32[B]

`count_tokens` fills the tables: for each sequence s of a step with count_slot[s] >= 0,
its token rows query_start[s]..query_start[s+1]-1 are counted into its slot, a row at a
position below prompt_lens[s] into prompt_mask, the others (generated tokens fed back, or
recomputed after a preemption) into output_counts; a chunk starting at position 0 clears
the slot first. So a step counts the tokens it computes, a from-device decode token
included, and the penalties of its samples see every token before them: the host sends
a slot number per sequence, never the token history.

Order per row, vLLM v1's (vllm/model_executor/layers/utils.py apply_penalties, in float32):
the logit bias (vLLM applies it before the penalties), the repetition scale (x * (1/r) for x > 0, x * r otherwise, on tokens of the prompt or the
output), then x -= frequency * count, then x -= presence on generated tokens; the ban
(those logits are set to -inf, in fact the lowest float32, so neither greedy nor a draw
can pick them; if a row bans every token of the vocabulary its ban is ignored and it
samples the unbanned distribution, rather than failing the whole batch); the grammar mask
(tokens it does not allow are banned the same way; when ban and mask together leave nothing,
the mask alone applies: the grammar wins over min_tokens; a mask allowing nothing is
ignored); temperature;
min_p (drop tokens whose probability is below min_p times the top one's); top_k (keep the
k most likely); top_p (keep the smallest set of most likely tokens whose mass reaches
top_p of what is left); then one draw from what remains, renormalized. Ties at a top_k
boundary are broken arbitrarily but deterministically. Tokens whose probability is below
e^-87 of the top one (float32 underflow) are never drawn.

Randomness: u = uniform(seed, counter), a splitmix64 hash of the pair, so a
row's token depends only on (seed, counter, logits, parameters), never on the
row's position in the batch or on the other rows.

No full sort of the vocabulary: top-k is a quickselect, top-p a
mass-weighted quickselect, both O(V) expected and both run on the survivors
of an exact O(V) prefilter (top-k: the smallest of k chunk maxima bounds the
k-th largest value from below; top-p: tokens lighter than (1 - top_p) of the
mass spread over all candidates are never needed). exp is `exp_nonpos`, a
polynomial that vectorizes. Scratch: four [V] arrays per row, allocated in
the kernel.
"""

import numpy as np
from numba import njit, prange

from device.kernels.fastexp import exp_nonpos

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LOG_UNDERFLOW = np.float32(-87.0)  # exp_nonpos gives 0 below this
# A banned logit. The lowest finite float32 rather than -inf, because the top-k prefilter
# takes chunk maxima with fastmath (which assumes no infinities); it acts as -inf: never
# the argmax of a row with an unbanned token, and below the underflow cut after the
# subtraction of the row's maximum, so never drawn.
_BANNED = np.float32(-3.4028234663852886e38)


@njit(nogil=True, cache=True)
def splitmix64(x):
    """The splitmix64 finalizer of x + golden gamma; x, result uint64."""
    z = x + _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True)
def uniform(seed, counter):
    """A float64 in [0, 1) from (seed uint64, counter int64), 53 random bits."""
    h = splitmix64(np.uint64(seed) ^ splitmix64(np.uint64(counter)))
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(nogil=True, cache=True, fastmath=True)
def _sum(x):
    """Sum of float32[n] in float64 (vectorized)."""
    s = 0.0
    for i in range(x.shape[0]):
        s += x[i]
    return s


@njit(nogil=True, cache=True, fastmath=True)
def _log_sum_exp(row, w, bits):
    """log(sum(exp(row))) of float32[V]; w float32[V], bits int32[V] scratch."""
    mx = _max(row)
    for i in range(row.shape[0]):
        w[i] = row[i] - mx
    exp_nonpos(w, bits)
    return mx + np.float32(np.log(_sum(w)))


@njit(nogil=True, cache=True, fastmath=True)
def _max(x):
    """Largest value of a non-empty float32[n] (vectorized)."""
    m = x[0]
    for i in range(1, x.shape[0]):
        m = max(m, x[i])
    return m


@njit(nogil=True, cache=True)
def _partition3(vals, idx, lo, hi, pivot):
    """Rearrange vals[lo:hi] (and idx alongside) into [> pivot][== pivot][< pivot].

    Returns (a, b): the == block is [a, b)."""
    lt = lo
    i = lo
    gt = hi
    while i < gt:
        v = vals[i]
        if v > pivot:
            vals[i], vals[lt] = vals[lt], v
            idx[i], idx[lt] = idx[lt], idx[i]
            lt += 1
            i += 1
        elif v < pivot:
            gt -= 1
            vals[i], vals[gt] = vals[gt], v
            idx[i], idx[gt] = idx[gt], idx[i]
        else:
            i += 1
    return lt, gt


@njit(nogil=True, cache=True)
def _median3(vals, lo, hi):
    a = vals[lo]
    b = vals[(lo + hi) // 2]
    c = vals[hi - 1]
    return max(min(a, b), min(max(a, b), c))


@njit(nogil=True, cache=True)
def _select_largest(vals, idx, n, k):
    """Rearrange vals[:n] (idx alongside) so that vals[:k] are the k largest; 0 < k <= n."""
    lo = 0
    hi = n
    while True:  # invariant: lo < k <= hi, [:lo] >= [lo:hi] >= [hi:n]
        a, b = _partition3(vals, idx, lo, hi, _median3(vals, lo, hi))
        if k <= a:
            hi = a
        elif k <= b:
            return
        else:
            lo = b


@njit(nogil=True, cache=True)
def _top_p_count(w, idx, n, target):
    """Rearrange w[:n] (idx alongside) so its c largest come first, where c is the
    smallest count whose mass reaches target (> 0); returns c."""
    lo = 0
    hi = n
    acc = 0.0  # mass of w[:lo], always < target; the answer is in (lo, hi]
    while hi - lo > 1:
        pivot = _median3(w, lo, hi)
        a, b = _partition3(w, idx, lo, hi, pivot)
        s_gt = 0.0
        for j in range(lo, a):
            s_gt += w[j]
        if acc + s_gt >= target:
            hi = a
            continue
        s_eq = (b - a) * np.float64(pivot)
        if acc + s_gt + s_eq >= target:
            need = int(np.ceil((target - acc - s_gt) / pivot))
            return a + min(max(need, 1), b - a)
        acc += s_gt + s_eq
        lo = b
    return hi


@njit(nogil=True, cache=True)
def _top_raw(out_ids, out_lp, row, lse):
    """The K largest of row (ties: lower id first), most likely first, as logprobs."""
    k = out_ids.shape[0]
    if k == 0:
        return
    n = 0
    for i in range(row.shape[0]):
        x = row[i]
        if n == k and x <= row[out_ids[k - 1]]:
            continue
        j = n if n < k else k - 1  # insertion point search from the end
        while j > 0 and row[out_ids[j - 1]] < x:
            if j < k:
                out_ids[j] = out_ids[j - 1]
            j -= 1
        out_ids[j] = i
        if n < k:
            n += 1
    for j in range(k):
        if j < n:
            out_lp[j] = row[out_ids[j]] - lse
        else:  # K > V
            out_ids[j] = -1
            out_lp[j] = -np.inf


@njit(nogil=True, cache=True)
def _penalized(x, count, in_prompt, presence, frequency, repetition, inv_repetition):
    """One logit with vLLM's penalties: count times generated, in_prompt whether the prompt
    holds it. The same float32 operations, in the same order, as vLLM's apply_penalties."""
    if count > 0 or in_prompt:
        x = x * inv_repetition if x > 0 else x * repetition
    if count > 0:
        x = x - frequency * np.float32(count)
        x = x - presence
    return x


@njit(nogil=True, cache=True)
def _penalize(z, row, presence, frequency, repetition, pen_ids, pen_counts):
    """z[:] = row with the penalties applied to the listed tokens (count 0: prompt only)."""
    z[:] = row
    inv = np.float32(1.0) / repetition
    for j in range(pen_ids.shape[0]):
        t = pen_ids[j]
        z[t] = _penalized(z[t], pen_counts[j], True, presence, frequency, repetition, inv)


@njit(nogil=True, cache=True)
def _penalize_table(z, row, presence, frequency, repetition, counts, prompt):
    """z[:] = row with the penalties of a sequence's tables (counts, prompt: int32[V])."""
    inv = np.float32(1.0) / repetition
    for t in range(row.shape[0]):
        z[t] = _penalized(row[t], counts[t], prompt[t] != 0, presence, frequency, repetition, inv)


@njit(nogil=True, cache=True)
def _ban(z, ban, marks):
    """Set the banned logits of z to _BANNED, unless the ban covers every token (then the
    row samples without it). marks: int32[V] scratch, used only when the ban may cover all."""
    v_n = z.shape[0]
    if ban.shape[0] >= v_n:
        marks[:] = 0
        distinct = 0
        for j in range(ban.shape[0]):
            if marks[ban[j]] == 0:
                marks[ban[j]] = 1
                distinct += 1
        if distinct == v_n:
            return
    for j in range(ban.shape[0]):
        z[ban[j]] = _BANNED


@njit(nogil=True, cache=True)
def _allowed(words, t):
    """Whether the bitmask words (int32[ceil(V/32)]) allow token t."""
    return (words[t >> 5] >> (t & 31)) & 1 != 0


@njit(nogil=True, cache=True)
def apply_token_mask(z, words):
    """Set z[t] (float32[V]) to the banned value for every token t whose bit in words
    (int32[ceil(V/32)], bit t % 32 of word t // 32) is clear; returns how many are allowed.
    A mask that allows nothing changes nothing (and returns 0)."""
    v_n = z.shape[0]
    if words.shape[0] * 32 < v_n:
        raise ValueError("apply_token_mask: want ceil(V/32) words (words, V)", words.shape[0], v_n)
    n = 0
    for t in range(v_n):
        if _allowed(words, t):
            n += 1
    if n == 0:
        return 0
    for t in range(v_n):
        if not _allowed(words, t):
            z[t] = _BANNED
    return n


@njit(nogil=True, cache=True)
def add_logit_bias(z, ids, values):
    """z[ids[j]] += values[j] (OpenAI's logit_bias), in float32."""
    for j in range(ids.shape[0]):
        z[ids[j]] = z[ids[j]] + values[j]


@njit(nogil=True, cache=True)
def _ban_and_mask(z, ban, words, marks):
    """The ban, then the mask (words: empty for none). When together they leave no token,
    only the mask applies (a grammar that allows only what min_tokens bans must still hold)."""
    if words.shape[0] == 0:
        _ban(z, ban, marks)
        return
    if ban.shape[0] > 0:
        marks[:] = 0
        for j in range(ban.shape[0]):
            marks[ban[j]] = 1
        left = 0
        for t in range(z.shape[0]):
            if marks[t] == 0 and _allowed(words, t):
                left += 1
                break
        if left > 0:
            _ban(z, ban, marks)
    apply_token_mask(z, words)


@njit(nogil=True, cache=True)
def _argmax(z):
    """(index, value) of the first largest element of float32[n]."""
    zmax = z[0]
    arg = 0
    for i in range(1, z.shape[0]):
        if z[i] > zmax:
            zmax = z[i]
            arg = i
    return arg, zmax


@njit(nogil=True, cache=True)
def _sample_row(z, temperature, top_k, top_p, min_p, seed, counter, w, idx, bits):
    """One row: returns the sampled token id. z float32[V]: the logits, penalized and
    banned; w float32[V], idx, bits int32[V] scratch."""
    v_n = z.shape[0]
    arg, zmax = _argmax(z)
    if temperature <= 0.0 or top_k == 1:
        return arg
    inv_t = np.float32(1.0) / temperature
    cut = _LOG_UNDERFLOW
    if min_p > 0.0:
        cut = max(cut, np.float32(np.log(min_p)))
    n = 0
    if 0 < top_k < v_n:
        # Prefilter: split into top_k chunks; the smallest chunk maximum is a lower
        # bound of the top_k-th largest value, so everything below it is out.
        width = v_n // top_k
        bound = zmax
        for c in range(top_k):
            bound = min(bound, _max(z[c * width:(c + 1) * width]))
        m = 0
        for i in range(v_n):
            if z[i] >= bound:
                w[m] = z[i]
                idx[m] = i
                m += 1
        _select_largest(w, idx, m, top_k)
        for j in range(top_k):
            e = (w[j] - zmax) * inv_t
            if e >= cut:
                w[n] = e
                idx[n] = idx[j]
                n += 1
    else:
        for i in range(v_n):
            e = (z[i] - zmax) * inv_t
            if e >= cut:
                w[n] = e
                idx[n] = i
                n += 1
    exp_nonpos(w[:n], bits[:n])
    if top_p < 1.0:
        total = 0.0
        for j in range(n):
            total += w[j]
        # Prefilter: tokens at or below a weight x hold at most n * x of the mass, so
        # below (1 - top_p) * total / n none of them is needed to reach top_p.
        bound = np.float32(0.999 * (1.0 - top_p) * total / n)
        m = 0
        for j in range(n):
            if w[j] >= bound:
                w[m] = w[j]
                idx[m] = idx[j]
                m += 1
        n = _top_p_count(w, idx, m, top_p * total)
    total = 0.0
    for j in range(n):
        total += w[j]
    u = uniform(seed, counter) * total
    acc = 0.0
    for j in range(n):
        acc += w[j]
        if acc > u:
            return idx[j]
    return arg  # not reached: acc ends at total > u


@njit(nogil=True, cache=True)
def _check(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
           top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
           repetition_penalty, penalty_offsets, penalty_ids, penalty_counts, ban_offsets, ban_ids):
    s_n, v_n = logits.shape
    for n in (out_ids.shape[0], out_logprobs.shape[0], out_top_ids.shape[0],
              out_top_logprobs.shape[0], temperature.shape[0], top_k.shape[0], top_p.shape[0],
              min_p.shape[0], seeds.shape[0], counters.shape[0], presence_penalty.shape[0],
              frequency_penalty.shape[0], repetition_penalty.shape[0]):
        if n != s_n:
            raise ValueError("sample: a per-row array's length differs from the rows of logits", n, s_n)
    if out_top_ids.shape[1] != out_top_logprobs.shape[1]:
        raise ValueError("sample: out_top_ids and out_top_logprobs differ in width",
                         out_top_ids.shape[1], out_top_logprobs.shape[1])
    if penalty_offsets.shape[0] != s_n + 1 or penalty_offsets[0] != 0 \
            or penalty_offsets[s_n] > penalty_ids.shape[0] or penalty_counts.shape[0] != penalty_ids.shape[0]:
        raise ValueError("sample: want penalty_offsets [S+1] from 0 to at most N = len(penalty_ids) = len(penalty_counts)",
                         s_n, penalty_ids.shape[0])
    for s in range(s_n):
        if penalty_offsets[s + 1] < penalty_offsets[s]:
            raise ValueError("sample: penalty_offsets decrease at row", s)
        if not (top_p[s] > 0.0 and top_p[s] <= 1.0):
            raise ValueError("sample: top_p must be in (0, 1] (row, value)", s, top_p[s])
        if not (min_p[s] >= 0.0 and min_p[s] <= 1.0):
            raise ValueError("sample: min_p must be in [0, 1] (row, value)", s, min_p[s])
        if top_k[s] < 0:
            raise ValueError("sample: top_k must be >= 0 (row, value)", s, top_k[s])
        if not repetition_penalty[s] > 0.0:
            raise ValueError("sample: repetition_penalty must be > 0 (row, value)", s, repetition_penalty[s])
    for j in range(penalty_offsets[s_n]):
        if penalty_ids[j] < 0 or penalty_ids[j] >= v_n:
            raise IndexError("sample: penalty token id out of range (id, vocab)", penalty_ids[j], v_n)
    if ban_offsets.shape[0] != s_n + 1 or ban_offsets[0] != 0 or ban_offsets[s_n] > ban_ids.shape[0]:
        raise ValueError("sample: want ban_offsets [S+1] from 0 to at most len(ban_ids) (S, len)",
                         s_n, ban_ids.shape[0])
    for s in range(s_n):
        if ban_offsets[s + 1] < ban_offsets[s]:
            raise ValueError("sample: ban_offsets decrease at row", s)
    for j in range(ban_offsets[s_n]):
        if ban_ids[j] < 0 or ban_ids[j] >= v_n:
            raise IndexError("sample: banned token id out of range (id, vocab)", ban_ids[j], v_n)


@njit(nogil=True, cache=True)
def sample(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
           top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
           repetition_penalty, penalty_offsets, penalty_ids, penalty_counts,
           ban_offsets=None, ban_ids=None):
    """Sample one token per row of logits; see the module docstring."""
    if ban_offsets is None:
        _sample(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
                top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
                repetition_penalty, penalty_offsets, penalty_ids, penalty_counts,
                np.zeros(logits.shape[0] + 1, np.int32), np.zeros(0, np.int32))
    else:
        _sample(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
                top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
                repetition_penalty, penalty_offsets, penalty_ids, penalty_counts,
                ban_offsets, ban_ids)


@njit(nogil=True, cache=True, parallel=True)
def _sample(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
            top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
            repetition_penalty, penalty_offsets, penalty_ids, penalty_counts, ban_offsets, ban_ids):
    _check(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
           top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
           repetition_penalty, penalty_offsets, penalty_ids, penalty_counts, ban_offsets, ban_ids)
    s_n, v_n = logits.shape
    for s in prange(s_n):
        z = np.empty(v_n, np.float32)
        p0 = penalty_offsets[s]
        p1 = penalty_offsets[s + 1]
        _penalize(z, logits[s], presence_penalty[s], frequency_penalty[s], repetition_penalty[s],
                  penalty_ids[p0:p1], penalty_counts[p0:p1])
        _finish_row(s, out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits[s], z,
                    temperature[s], top_k[s], top_p[s], min_p[s], seeds[s], counters[s],
                    ban_ids[ban_offsets[s]:ban_offsets[s + 1]], ban_ids[:0])


@njit(nogil=True, cache=True)
def _finish_row(s, out_ids, out_logprobs, out_top_ids, out_top_logprobs, row, z, temperature,
                top_k, top_p, min_p, seed, counter, ban, words):
    """Row s from its penalized logits z: the ban and the grammar mask (words, empty: none),
    the draw, the raw logprob and top-K."""
    v_n = row.shape[0]
    w = np.empty(v_n, np.float32)
    idx = np.empty(v_n, np.int32)
    bits = np.empty(v_n, np.int32)
    lse = _log_sum_exp(row, w, bits)
    _top_raw(out_top_ids[s], out_top_logprobs[s], row, lse)
    _ban_and_mask(z, ban, words, bits)
    tok = _sample_row(z, temperature, top_k, top_p, min_p, seed, counter, w, idx, bits)
    out_ids[s] = tok
    out_logprobs[s] = row[tok] - lse


@njit(nogil=True, cache=True)
def _check_state(logits, pen_slot, output_counts, prompt_mask, mask_row, mask_words,
                 bias_offsets, bias_ids, bias_values):
    s_n, v_n = logits.shape
    if pen_slot.shape[0] != s_n or mask_row.shape[0] != s_n:
        raise ValueError("sample_with_state: pen_slot's or mask_row's length differs from the "
                         "rows of logits", pen_slot.shape[0], mask_row.shape[0], s_n)
    if output_counts.shape != prompt_mask.shape or output_counts.shape[1] != v_n:
        raise ValueError("sample_with_state: want output_counts and prompt_mask [P, V] (P, V, V of logits)",
                         output_counts.shape[0], output_counts.shape[1], v_n)
    for s in range(s_n):
        if pen_slot[s] < -1 or pen_slot[s] >= output_counts.shape[0]:
            raise IndexError("sample_with_state: pen_slot out of range (row, slot, slots)",
                             s, pen_slot[s], output_counts.shape[0])
        if mask_row[s] < -1 or mask_row[s] >= mask_words.shape[0]:
            raise IndexError("sample_with_state: mask_row out of range (row, mask row, masks)",
                             s, mask_row[s], mask_words.shape[0])
    if mask_words.shape[0] > 0 and mask_words.shape[1] != (v_n + 31) // 32:
        raise ValueError("sample_with_state: want mask_words [M, ceil(V/32)] (width, V)",
                         mask_words.shape[1], v_n)
    if bias_offsets.shape[0] != s_n + 1 or bias_offsets[0] != 0 \
            or bias_offsets[s_n] > bias_ids.shape[0] or bias_values.shape[0] != bias_ids.shape[0]:
        raise ValueError("sample_with_state: want bias_offsets [S+1] from 0 to at most "
                         "len(bias_ids) = len(bias_values) (S, len)", s_n, bias_ids.shape[0])
    for s in range(s_n):
        if bias_offsets[s + 1] < bias_offsets[s]:
            raise ValueError("sample_with_state: bias_offsets decrease at row", s)
    for j in range(bias_offsets[s_n]):
        if bias_ids[j] < 0 or bias_ids[j] >= v_n:
            raise IndexError("sample_with_state: logit bias token id out of range (id, vocab)",
                             bias_ids[j], v_n)
        if not np.isfinite(bias_values[j]):
            raise ValueError("sample_with_state: a logit bias is not finite (entry)", j)


@njit(nogil=True, cache=True)
def sample_with_state(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature,
                      top_k, top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
                      repetition_penalty, pen_slot, output_counts, prompt_mask, ban_offsets,
                      ban_ids, mask_row, mask_words, bias_offsets, bias_ids, bias_values):
    """`sample`, the penalties read from each row's slot of the tables `count_tokens` keeps
    (pen_slot -1: none), with each row's logit bias and grammar mask (mask_row -1: none);
    see the module docstring."""
    s_n = logits.shape[0]
    no_lists = np.zeros(s_n + 1, np.int32)
    _check(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature, top_k,
           top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
           repetition_penalty, no_lists, no_lists[:0], no_lists[:0], ban_offsets, ban_ids)
    _check_state(logits, pen_slot, output_counts, prompt_mask, mask_row, mask_words,
                 bias_offsets, bias_ids, bias_values)
    _sample_state(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature,
                  top_k, top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
                  repetition_penalty, pen_slot, output_counts, prompt_mask, ban_offsets, ban_ids,
                  mask_row, mask_words, bias_offsets, bias_ids, bias_values)


@njit(nogil=True, cache=True, parallel=True)
def _sample_state(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, temperature,
                  top_k, top_p, min_p, seeds, counters, presence_penalty, frequency_penalty,
                  repetition_penalty, pen_slot, output_counts, prompt_mask, ban_offsets, ban_ids,
                  mask_row, mask_words, bias_offsets, bias_ids, bias_values):
    s_n, v_n = logits.shape
    no_words = np.zeros(0, np.int32)
    for s in prange(s_n):
        z = np.empty(v_n, np.float32)
        z[:] = logits[s]
        b0 = bias_offsets[s]
        b1 = bias_offsets[s + 1]
        add_logit_bias(z, bias_ids[b0:b1], bias_values[b0:b1])    # before the penalties (vLLM)
        slot = pen_slot[s]
        if slot >= 0:
            _penalize_table(z, z, presence_penalty[s], frequency_penalty[s],
                            repetition_penalty[s], output_counts[slot], prompt_mask[slot])
        words = mask_words[mask_row[s]] if mask_row[s] >= 0 else no_words
        _finish_row(s, out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits[s], z,
                    temperature[s], top_k[s], top_p[s], min_p[s], seeds[s], counters[s],
                    ban_ids[ban_offsets[s]:ban_offsets[s + 1]], words)


@njit(nogil=True, cache=True)
def count_tokens(output_counts, prompt_mask, count_slot, prompt_lens, query_start, positions,
                 tokens):
    """Count each sequence's token rows of a step into its slot; see the module docstring.

    output_counts, prompt_mask int32[P, V]; count_slot, prompt_lens int32[S] (slot -1: the
    sequence has no penalties); query_start int32[S+1]; positions, tokens int32[T]."""
    p_n, v_n = output_counts.shape
    if prompt_mask.shape[0] != p_n or prompt_mask.shape[1] != v_n:
        raise ValueError("count_tokens: output_counts and prompt_mask differ in shape")
    if query_start.shape[0] != count_slot.shape[0] + 1 or prompt_lens.shape[0] != count_slot.shape[0]:
        raise ValueError("count_tokens: want count_slot, prompt_lens [S] and query_start [S+1] (S, S+1)",
                         count_slot.shape[0], query_start.shape[0])
    for s in range(count_slot.shape[0]):
        slot = count_slot[s]
        if slot < 0:
            continue
        r0 = query_start[s]
        r1 = query_start[s + 1]
        if slot >= p_n or r0 < 0 or r1 > tokens.shape[0] or r1 > positions.shape[0]:
            raise IndexError("count_tokens: slot or rows out of range (seq, slot, slots, first, end)",
                             s, slot, p_n, r0, r1)
        if r1 <= r0:
            continue
        counts = output_counts[slot]
        prompt = prompt_mask[slot]
        if positions[r0] == 0:
            counts[:] = 0
            prompt[:] = 0
        for r in range(r0, r1):
            t = tokens[r]
            if t < 0 or t >= v_n:
                raise IndexError("count_tokens: token id out of range (row, id, vocab)", r, t, v_n)
            if positions[r] < prompt_lens[s]:
                prompt[t] = 1
            else:
                counts[t] += 1
