"""POST /v1/completions on the real stack: granite-tiny, ModelRunner, Engine, uvicorn."""

from __future__ import annotations

import pytest

from tests.server.servers import PROMPT, sse_events


def complete(client, **body):
    body.setdefault("temperature", 0)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_completion_has_vllms_shape_and_counts_tokens(client, greedy):
    tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert greedy["object"] == "text_completion"
    assert greedy["id"].startswith("cmpl-")
    choice = greedy["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert greedy["usage"] == {"prompt_tokens": tokens, "completion_tokens": 12, "total_tokens": tokens + 12,
                               "spyre": greedy["usage"]["spyre"]}   # its steps on a real card


def test_logprobs_list_each_token_with_its_logprob_top_alternatives_and_offset(greedy):
    choice = greedy["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(12)]
    assert lp["text_offset"] == offsets
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert logprob <= 0
        assert top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the sampled token is the top one


def test_a_token_id_prompt_gives_the_same_text_as_the_string(client, greedy):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = complete(client, prompt=ids, max_tokens=4, ignore_eos=True)
    assert greedy["choices"][0]["text"].startswith(body["choices"][0]["text"])


def test_a_list_of_prompts_gives_one_choice_per_prompt(client, greedy):
    body = complete(client, prompt=[PROMPT, "Hello there"], max_tokens=3, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert greedy["choices"][0]["text"].startswith(body["choices"][0]["text"])
    hello = client.post("/tokenize", json={"prompt": "Hello there"}).json()["count"]
    prompt = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert body["usage"]["prompt_tokens"] == prompt + hello
    assert body["usage"]["completion_tokens"] == 6


def test_a_list_of_token_id_lists_gives_one_choice_per_list(client):
    body = complete(client, prompt=[[100, 200, 300], [400, 500]], max_tokens=2, ignore_eos=True)
    assert len(body["choices"]) == 2
    assert body["usage"]["prompt_tokens"] == 5


def test_n_gives_n_choices_and_a_seed_makes_them_reproducible(client):
    body = dict(prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=1234, n=2, ignore_eos=True)
    first = complete(client, **body)
    second = complete(client, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert first["usage"]["completion_tokens"] == 8


def test_top_k_one_samples_the_greedy_token_at_any_temperature(client, greedy):
    body = complete(client, prompt=PROMPT, max_tokens=3, temperature=1.5, top_k=1, top_p=0.9, min_p=0.0,
                    seed=5, ignore_eos=True, user="test-user")
    assert greedy["choices"][0]["text"].startswith(body["choices"][0]["text"])


def test_echo_puts_the_prompt_before_the_completion(client, greedy):
    body = complete(client, prompt=PROMPT, max_tokens=2, echo=True, ignore_eos=True)
    text = body["choices"][0]["text"]
    assert text.startswith(PROMPT)
    assert greedy["choices"][0]["text"].startswith(text[len(PROMPT):])


def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = complete(client, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0


def test_prompt_scores_do_not_depend_on_the_prefill_chunking(client):
    long_prompt = " ".join([PROMPT] * 8)  # longer than the 64-token step budget: three chunks
    ids = client.post("/tokenize", json={"prompt": long_prompt}).json()["tokens"]
    assert len(ids) > 64
    whole = complete(client, prompt=ids, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    head = complete(client, prompt=ids[:40], max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert whole["token_logprobs"][0] is None and head["token_logprobs"][0] is None
    assert None not in whole["token_logprobs"][1:]
    assert whole["token_logprobs"][1:40] == pytest.approx(head["token_logprobs"][1:], abs=1e-4)


def test_a_stop_string_spanning_tokens_cuts_the_text_and_is_the_stop_reason(client, greedy):
    text = greedy["choices"][0]["text"]
    tokens = greedy["choices"][0]["logprobs"]["tokens"]
    start = len(tokens[0]) + len(tokens[1]) + len(tokens[2]) - 1  # spans tokens 2 and 3
    stop = text[start : start + 2]
    body = complete(client, prompt=PROMPT, max_tokens=12, stop=["@@never@@", stop], ignore_eos=True)
    choice = body["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_a_stop_token_id_ends_generation_and_is_the_stop_reason(client, greedy):
    tokens = greedy["choices"][0]["logprobs"]["tokens"]
    ids = client.post("/tokenize", json={"prompt": tokens[3]}).json()["tokens"]
    assert len(ids) == 1
    body = complete(client, prompt=PROMPT, max_tokens=12, stop_token_ids=ids, ignore_eos=True)
    choice = body["choices"][0]
    cut = tokens.index(tokens[3])
    assert choice["text"] == "".join(tokens[:cut])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[0])
    assert body["usage"]["completion_tokens"] == cut + 1


def test_min_tokens_and_penalties_are_accepted(client):
    body = complete(client, prompt="Hello", max_tokens=4, min_tokens=4, presence_penalty=0.5,
                    frequency_penalty=0.5, repetition_penalty=1.2)
    assert body["usage"]["completion_tokens"] == 4


def test_stream_chunks_add_up_to_the_greedy_text_then_usage_then_done(client, greedy):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert greedy["choices"][0]["text"].startswith(text) and len(text) > 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(client):
    # vLLM's stream_options.continuous_usage_stats, as guidellm sends it on every stream
    body = {"prompt": [PROMPT, "Hi"], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    prompts = [len(client.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in body["prompt"]]
    seen = [0] * 4
    for e in events[:-2]:
        i = e["choices"][0]["index"]
        seen[i] += 1                      # a token per chunk here (granite-tiny, short words)
        assert e["usage"]["prompt_tokens"] == prompts[i // 2]
        assert e["usage"]["completion_tokens"] >= seen[i] - 1 and e["usage"]["completion_tokens"] <= 4
        assert e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
    finals = {}
    for e in events[:-2]:
        finals[e["choices"][0]["index"]] = e["usage"]["completion_tokens"]
    assert finals == {0: 4, 1: 4, 2: 4, 3: 4}
    assert events[-2]["usage"] == {"prompt_tokens": sum(prompts), "completion_tokens": 16,
                                   "total_tokens": sum(prompts) + 16, "spyre": events[-2]["usage"]["spyre"]}


def test_a_streamed_echo_with_logprobs_sends_the_prompt_first(client):
    body = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
            "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    first = events[0]["choices"][0]
    assert first["text"].startswith("Hello there")
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "usage" not in events[-2]


def test_a_stream_with_n_choices_sends_each_choice_to_its_finish(client):
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 1.0, "seed": 3, "n": 2,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finished = set()
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1}
    whole = complete(client, **{**body, "stream": False})
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]
