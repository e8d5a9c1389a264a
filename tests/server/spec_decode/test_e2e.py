"""`serve --speculative-config '{"method": "ngram", ...}'` through the HTTP API: granite-tiny
answers exactly what the server without speculation answers (greedy, seeded, several choices,
logprobs, streaming, stop strings, penalties), counts its proposals in vLLM's metrics, and
refuses what it cannot take at start."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.servers import ServerThread, real_settings, sse_events

SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
        '"disable_by_batch_size": 4}')
# a prompt that quotes itself: the lookup finds its n-grams again; granite-tiny (random weights)
# continues LOOPING greedily with one word over and over, which the lookup proposes and keeps
QUOTING = ("Copy the list: red blue green red blue green red blue green. The list again: red blue green red")
LOOPING = "a a a a a a a a a a a a"


def _serving(spec):
    """An httpx client of granite-tiny served with --speculative-config ``spec`` (c.built: the server)."""
    from spyre_serve.server.launch.cli import build
    from spyre_serve.server.spec_decode.proposals import SpeculativeConfig

    built = build(real_settings(speculative_config=SpeculativeConfig.parse(spec)), progress=False)
    try:
        with ServerThread(built.app) as server, httpx.Client(base_url=server.url, timeout=600) as c:
            c.built = built
            yield c
    finally:
        built.engine.shutdown()


@pytest.fixture(scope="module")
def spec_client():
    yield from _serving(SPEC)


def _texts(r) -> list[str]:
    assert r.status_code == 200, r.text
    return [ch["text"] for ch in r.json()["choices"]]


BODIES = [
    {"prompt": LOOPING, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": QUOTING, "max_tokens": 20, "temperature": 0.9, "seed": 11, "ignore_eos": True, "n": 2},
    {"prompt": LOOPING, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 3},
    {"prompt": QUOTING, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.3},
    {"prompt": [QUOTING, "one two three one two three one two"], "max_tokens": 12, "temperature": 0,
     "ignore_eos": True, "min_tokens": 5},
]


def test_answers_equal_the_server_without_speculation(client, spec_client):
    for body in BODIES:
        got, want = spec_client.post("/v1/completions", json=body), client.post("/v1/completions", json=body)
        assert _texts(got) == _texts(want), body
        if body.get("logprobs"):
            g, w = got.json()["choices"][0]["logprobs"], want.json()["choices"][0]["logprobs"]
            assert g["tokens"] == w["tokens"]
            assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-4)
    stats = spec_client.built.engine.stats
    assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
    assert stats.spec_accepted_tokens > 0


def test_a_stop_string_inside_kept_proposals_cuts_there(client, spec_client):
    free = client.post("/v1/completions", json=BODIES[0]).json()["choices"][0]["text"]
    stop = free[len(free) // 2:len(free) // 2 + 3]
    body = {**BODIES[0], "stop": [stop]}
    got, want = spec_client.post("/v1/completions", json=body), client.post("/v1/completions", json=body)
    assert _texts(got) == _texts(want) and got.json()["choices"][0]["finish_reason"] == "stop"


def test_streams_and_concurrent_requests_answer_as_without(client, spec_client):
    body = {**BODIES[0], "stream": True}
    with spec_client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == \
        _texts(client.post("/v1/completions", json=BODIES[0]))[0]
    prompts = [f"{LOOPING} {i} {i} {i}" for i in range(6)]     # more than disable_by_batch_size at once
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: spec_client.post("/v1/completions", json={**BODIES[0], "prompt": p}), prompts))
    want = [client.post("/v1/completions", json={**BODIES[0], "prompt": p}) for p in prompts]
    assert [_texts(g) for g in got] == [_texts(w) for w in want]
    engine = spec_client.built.engine                          # every block back: none leaked
    assert engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_metrics_count_drafts_and_accepted_tokens(spec_client):
    spec_client.post("/v1/completions", json=BODIES[0])
    text = spec_client.get("/metrics").text
    values = {name: float(v) for name, v in re.findall(
        r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)\{[^}]*\} (\S+)$', text, re.M)}
    assert set(values) == {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                           "vllm:spec_decode_num_accepted_tokens_total"}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    accepted, drafted = (values[f"vllm:spec_decode_num_{k}_tokens_total"] for k in ("accepted", "draft"))
    assert 0 <= accepted <= drafted


def test_what_speculation_does_not_take_is_refused():
    from spyre_serve.server.launch.cli import build
    from spyre_serve.server.spec_decode.proposals import SpeculativeConfig, SpeculativeConfigError

    for bad, why in [('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
                     ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
                     ('{"method": "ngram"}', "num_speculative_tokens must be a positive integer"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                      '"prompt_lookup_max": 2}', "prompt_lookup_min \\(4\\) exceeds prompt_lookup_max \\(2\\)"),
                     ('{"num_speculative_tokens": 2, "typo": 1}', "unknown keys \\['typo'\\]"),
                     ("[1]", "must be a JSON object")]:
        with pytest.raises(SpeculativeConfigError, match=why):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="generating runner"):
        build(real_settings(speculative_config=SpeculativeConfig.parse(SPEC), runner="pooling",
                            max_num_batched_tokens=64, max_model_len=None), progress=False)


@pytest.fixture(scope="module")
def draft_client():
    """granite-tiny proposing for itself: its greedy proposals are the served model's tokens."""
    from spyre_serve.models import resolve_model

    yield from _serving({"model": str(resolve_model("granite-tiny")), "num_speculative_tokens": 3,
                         "disable_by_batch_size": 4})


