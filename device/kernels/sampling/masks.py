"""Tokens a row may not sample: bans (min_tokens), grammar masks (llguidance's bitmask),
llama.cpp's top-n-sigma cut, and OpenAI's logit_bias.

A banned logit becomes BANNED, the lowest finite float32 rather than -inf, because the top-k
prefilter takes chunk maxima with fastmath (which assumes no infinities); it acts as -inf:
never the argmax of a row with an unbanned token, and below the underflow cut after the
subtraction of the row's maximum, so never drawn. A ban covering the whole vocabulary is
ignored (the row samples without it, rather than failing the batch); when a ban and a mask
together leave nothing, the mask alone applies (the grammar wins over min_tokens); a mask
allowing nothing is ignored.
"""

import numpy as np
from numba import njit

BANNED = np.float32(-3.4028234663852886e38)


@njit(nogil=True, cache=True)
def ban_tokens(z, ban, marks):
    """Set the banned logits of z to BANNED, unless the ban covers every token (then the
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
        z[ban[j]] = BANNED


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
            z[t] = BANNED
    return n


@njit(nogil=True, cache=True)
def add_logit_bias(z, ids, values):
    """z[ids[j]] += values[j] (OpenAI's logit_bias), in float32."""
    for j in range(ids.shape[0]):
        z[ids[j]] = z[ids[j]] + values[j]


@njit(nogil=True, cache=True)
def ban_and_mask(z, ban, words, marks):
    """The ban, then the mask (words: empty for none). When together they leave no token,
    only the mask applies (a grammar that allows only what min_tokens bans must still hold)."""
    if words.shape[0] == 0:
        ban_tokens(z, ban, marks)
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
            ban_tokens(z, ban, marks)
    apply_token_mask(z, words)


@njit(nogil=True, cache=True)
def top_n_sigma(z, n):
    """llama.cpp's top-n-sigma (Tang et al., 2024, "Top-nσ: Not All Logits Are You Need"): ban
    every logit of z (float32[V]) below max - n * std, the max, mean and population std taken
    over the logits not banned already (in float64). n <= 0: off. The largest logit always
    stays, so greedy is unchanged; the cut scales with the logits, so it commutes with
    temperature."""
    if not n > 0.0:
        return
    top = -np.inf
    total = 0.0
    count = 0
    for t in range(z.shape[0]):
        if z[t] > BANNED:
            top = max(top, np.float64(z[t]))
            total += z[t]
            count += 1
    if count < 2:
        return
    mean = total / count
    acc = 0.0
    for t in range(z.shape[0]):
        if z[t] > BANNED:
            acc += (z[t] - mean) ** 2
    cut = top - n * np.sqrt(acc / count)
    for t in range(z.shape[0]):
        if z[t] < cut:
            z[t] = BANNED
