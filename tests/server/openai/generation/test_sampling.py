"""sampling.py: a request's fields as the engine's GenerationParams, one per choice."""

from __future__ import annotations

import json

import pytest

from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest, CompletionRequest
from spyre_serve.server.openai.generation.sampling import generation_defaults, generation_params

VOCAB = 100


def params(max_tokens=8, logprobs=None, prompt_logprobs=False, **body):
    return generation_params(CompletionRequest(prompt="x", **body), max_tokens, logprobs, prompt_logprobs, VOCAB)


def test_one_params_per_choice_with_consecutive_seeds():
    out = params(n=3, seed=40)
    assert [p.sampling.seed for p in out] == [40, 41, 42]


def test_an_unseeded_request_stays_unseeded():
    assert [p.sampling.seed for p in params(n=2)] == [None, None]


def test_unset_fields_are_the_engines_neutral_values():
    s = params()[0].sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.logprobs) == (1.0, 0, 1.0, 0.0, 0)


def test_top_k_minus_one_means_off():
    assert params(top_k=-1)[0].sampling.top_k == 0


def test_the_requests_values_are_kept():
    p = params(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
               repetition_penalty=1.2, stop="!", stop_token_ids=[3], ignore_eos=True, logprobs=2,
               prompt_logprobs=True, top_n_sigma=1.5)[0]
    s = p.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.top_n_sigma) == (0.5, 4, 0.9, 0.1, 1.5)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logprobs) == (0.5, -0.5, 1.2, 2)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs, p.prompt_logprobs) == (["!"], [3], True, 2, True)


def test_min_tokens_is_capped_at_max_tokens():
    assert params(max_tokens=3, min_tokens=10)[0].min_tokens == 3


def test_a_chat_request_converts_the_same_way():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], seed=1, n=2)
    out = generation_params(req, 5, None, False, VOCAB)
    assert [(p.max_tokens, p.logprobs, p.sampling.seed) for p in out] == [(5, None, 1), (5, None, 2)]


def test_a_top_k_of_the_vocabulary_or_more_is_off():
    assert [params(top_k=k)[0].sampling.top_k for k in (VOCAB - 1, VOCAB, 2**62)] == [VOCAB - 1, 0, 0]


def test_seeds_of_choices_wrap_within_64_bits():
    assert [p.sampling.seed for p in params(n=2, seed=2**63 - 1)] == [2**63 - 1, -(2**63)]


def test_the_models_defaults_fill_what_the_request_leaves_unset():
    defaults = {"temperature": 0.3, "top_k": 7, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1}
    s = generation_params(CompletionRequest(prompt="x"), 8, None, False, VOCAB, defaults=defaults)[0].sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (0.3, 7, 0.8, 0.05, 1.1)
    req = CompletionRequest(prompt="x", temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    s = generation_params(req, 8, None, False, VOCAB, defaults=defaults)[0].sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1.0)


def test_the_card_scores_as_many_alternatives_as_either_logprobs_asks():
    p = generation_params(CompletionRequest(prompt="x"), 8, 1, True, VOCAB, prompt_top=4)[0]
    assert (p.logprobs, p.sampling.logprobs, p.prompt_logprobs) == (1, 4, True)
    assert generation_params(CompletionRequest(prompt="x"), 8, 2, False, VOCAB, prompt_top=4)[0].sampling.logprobs == 2


def test_vllms_flags_reach_the_engine():
    p = params(include_stop_str_in_output=True, skip_special_tokens=False)[0]
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
    assert (params()[0].include_stop_str_in_output, params()[0].skip_special_tokens) == (False, True)


def test_generation_defaults_are_the_files_sampling_values_that_differ_from_transformers(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
         "repetition_penalty": 1.0, "max_new_tokens": 256}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    assert generation_defaults(tmp_path, "vllm") == {}
    assert generation_defaults(tmp_path / "nothing-here") == {}  # auto, and no file: no defaults
    assert generation_defaults(tmp_path / "model.gguf", str(tmp_path)) == generation_defaults(tmp_path)
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(tmp_path, str(tmp_path / "nothing-here"))
