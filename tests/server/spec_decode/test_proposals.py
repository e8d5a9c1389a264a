"""server/spec_decode/proposals.py without a model: the ngram lookup, the config's rules, and when a
sequence is proposed for (vLLM's keys and defaults)."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.sequence import GenerationParams, Sequence
from spyre_serve.server.spec_decode.proposals import (
    SpeculativeConfig,
    SpeculativeConfigError,
    Speculator,
    ngram_proposal,
)


def test_the_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    t = np.array([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 1 and 6; the latest (6) was followed by 4, 5, 8
    assert ngram_proposal(t, 3, 1, 3) == [4, 5, 8]
    assert ngram_proposal(t, 2, 1, 3) == [4, 5]
    # only [2, 3] or longer counts, and a longer suffix wins over a later shorter one
    t2 = np.array([5, 6, 7, 1, 6, 7, 2, 5, 6, 7])
    assert ngram_proposal(t2, 2, 3, 3) == [1, 6]          # [5, 6, 7] at 0
    assert ngram_proposal(t2, 2, 2, 2) == [2, 5]          # [6, 7] latest at 4
    assert ngram_proposal(np.array([1, 2, 3, 4]), 3, 1, 3) == []      # nothing repeats
    assert ngram_proposal(np.array([4, 4]), 3, 1, 3) == [4]           # up to the end only


def test_the_config_takes_vllms_keys_and_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)          # vLLM: 5 and 5 when neither
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    c = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "/some/draft"
    for bad in ({"num_speculative_tokens": 0}, {"num_speculative_tokens": True},
                {"method": "ngram", "model": "x", "num_speculative_tokens": 2},
                {"num_speculative_tokens": 2, "disable_by_batch_size": -1}):
        with pytest.raises(SpeculativeConfigError):
            SpeculativeConfig.parse(bad)


def _seq(tokens, **params) -> Sequence:
    params = {"max_tokens": 50, **params}
    return Sequence(1, "r", 0, list(tokens), GenerationParams(SamplingParams(temperature=0.0), **params), 0.0)


def test_who_is_proposed_for():
    spec = Speculator(SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                               "disable_by_batch_size": 2}), max_model_len=64)
    seq = _seq([1, 2, 3, 1, 2])
    assert spec.proposes_for(seq, 2) and not spec.proposes_for(seq, 3)     # over the batch size: none
    assert spec.propose(seq, 10) == [3, 1, 2]
    assert spec.propose(seq, 1) == [3]
    for params in ({"min_tokens": 1}, {"max_tokens": 1}):      # bans still on; one token left
        assert not spec.proposes_for(_seq([1, 2, 3, 1, 2], **params), 1)
    biased = Sequence(2, "r", 0, [1, 2, 1], GenerationParams(SamplingParams(logit_bias={3: 1.0})), 0.0)
    penalized = Sequence(3, "r", 0, [1, 2, 1], GenerationParams(SamplingParams(repetition_penalty=1.1)), 0.0)
    assert not spec.proposes_for(biased, 1) and not spec.proposes_for(penalized, 1)
    near_end = Speculator(spec.config, max_model_len=7)
    assert near_end.propose(seq, 10) == [3, 1]                              # positions 5, 6 only


def test_after_a_lookup_that_finds_nothing_the_next_decode_keeps_the_overlap():
    spec = Speculator(SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_min": 1}), 64)
    seq = _seq([1, 2, 3, 4])
    assert spec.propose(seq, 3) == []
    seq.num_pending = 1                      # its decode launched: the next one may read it on the card
    assert not spec.proposes_for(seq, 1)
    seq.num_pending = 2                      # and the one after that looks again
    assert spec.proposes_for(seq, 1)
    spec.forget(seq.seq_id)
    seq.num_pending = 1
    assert spec.proposes_for(seq, 1)
