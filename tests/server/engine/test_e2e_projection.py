"""The real card's clock through the HTTP API (the shared real server): every launched step's
projected seconds in /metrics' spyre_projected_step_seconds, and each answer's usage.spyre
(projected TTFT, TPOT and total) on completions, chat and the Responses API, whole and
streamed, in the shapes server/openai/generation/response_bodies.py declares."""

from __future__ import annotations

import json

import pytest

from spyre_serve.server.openai.generation.response_bodies import (
    ChatCompletionChunk,
    CompletionResponse,
    ResponsesResponse,
)
from tests.server.servers import PROMPT, sse_events

HISTOGRAM = "spyre_projected_step_seconds"


def histogram(client) -> tuple[float, float]:
    """(count, sum) of the projected steps' histogram."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        for part in ("_count", "_sum"):
            if line.startswith(HISTOGRAM + part + "{"):
                values[part] = float(line.rpartition(" ")[2])
    assert set(values) == {"_count", "_sum"}, f"{HISTOGRAM} is not in /metrics"
    return values["_count"], values["_sum"]


def check_spyre(usage: dict, later_tokens: int) -> dict:
    spyre = usage["spyre"]
    assert set(spyre) == {"projected_ttft_seconds", "projected_tpot_seconds", "projected_seconds"}
    assert spyre["projected_ttft_seconds"] > 0 and spyre["projected_tpot_seconds"] > 0
    # one choice: its steps up to its first token, then one step per later token
    assert spyre["projected_seconds"] == pytest.approx(
        spyre["projected_ttft_seconds"] + later_tokens * spyre["projected_tpot_seconds"])
    return spyre


def test_each_step_is_in_the_histogram_and_the_answer_carries_its_projection(client):
    count, total = histogram(client)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    CompletionResponse.model_validate(body)
    spyre = check_spyre(body["usage"], later_tokens=3)
    after, after_total = histogram(client)
    assert after >= count + 4                          # its prefill and three decodes at least
    assert after_total - total >= spyre["projected_seconds"] * (1 - 1e-9)
    # a step of granite-tiny (26M float32 parameters, ~0.1 GB) on the card: about a millisecond
    assert 1e-4 < spyre["projected_tpot_seconds"] < 1e-2


def test_a_chat_stream_and_a_response_carry_the_projection(client):
    messages = [{"role": "user", "content": "Say hello."}]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    for chunk in events[:-1]:
        ChatCompletionChunk.model_validate(chunk)
    check_spyre(events[-2]["usage"], later_tokens=2)
    r = client.post("/v1/responses", json={"input": "Say hello.", "max_output_tokens": 3,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    ResponsesResponse.model_validate(r.json())
    assert r.json()["usage"]["spyre"]["projected_ttft_seconds"] > 0
    with client.stream("POST", "/v1/responses", json={"input": "Say hello.", "max_output_tokens": 3,
                                                      "temperature": 0, "stream": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = data[-1]["response"]
    assert data[-1]["type"] in ("response.completed", "response.incomplete")
    assert final["usage"]["spyre"]["projected_seconds"] >= final["usage"]["spyre"]["projected_ttft_seconds"] > 0
