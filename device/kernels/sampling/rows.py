"""The sampler: one token per row of logits, each row's parameters one record.

    sample_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                output_counts, prompt_mask, ban_offsets, ban_ids, mask_words,
                bias_offsets, bias_ids, bias_values)

`rows` is a record array [S], one record per row, declared with the step's inputs
(models/step/program.py SAMPLE_ROW); the sampler reads these fields of rows[s]:
    temperature  float32  0 -> greedy (argmax of the penalized logits)
    top_k        int32    0 -> off; 1 -> greedy
    top_p        float32  in (0, 1]; 1 -> off
    min_p        float32  in [0, 1]; 0 -> off (drop tokens below min_p times the top one)
    top_n_sigma  float32  <= 0 -> off (drop logits below max - n * std: llama.cpp's)
    seed         int64    per-request seed;  counter int64: tokens generated so far
    presence, frequency, repetition  float32  penalties (penalties.py); repetition 1 -> off
    pen_slot     int32    the row's slot of output_counts / prompt_mask, -1: no penalties
    mask_row     int32    the row of mask_words holding its grammar mask, -1: none
A record type with other fields as well is fine: the sampler reads these by name.

Outputs (first): out_ids int32[S], the sampled token; out_logprobs float32[S], its logprob
under the raw distribution (log_softmax of the unpenalized, untempered logits); out_top_ids
int32[S, K] and out_top_logprobs float32[S, K], the K most likely raw tokens (K may be 0).
Inputs beside: logits float32[S, V] (not modified); output_counts, prompt_mask int32[P, V]
(penalties.py); ban_offsets int32[S+1], ban_ids int32[M] (row s may not sample
ban_ids[o[s]:o[s+1]]); mask_words int32[NM, ceil(V/32)] (masks.py); bias_offsets int32[S+1],
bias_ids int32[B], bias_values float32[B] (logit_bias, unique ids per row).

Order per row, vLLM v1's: the logit bias, the penalties, the ban, the grammar mask,
(top-n-sigma, llama.cpp's, after its penalties), temperature, min_p, top_k, top_p, one draw
(select.py) with u = uniform(seed, counter).
Scratch: four [V] arrays per row, allocated in the kernel.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.sampling.masks import add_logit_bias, ban_and_mask, top_n_sigma
from spyre_serve.device.kernels.sampling.penalties import penalize_row
from spyre_serve.device.kernels.sampling.select import draw, log_sum_exp, top_raw


@njit(nogil=True, cache=True)
def _check_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                output_counts, prompt_mask, mask_words):
    s_n, v_n = logits.shape
    for n in (out_ids.shape[0], out_logprobs.shape[0], out_top_ids.shape[0],
              out_top_logprobs.shape[0], rows.shape[0]):
        if n != s_n:
            raise ValueError("sample_rows: a per-row array's length differs from the rows of "
                             "logits", n, s_n)
    if out_top_ids.shape[1] != out_top_logprobs.shape[1]:
        raise ValueError("sample_rows: out_top_ids and out_top_logprobs differ in width",
                         out_top_ids.shape[1], out_top_logprobs.shape[1])
    if output_counts.shape != prompt_mask.shape or output_counts.shape[1] != v_n:
        raise ValueError("sample_rows: want output_counts and prompt_mask [P, V] (P, V, V of "
                         "logits)", output_counts.shape[0], output_counts.shape[1], v_n)
    if mask_words.shape[0] > 0 and mask_words.shape[1] != (v_n + 31) // 32:
        raise ValueError("sample_rows: want mask_words [M, ceil(V/32)] (width, V)",
                         mask_words.shape[1], v_n)
    for s in range(s_n):
        r = rows[s]
        if not (r.top_p > 0.0 and r.top_p <= 1.0):
            raise ValueError("sample_rows: top_p must be in (0, 1] (row, value)", s, r.top_p)
        if not (r.min_p >= 0.0 and r.min_p <= 1.0):
            raise ValueError("sample_rows: min_p must be in [0, 1] (row, value)", s, r.min_p)
        if not np.isfinite(r.top_n_sigma):
            raise ValueError("sample_rows: top_n_sigma must be finite (row, value)", s,
                             r.top_n_sigma)
        if r.top_k < 0:
            raise ValueError("sample_rows: top_k must be >= 0 (row, value)", s, r.top_k)
        if not r.repetition > 0.0:
            raise ValueError("sample_rows: repetition must be > 0 (row, value)", s, r.repetition)
        if r.pen_slot < -1 or r.pen_slot >= output_counts.shape[0]:
            raise IndexError("sample_rows: pen_slot out of range (row, slot, slots)",
                             s, r.pen_slot, output_counts.shape[0])
        if r.mask_row < -1 or r.mask_row >= mask_words.shape[0]:
            raise IndexError("sample_rows: mask_row out of range (row, mask row, masks)",
                             s, r.mask_row, mask_words.shape[0])


@njit(nogil=True, cache=True)
def _check_lists(what, offsets, ids, s_n, v_n):
    """offsets [S+1] from 0, not decreasing, to at most len(ids); every id in the vocabulary."""
    if offsets.shape[0] != s_n + 1 or offsets[0] != 0 or offsets[s_n] > ids.shape[0]:
        raise ValueError("sample_rows: want offsets [S+1] from 0 to at most the ids' length "
                         "(0: bans, 1: logit biases; S, length)", what, s_n, ids.shape[0])
    for s in range(s_n):
        if offsets[s + 1] < offsets[s]:
            raise ValueError("sample_rows: offsets decrease (0: bans, 1: logit biases; row)",
                             what, s)
    for j in range(offsets[s_n]):
        if ids[j] < 0 or ids[j] >= v_n:
            raise IndexError("sample_rows: token id out of range (0: banned, 1: logit bias; id, "
                             "vocab)", what, ids[j], v_n)


@njit(nogil=True, cache=True)
def sample_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                output_counts, prompt_mask, ban_offsets, ban_ids, mask_words, bias_offsets,
                bias_ids, bias_values):
    """Sample one token per row of logits; see the module docstring."""
    s_n, v_n = logits.shape
    _check_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                output_counts, prompt_mask, mask_words)
    _check_lists(0, ban_offsets, ban_ids, s_n, v_n)
    _check_lists(1, bias_offsets, bias_ids, s_n, v_n)
    if bias_values.shape[0] != bias_ids.shape[0]:
        raise ValueError("sample_rows: bias_values and bias_ids differ in length",
                         bias_values.shape[0], bias_ids.shape[0])
    for j in range(bias_offsets[s_n]):
        if not np.isfinite(bias_values[j]):
            raise ValueError("sample_rows: a logit bias is not finite (entry)", j)
    _sample_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                 output_counts, prompt_mask, ban_offsets, ban_ids, mask_words, bias_offsets,
                 bias_ids, bias_values)


@njit(nogil=True, cache=True, parallel=True)
def _sample_rows(out_ids, out_logprobs, out_top_ids, out_top_logprobs, logits, rows,
                 output_counts, prompt_mask, ban_offsets, ban_ids, mask_words, bias_offsets,
                 bias_ids, bias_values):
    s_n, v_n = logits.shape
    no_words = np.zeros(0, np.int32)
    for s in prange(s_n):
        r = rows[s]
        row = logits[s]
        z = np.empty(v_n, np.float32)
        z[:] = row
        b0 = bias_offsets[s]
        b1 = bias_offsets[s + 1]
        add_logit_bias(z, bias_ids[b0:b1], bias_values[b0:b1])    # before the penalties (vLLM)
        if r.pen_slot >= 0:
            penalize_row(z, z, r.presence, r.frequency, r.repetition,
                         output_counts[r.pen_slot], prompt_mask[r.pen_slot])
        words = mask_words[r.mask_row] if r.mask_row >= 0 else no_words
        w = np.empty(v_n, np.float32)
        idx = np.empty(v_n, np.int32)
        bits = np.empty(v_n, np.int32)
        lse = log_sum_exp(row, w)
        top_raw(out_top_ids[s], out_top_logprobs[s], row, lse)
        ban_and_mask(z, ban_ids[ban_offsets[s]:ban_offsets[s + 1]], words, bits)
        top_n_sigma(z, r.top_n_sigma)
        tok = draw(z, r.temperature, r.top_k, r.top_p, r.min_p, r.seed, r.counter, w, idx)
        out_ids[s] = tok
        out_logprobs[s] = row[tok] - lse
