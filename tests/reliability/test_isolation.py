"""The engine side of isolation, on the real stack: values past what a step holds are 400s
(the engine refuses them before they reach a step), and if one did reach the runner its own
checks fail that request alone; scoring and penalized requests keep nothing of theirs after
they end and change nothing of their neighbours'. Each case beside a normal greedy stream,
which must give its solo text."""

from __future__ import annotations

import asyncio

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.sequence import GenerationParams
from tests.reliability.servers import beside
from tests.server.fakes import Collector

# what passes the HTTP validation but not a step's int32 fields: (what, fields, statuses the
# server may answer, the param a 400 names). A top_k past the vocabulary means "off" to the
# HTTP layer (served, 200); ids past int32 are refused by the engine (400).
PAST_THE_FIELDS = [
    ("top_k 2^31", {"top_k": 2**31}, {200, 400}, "top_k"),
    ("top_k 2^32", {"top_k": 2**32}, {200, 400}, "top_k"),
    ("top_k 2^63", {"top_k": 2**63}, {200, 400}, "top_k"),
    ("top_k 2^64", {"top_k": 2**64 + 5}, {200, 400}, "top_k"),
    ("stop token id 2^31", {"stop_token_ids": [2**31], "min_tokens": 2}, {400}, "stop_token_ids"),
    ("stop token id -5", {"stop_token_ids": [-5], "min_tokens": 2}, {400}, "stop_token_ids"),
]


def body(**kw) -> dict:
    return {"prompt": "Hello there", "max_tokens": 8, "temperature": 0.7, **kw}


@pytest.mark.parametrize(("what", "fields", "statuses", "param"), PAST_THE_FIELDS,
                         ids=[p[0] for p in PAST_THE_FIELDS])
def test_a_value_past_the_steps_fields_fails_no_step_and_the_neighbour_gives_its_solo_text(
        server, solo, what, fields, statuses, param):
    failed_steps = server.built.engine.stats.failed_steps

    async def bad(client):
        return await client.post("/v1/completions", json=body(**fields))

    text, r = beside(server, bad)
    assert text == solo
    assert r.status_code in statuses, r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == param
    assert server.built.engine.stats.failed_steps == failed_steps


def test_if_a_bad_value_reached_the_runner_its_checks_fail_that_request_alone(server, solo, monkeypatch):
    # past the HTTP layer and with the engine's own refusal switched off, straight into the
    # engine: the runner's launch checks are the second line, and name the sequence at fault
    engine = server.built.engine
    monkeypatch.setattr("spyre_serve.server.sched.admission.check_params", lambda params: None)
    tok = server.built.model.tokenizer

    async def bad(client):
        def submit_and_wait(i):
            c = Collector()
            p = GenerationParams(sampling=SamplingParams(temperature=0.7, top_k=2**31 + i), max_tokens=8)
            engine.add_request(f"past-int32-{i}", tok.encode("Hello there"), [p], c)
            return c.wait(60).last

        return await asyncio.gather(*(asyncio.to_thread(submit_and_wait, i) for i in range(3)))

    text, lasts = beside(server, bad)
    assert text == solo
    for last in lasts:
        assert last.finish_reason == "error" and "top_k must be an integer in 0..2147483647" in last.error
    assert engine.alive


def test_scoring_requests_beside_a_stream_leave_nothing_in_the_runner(server, http, solo):
    score = {"prompt": "The river runs past the old mill", "max_tokens": 0, "echo": True, "logprobs": 1}

    async def scoring(client):
        return await asyncio.gather(*(client.post("/v1/completions", json=score) for _ in range(24)))

    text, responses = beside(server, scoring)
    assert text == solo
    assert all(r.status_code == 200 for r in responses), responses[0].text
    lps = responses[0].json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and all(isinstance(x, float) for x in lps[1:])
    assert server.built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}


def test_penalized_requests_beside_a_stream_change_nothing_of_it_and_free_their_slots(server, http, solo):
    # a prompt granite-tiny's greedy answer repeats itself after (the penalties then change it)
    penalized = body(prompt="the the the the the the the the", temperature=0, presence_penalty=2.0,
                     frequency_penalty=2.0, repetition_penalty=2.0, max_tokens=24, ignore_eos=True)

    async def penalties(client):
        return await asyncio.gather(*(client.post("/v1/completions", json=penalized) for _ in range(6)))

    text, responses = beside(server, penalties)
    assert text == solo
    texts = {r.json()["choices"][0]["text"] for r in responses}
    assert len(texts) == 1, "the same greedy penalized request gives the same text, in any batch"
    plain = http.post("/v1/completions", json={**penalized, "presence_penalty": 0, "frequency_penalty": 0,
                                              "repetition_penalty": 1}).json()["choices"][0]["text"]
    assert texts != {plain}
    assert server.built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}