def test_a_draft_model_proposes_and_the_answers_do_not_change(client, draft_client):
    stats = draft_client.built.engine.stats
    greedy = [{"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
              for p in ("The quick brown fox jumps over the lazy dog. Then", QUOTING)]
    for body in greedy:
        drafted = _texts(draft_client.post("/v1/completions", json=body))
        assert drafted == _texts(client.post("/v1/completions", json=body))
    # the same model greedily: every proposal is the token the served model samples
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    for body in BODIES[1:]:                       # seeded, logprobs, penalties (no proposals), two prompts
        got, want = draft_client.post("/v1/completions", json=body), client.post("/v1/completions", json=body)
        assert _texts(got) == _texts(want), body
    prompts = [f"{QUOTING} {i}" for i in range(6)]                 # past disable_by_batch_size
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: draft_client.post("/v1/completions", json={**greedy[0], "prompt": p}), prompts))
    assert [_texts(g) for g in got] == [_texts(client.post("/v1/completions", json={**greedy[0], "prompt": p}))
                                        for p in prompts]
    engine = draft_client.built.engine
    assert engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    spec = engine.scheduler.speculator
    assert len(spec.free) + sum(len(st.blocks) for st in spec.states.values()) == spec.runner.num_kv_blocks


def test_proposals_under_preemption_keep_every_answer_and_block(client):
    """A KV cache too small for the requests at once (6 blocks of 16; each request needs 3):
    sequences with proposals in flight are preempted and recomputed, answers stay the same."""
    from spyre_serve.server.launch.cli import build
    from spyre_serve.server.spec_decode.proposals import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                    "disable_by_batch_size": 16})
    built = build(real_settings(num_kv_blocks=6, max_model_len=96, max_num_seqs=8, speculative_config=spec),
                  progress=False)
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = [f"{LOOPING} {w}" for w in ("x", "y", "z", "w", "v", "u")]
    try:
        with ServerThread(built.app) as server, httpx.Client(base_url=server.url, timeout=600) as c:
            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda p: c.post("/v1/completions", json={**body, "prompt": p}), prompts))
        engine = built.engine
        assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_accepted_tokens > 0
        assert [_texts(g) for g in got] == [_texts(client.post("/v1/completions", json={**body, "prompt": p}))
                                            for p in prompts]
        assert engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        built.engine.shutdown()
