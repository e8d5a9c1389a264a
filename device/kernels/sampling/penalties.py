"""Penalties from per-sequence tables kept on the card, and the counting that fills them.

`count_tokens` fills the tables: for each sequence s of a step with count_slot[s] >= 0, its
token rows query_start[s]..query_start[s+1]-1 are counted into its slot, a row at a position
below prompt_lens[s] into prompt_mask, the others (generated tokens fed back, or recomputed
after a preemption) into output_counts; a chunk starting at position 0 clears the slot first.
So a step counts the tokens it computes, a from-device decode token included, and the
penalties of its samples see every token before them: the host sends a slot number per
sequence, never the token history.

The penalties are vLLM v1's (vllm/model_executor/layers/utils.py apply_penalties), in the same
float32 operations and order: the repetition scale (x * (1/r) for x > 0, x * r otherwise, on
tokens of the prompt or the output), then x -= frequency * count, then x -= presence on
generated tokens.
"""

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def penalized(x, count, in_prompt, presence, frequency, repetition, inv_repetition):
    """One logit with vLLM's penalties: count times generated, in_prompt whether the prompt
    holds it. The same float32 operations, in the same order, as vLLM's apply_penalties."""
    if count > 0 or in_prompt:
        x = x * inv_repetition if x > 0 else x * repetition
    if count > 0:
        x = x - frequency * np.float32(count)
        x = x - presence
    return x


@njit(nogil=True, cache=True)
def penalize_row(z, row, presence, frequency, repetition, counts, prompt):
    """z[:] = row with the penalties of a sequence's tables (counts, prompt: int32[V])."""
    inv = np.float32(1.0) / repetition
    for t in range(row.shape[0]):
        z[t] = penalized(row[t], counts[t], prompt[t] != 0, presence, frequency, repetition, inv)


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
