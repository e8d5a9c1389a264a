"""completions.py: /v1/completions over an engine that answers "ok." at once."""

from __future__ import annotations

import json

import pytest

from tests.server.openai.fakes import ScriptedEngine, client_for, ids_of


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(reply="ok.")


def complete(engine, **body):
    r = client_for(engine).post("/v1/completions", json={"max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(engine, **body) -> list:
    r = client_for(engine).post("/v1/completions", json={"max_tokens": 8, "stream": True, **body})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_completion_has_vllms_envelope_and_counts_tokens(engine):
    body = complete(engine, prompt="hi", model="tiny")
    assert body["id"].startswith("cmpl-") and (body["object"], body["model"]) == ("text_completion", "tiny")
    assert body["choices"] == [{"index": 0, "text": "ok.", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # BOS, h, i


def test_the_prompt_reaches_the_engine_as_token_ids_after_the_bos_with_the_limit(engine):
    complete(engine, prompt="hi", max_tokens=2)
    (_, ids, params), = engine.added
    assert ids == [0, *ids_of("hi")] and params[0].max_tokens == 2


def test_add_special_tokens_false_leaves_the_bos_out(engine):
    body = complete(engine, prompt="hi", add_special_tokens=False)
    assert engine.added[0][1] == ids_of("hi") and body["usage"]["prompt_tokens"] == 2


def test_token_ids_are_taken_as_given(engine):
    complete(engine, prompt=[3, 4])
    assert engine.added[0][1] == [3, 4]


def test_the_prompt_tokens_are_what_tokenize_counts(engine):
    client = client_for(engine)
    for body in [{"prompt": "hi there"}, {"prompt": "hi", "add_special_tokens": False}]:
        usage = client.post("/v1/completions", json={"max_tokens": 1, **body}).json()["usage"]
        assert usage["prompt_tokens"] == client.post("/tokenize", json=body).json()["count"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(engine):
    complete(engine, prompt="abcdef", truncate_prompt_tokens=3)
    assert engine.added[0][1] == ids_of("def")


def test_without_max_tokens_every_prompt_gets_what_the_longest_leaves(engine):
    complete(engine, prompt=["a", "abcd"], max_tokens=None)
    assert [p[0].max_tokens for _, _, p in engine.added] == [59, 59]  # 64 - BOS - 4


def test_each_prompt_gets_n_choices_in_order(engine):
    body = complete(engine, prompt=["a", "b"], n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3] and len(engine.added) == 2


def test_logprobs_list_each_generated_token_from_offset_zero(engine):
    lps = complete(engine, prompt="hi", logprobs=1)["choices"][0]["logprobs"]
    assert lps["tokens"] == ["o", "k", "."] and lps["text_offset"] == [0, 1, 2]
    assert lps["token_logprobs"] == [-0.5, -0.5, -0.5] and lps["top_logprobs"][0] == {"p": -1.0, "o": -0.5}


def test_echo_puts_the_prompt_text_as_sent_before_the_completion(engine):
    assert complete(engine, prompt="hi", echo=True)["choices"][0]["text"] == "hiok."
    assert complete(engine, prompt=[8, 9], echo=True)["choices"][0]["text"] == "ghok."


def test_echo_with_logprobs_asks_for_the_prompts_scores_and_lists_the_prompt_first(engine):
    lps = complete(engine, prompt="hi", echo=True, logprobs=0, add_special_tokens=False)["choices"][0]["logprobs"]
    assert engine.added[0][2][0].prompt_logprobs
    assert lps["tokens"] == ["h", "i", "o", "k", "."] and lps["text_offset"] == [0, 1, 2, 3, 4]
    assert lps["token_logprobs"][:2] == [None, None]  # this engine sent no prompt scores


def test_a_stream_sends_a_chunk_per_token_then_done(engine):
    chunks = stream(engine, prompt="hi")
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ok."
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_streamed_echo_comes_in_the_first_chunk_and_offsets_run_on(engine):
    chunks = stream(engine, prompt="hi", echo=True, logprobs=0, add_special_tokens=False)
    first = chunks[0]["choices"][0]
    assert first["text"] == "hio" and first["logprobs"]["text_offset"] == [0, 1, 2]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[1:]] == [[3], [4]]


def test_a_stream_with_usage_ends_with_the_counts(engine):
    chunks = stream(engine, prompt="hi", stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_request_over_a_cap_is_refused_before_it_is_tokenized(engine):
    r = client_for(engine, max_prompts=2).post("/v1/completions", json={"prompt": ["a", "b", "c"]})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("the limit is 2 (--max-prompts)")
    assert engine.added == []


def test_the_waiting_limit_counts_the_requests_sequences(engine):
    engine.num_waiting_sequences = 3
    client = client_for(engine, max_waiting=8)
    assert client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
    assert r.status_code == 503 and "this request adds 6" in r.json()["error"]["message"]
