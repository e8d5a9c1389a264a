"""models/step/prompt_logprobs.py: each prompt token's logprob, top-K and rank, chunk by chunk."""

from __future__ import annotations

import numpy as np

from spyre_serve.models import SamplingParams, SeqWork
from spyre_serve.models.step.prompt_logprobs import PromptLogprobs


def test_a_tokens_rank_counts_the_tokens_more_likely_than_it_ties_sharing_it():
    rng = np.random.default_rng(0)
    lsm = rng.standard_normal((6, 50)).astype(np.float32)
    lsm[2, 7] = lsm[2, 9] = lsm[2].max() + 1  # token 9 (scored by row 2) ties for the top
    prompt = [3, 11, 40, 9, 0, 25, 17]
    scores = PromptLogprobs()
    sp = SamplingParams(logprobs=2)
    first = scores.of_chunk(SeqWork(0, prompt[:4], 0, [0], False, sp, prompt_logprobs=True), lsm, 0)
    second = scores.of_chunk(SeqWork(0, prompt[4:], 4, [0], True, sp, prompt_logprobs=True), lsm[3:], 0)
    lp, top_ids, top_lps, ranks = (np.concatenate(parts) for parts in zip(first, second, strict=True))
    rows = np.concatenate([lsm[:4], lsm[3:5]])  # the kept last row of the first chunk scores token 4
    targets = np.array(prompt[1:])
    np.testing.assert_array_equal(lp, rows[np.arange(6), targets])
    want = [1 + int((row > row[t]).sum()) for row, t in zip(rows, targets, strict=True)]
    assert ranks.tolist() == want and ranks[2] == 1
    assert top_ids.shape == top_lps.shape == (6, 2) and ranks.dtype == np.int32
    assert len(scores) == 0  # the sampling chunk keeps no row
