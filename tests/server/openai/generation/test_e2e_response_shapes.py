"""Every generation answer is the shape server/openai/generation/response_bodies.py declares (and /openapi.json
documents): JSON bodies and each streamed chunk, with logprobs, echo, prompt logprobs and usage."""

from __future__ import annotations

import json

import pytest

from spyre_serve.server.openai.generation.response_bodies import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)
from tests.server.servers import PROMPT

MESSAGES = [{"role": "user", "content": "Say hello."}]


def chunks(client, path, body):
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"echo": True, "logprobs": 1, "prompt_logprobs": 2}, {"n": 2}])
def test_completions_bodies_and_chunks_are_the_declared_shapes(client, extra):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = CompletionResponse.model_validate(r.json())
    assert len(answer.choices) == extra.get("n", 1) and answer.usage.completion_tokens == 4 * extra.get("n", 1)
    if "prompt_logprobs" in extra:
        assert answer.choices[0].prompt_logprobs[0] is None and answer.choices[0].prompt_logprobs[1]
    streamed = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    got = chunks(client, "/v1/completions", {**streamed, "stream_options": {"include_usage": True}})
    for chunk in got:
        CompletionChunk.model_validate(chunk)
    assert got[-1]["usage"]["completion_tokens"] == 4 * extra.get("n", 1)


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2}])
def test_chat_bodies_and_chunks_are_the_declared_shapes(client, extra):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = ChatCompletionResponse.model_validate(r.json())
    assert answer.choices[0].message.role == "assistant"
    if extra.get("logprobs"):
        assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    got = chunks(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in got:
        ChatCompletionChunk.model_validate(chunk)
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"


def test_openapi_documents_the_answers_of_both_endpoints(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionResponse")):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith("/" + name)
        assert content["text/event-stream"]["schema"]["$ref"].endswith("Chunk")
        assert name in schemas and "choices" in schemas[name]["properties"]
