"""Nothing a request leaves behind once it ends: 2,000 scoring requests (max_tokens 0, echo,
logprobs: lm-eval's loglikelihood), echo prefills aborted half way and penalized requests,
straight into the real engine and runner, leave the runner holding nothing (no prompt-logprob
row, no penalty slot) and the KV cache empty."""

from __future__ import annotations

import random
import time

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.sequence import GenerationParams
from tests.reliability.servers import running_server
from tests.server.fakes import Collector

WORDS = ("the river runs past the old mill where seven birds sang about stone bridges near the "
         "quiet harbour and boats rest until morning light").split()


@pytest.fixture(scope="module")
def built():
    with running_server() as s:
        yield s.built


def prompt_ids(tokenizer, rng: random.Random, words: int) -> list[int]:
    return tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(words)))


def scoring(**kw) -> GenerationParams:
    return GenerationParams(sampling=SamplingParams(temperature=0.0, logprobs=1), max_tokens=0,
                            logprobs=1, prompt_logprobs=True, **kw)


def wait_idle(engine, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while engine.num_requests or engine.blocks.num_used:
        assert time.monotonic() < deadline, (engine.num_requests, engine.blocks.num_used)
        time.sleep(0.01)


def test_2000_scoring_requests_leave_nothing_in_the_runner(built):
    engine, tok, rng = built.engine, built.model.tokenizer, random.Random(11)
    t0 = time.monotonic()
    collectors = []
    for i in range(2000):
        c = Collector()
        engine.add_request(f"score-{i}", prompt_ids(tok, rng, rng.randint(2, 8)), [scoring()], c)
        collectors.append(c)
    for c in collectors:
        c.wait(120)
        assert c.last.finish_reason == "length" and c.last.error is None
        assert c.last.prompt_logprobs is not None and c.last.prompt_logprobs[0] is None
    wait_idle(engine)
    assert built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}
    assert time.monotonic() - t0 < 120


def test_echo_prefills_aborted_half_way_leave_nothing_in_the_runner(built):
    engine, tok, rng = built.engine, built.model.tokenizer, random.Random(12)
    echo = GenerationParams(sampling=SamplingParams(temperature=0.0, logprobs=1, presence_penalty=0.5),
                            max_tokens=8, logprobs=1, prompt_logprobs=True)
    half_way = 0
    for i in range(12):
        ids = prompt_ids(tok, rng, 120)[:200]           # a few chunks of 64
        rid = f"abort-{i}"
        engine.add_request(rid, ids, [echo], Collector())
        deadline = time.monotonic() + 60
        while True:                                      # until its prefill is under way
            req = engine._requests.get(rid)
            seq = req.seqs[0] if req is not None else None
            if seq is not None and 0 < seq.num_computed < seq.num_prompt:
                half_way += 1
                break
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        engine.abort(rid)
    wait_idle(engine)
    assert half_way == 12
    assert built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}


def test_penalized_requests_finishing_aborted_and_stopping_free_their_slots(built):
    engine, tok, rng = built.engine, built.model.tokenizer, random.Random(13)
    slots = built.runner.limits.num_penalty_slots
    collectors = []
    for i in range(3 * slots):                           # more than the card has slots for
        p = GenerationParams(sampling=SamplingParams(temperature=0.8, seed=i, frequency_penalty=0.3,
                                                     repetition_penalty=1.1),
                             max_tokens=rng.randint(1, 12), stop=["e"] if i % 3 == 0 else [])
        c = Collector()
        engine.add_request(f"pen-{i}", prompt_ids(tok, rng, rng.randint(2, 12)), [p], c)
        collectors.append(c)
        if i % 5 == 0:
            engine.abort(f"pen-{i}")
    for i, c in enumerate(collectors):
        if i % 5:
            assert c.wait(120).last.error is None
    wait_idle(engine)
    assert built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}
