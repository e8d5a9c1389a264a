"""The engine's parts, each on its own: admission checks, the inbox, stop checks, SeqUpdate
assembly, and which requests a failed step fails (the engine end to end: test_core.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.models.step.interface import SeqWorkError
from spyre_serve.server.engine.inbox import Inbox
from spyre_serve.server.engine.open_requests import EngineRequest
from spyre_serve.server.engine.outputs import take_update
from spyre_serve.server.engine.step_failures import MAX_FAILED_STEPS_IN_A_ROW, StepFailures
from spyre_serve.server.engine.step_work import ScheduledChunk
from spyre_serve.server.engine.stopping import banned_tokens, check_stop, eos_token_ids
from spyre_serve.server.engine.watchdog import EngineFatal
from spyre_serve.server.sched.admission import (
    RequestRejected,
    check_lengths,
    check_params,
    check_prompt_ids,
)
from spyre_serve.server.sched.sequence import GenerationParams, Sequence


def seq(seq_id=0, request_id="r", prompt=(1, 2, 3), **kw) -> Sequence:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), **kw)
    s = Sequence(seq_id, request_id, 0, list(prompt), params, 0.0)
    s.detok = SimpleNamespace(add=lambda t: f"<{t}>", flush=lambda: "")
    return s


def chunk(s: Sequence) -> ScheduledChunk:
    return ScheduledChunk(s, start=0, num_new=len(s.token_ids), sample=True, from_device=False,
                          prompt_logprobs=False, num_generated=0)


# ---- admission ------------------------------------------------------------------------

def test_lengths_past_the_context_or_the_cache_are_refused_naming_the_field():
    limits = dict(max_model_len=100, num_kv_blocks=4, block_size=16)
    check_lengths(10, 54, **limits)                       # 64 tokens: the whole cache
    with pytest.raises(RequestRejected, match="maximum context length is 100") as info:
        check_lengths(90, 20, **limits)
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestRejected, match="KV cache holds 64 tokens") as info:
        check_lengths(65, 0, **limits)
    assert info.value.param == "prompt"


def test_prompt_ids_and_params_a_step_cannot_hold_are_refused():
    check_prompt_ids([0, 9], vocab_size=10)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        check_prompt_ids([10], vocab_size=10)
    with pytest.raises(RequestRejected) as info:
        check_params([GenerationParams(SamplingParams(), max_tokens=2, min_tokens=3)])
    assert info.value.param == "min_tokens"
    with pytest.raises(RequestRejected) as info:
        check_params([])
    assert info.value.param == "n"


# ---- the inbox ------------------------------------------------------------------------

def test_the_inbox_counts_what_waits_and_takes_nothing_once_closed():
    inbox = Inbox()
    req = EngineRequest("a", [seq(0, "a"), seq(1, "a")], lambda u: None, 0.0)
    assert inbox.add(req)
    inbox.abort("b")
    assert (inbox.num_requests(), inbox.num_sequences()) == (1, 2)
    assert inbox.take() == [("add", req), ("abort", "b")]
    assert inbox.take() == []
    inbox.add(req)
    assert inbox.close() == [("add", req)]
    assert not inbox.add(req) and inbox.take() == []


# ---- stopping -------------------------------------------------------------------------

def test_eos_ids_are_the_configs_and_the_tokenizers():
    config = SimpleNamespace(eos_token_id=[5, 6])
    assert eos_token_ids(config, SimpleNamespace(eos_token_id=7)) == {5, 6, 7}
    assert eos_token_ids(SimpleNamespace(eos_token_id=5), None) == {5}
    assert eos_token_ids(None, None) == frozenset()


def test_min_tokens_bans_every_stopping_id_inside_the_vocabulary():
    p = GenerationParams(SamplingParams(), stop_token_ids=[3, 99])
    assert banned_tokens(p, frozenset({2}), vocab_size=10) == [2, 3]
    p.ignore_eos = True
    assert banned_tokens(p, frozenset({2}), vocab_size=100) == [3, 99]


def test_stop_checks_in_vllms_order():
    s = seq(max_tokens=3, stop_token_ids=[8], stop=["<4>"])
    s.token_ids += [9]
    assert check_stop(s, 9, frozenset({7}), 100) is None and s.text == "<9>"
    s.token_ids += [7]
    assert check_stop(s, 7, frozenset({7}), 100) == ("stop", None)      # EOS: no text
    s.token_ids[-1] = 8
    assert check_stop(s, 8, frozenset({7}), 100) == ("stop", 8)
    s.token_ids[-1] = 4
    assert check_stop(s, 4, frozenset({7}), 100) == ("stop", "<4>") and s.text == "<9>"
    s = seq(max_tokens=5, min_tokens=2)
    s.token_ids += [7]
    assert check_stop(s, 7, frozenset({7}), 100) is None                # min_tokens holds EOS
    s.token_ids += [1]
    assert check_stop(s, 1, frozenset(), 5) == ("length", None)         # max_model_len


# ---- outputs --------------------------------------------------------------------------

def test_an_update_carries_what_was_not_sent_and_nothing_twice():
    s = seq()
    assert take_update(s) is None
    s.token_ids += [4, 5]
    s.text = "ab"
    u = take_update(s)
    assert (u.token_ids, u.text, u.finish_reason) == ([4, 5], "ab", None)
    assert take_update(s) is None
    s.finish_reason = "length"
    s.status = type(s.status).FINISHED
    u = take_update(s)
    assert (u.token_ids, u.text, u.finish_reason) == ([], "", "length")


# ---- step failures --------------------------------------------------------------------

def test_a_refused_launch_fails_only_the_requests_the_runner_names():
    a, b = seq(0, "a"), seq(1, "b")
    failures = StepFailures()
    failed = failures.blame([chunk(a), chunk(b)], SeqWorkError({1: "top_k too large"}), ran=False)
    assert failed == {"b": "the step refused the request: top_k too large"}
    assert not failures.suspects


def test_a_failed_step_of_one_request_fails_it_and_of_several_makes_suspects():
    a, b, c = seq(0, "a"), seq(1, "a"), seq(2, "b")
    failures = StepFailures()
    assert failures.blame([chunk(a), chunk(b)], RuntimeError("boom"), ran=True) == {
        "a": "the step failed: RuntimeError: boom"}
    assert failures.blame([chunk(a), chunk(c)], RuntimeError("boom"), ran=True) == {}
    failures.blame([chunk(c)] * 2 + [chunk(a)], RuntimeError("again"), ran=True)
    assert list(failures.suspects) == [a, c]                            # each once


def test_too_many_failed_steps_in_a_row_are_fatal_and_a_success_resets_the_count():
    failures = StepFailures()
    for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        failures.count(RuntimeError("x"))
    failures.succeeded()
    for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        failures.count(RuntimeError("x"))
    with pytest.raises(EngineFatal, match=f"{MAX_FAILED_STEPS_IN_A_ROW} steps failed in a row"):
        failures.count(RuntimeError("x"))


def test_a_failure_blamed_by_elimination_counts_only_when_the_canary_fails_too():
    from spyre_serve.server.sched.block_manager import BlockManager
    from tests.server.fakes import FakeRunner

    class Broken(FakeRunner):
        def launch(self, work):
            raise RuntimeError("the card is gone")

    blocks = BlockManager(4, 4)
    failures = StepFailures()
    assert failures.blame([chunk(seq(0, "a"))], RuntimeError("boom"), ran=True) == {
        "a": "the step failed: RuntimeError: boom"}
    assert failures.unverified is not None and failures.in_a_row == 0
    failures.check_card(FakeRunner(), blocks, 99)                  # the card works: the request's
    assert failures.in_a_row == 0 and failures.unverified is None and blocks.num_free == 4
    for i in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        failures.blame([chunk(seq(i, "a"))], RuntimeError("boom"), ran=True)
        failures.check_card(Broken(), blocks, 100 + i)               # it does not: the card's
    assert failures.in_a_row == MAX_FAILED_STEPS_IN_A_ROW - 1 and blocks.num_free == 4
    failures.blame([chunk(seq(0, "a"))], RuntimeError("boom"), ran=True)
    with pytest.raises(EngineFatal):
        failures.check_card(Broken(), blocks, 200)
