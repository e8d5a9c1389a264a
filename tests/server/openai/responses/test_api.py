"""The Responses API over the fake engine (replies "ok.", one update a character): the store's
bound, what input items become, the neutral values accepted, the failure event of a stream,
and what /openapi.json declares."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response

from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.generation.response_bodies import (
    ResponsesResponse,
    ResponseStreamEvent,
)
from spyre_serve.server.openai.generation.sse import event_stream
from spyre_serve.server.openai.responses.output import Answer, ResponseEvents
from spyre_serve.server.openai.responses.request import ITEMS, ResponsesRequest, chat_messages
from spyre_serve.server.openai.responses.store import ResponseStore
from tests.server.openai.fakes import RecordingEngine, ScriptedEngine, client_for, update


def create(client, **body):
    r = client.post("/v1/responses", json={"input": "hi", **body})
    assert r.status_code == 200, r.text
    ResponsesResponse.model_validate(r.json())
    Response.model_validate(r.json())
    return r.json()


def test_the_store_keeps_the_newest_responses_and_not_those_made_with_store_false():
    client = client_for(max_stored_responses=2)
    first, second, third = (create(client)["id"] for _ in range(3))
    unstored = create(client, store=False)["id"]
    assert client.get(f"/v1/responses/{first}").status_code == 404
    assert [client.get(f"/v1/responses/{i}").json()["id"] for i in (second, third)] == [second, third]
    missing = client.get(f"/v1/responses/{unstored}").json()["error"]
    assert missing["param"] == "response_id" and "--max-stored-responses" in missing["message"]
    r = client.post("/v1/responses", json={"input": "hi", "previous_response_id": first})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert len(client.app.state.serving.responses) == 2
    none_kept = client_for(max_stored_responses=0)
    assert none_kept.get(f"/v1/responses/{create(none_kept)['id']}").status_code == 404


def test_an_answers_output_sent_back_as_input_is_the_same_conversation():
    engine = ScriptedEngine()
    client = client_for(engine)
    first = create(client, instructions="be kind", max_output_tokens=2)
    create(client, input=[{"role": "user", "content": "hi"}, *first["output"], {"role": "user", "content": "more"}])
    create(client, input="more", previous_response_id=first["id"])
    prompts = [ids for _, ids, _ in engine.added]
    # the same prompt but for the instructions, which previous_response_id does not carry over
    assert prompts[1] == prompts[2] and len(prompts[0]) < len(prompts[1])


def test_function_calls_join_the_assistant_turn_before_them_and_outputs_are_tool_messages():
    items = ITEMS.validate_python([
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "[]"},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "completed"}])
    messages = chat_messages(items)
    assert [(m["role"], m["content"], [c["id"] for c in m.get("tool_calls", [])]) for m in messages] == [
        ("assistant", "let me see", ["a", "b"]), ("tool", "1", []), ("assistant", None, ["c"])]
    assert messages[0]["tool_calls"][1]["function"] == {"name": "g", "arguments": "[]"}
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body", [{"truncation": "disabled"}, {"include": []}, {"background": False},
                                  {"service_tier": "auto"}, {"top_logprobs": 0}, {"reasoning": None},
                                  {"text": {"format": {"type": "text"}, "verbosity": "medium"}}])
def test_openais_fields_are_accepted_at_their_neutral_values(body):
    assert ResponsesRequest.model_validate({"input": "x", **body})


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity"),
    ({"service_tier": "flex"}, "service_tier", "leave service_tier out"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1, got 0"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "'user', 'system', 'developer' or 'assistant'"),
])
def test_a_value_not_served_is_a_400_saying_why(body, param, words):
    r = client_for().post("/v1/responses", json={"input": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words in r.json()["error"]["message"]


def test_a_prompt_over_the_context_names_input_and_max_output_tokens():
    client = client_for(ScriptedEngine(max_model_len=64))
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 60})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_a_failing_stream_ends_with_an_error_event_and_aborts_the_request():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "resp_1", [[5, 6]], ["params"])
        for u in (update(0, "o", [1]), update(0, "", [], finish="error", error="KeyError: device fault")):
            engine.deliver["resp_1-0"](u)
        answer = Answer.of("resp_1", ResponsesRequest(input="x"), "tiny", {}, ResponseStore(4), [])
        events = ResponseEvents(answer, None)
        stream = event_stream(sub, events.opening(), events.events, lambda: events.closing("stop", sub.usage()),
                              events.failed)
        return [e async for e in stream], engine, answer

    out, engine, answer = asyncio.run(main())
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in out]
    assert [p["type"] for p in payloads] == ["response.created", "response.in_progress", "response.output_item.added",
                                             "response.content_part.added", "response.output_text.delta", "error"]
    assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(out, payloads, strict=True))
    assert payloads[-1] == {"type": "error", "sequence_number": 5, "code": "500", "param": None,
                            "message": "internal error (request id resp_1): the server's log says what failed"}
    for p in payloads:
        ResponseStreamEvent.model_validate(p)
    assert engine.aborted == [] and len(answer.store) == 0   # the failed choice was its only one: nothing to abort


def test_openapi_declares_the_body_the_answer_and_the_events():
    doc = client_for().get("/openapi.json").json()
    post = doc["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"}
    assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    schemas = doc["components"]["schemas"]
    assert {"ResponsesRequest", "ResponsesResponse", "ResponseStreamEvent"} <= set(schemas)
    assert schemas["ResponsesRequest"]["additionalProperties"] is False
    assert schemas["ResponsesRequest"]["properties"]["truncation"]["enum"] == [None, "disabled"]
    get = doc["paths"]["/v1/responses/{response_id}"]["get"]
    assert get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesResponse")
