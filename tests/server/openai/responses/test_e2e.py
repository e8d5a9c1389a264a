"""The Responses API (/v1/responses) on the real stack (granite-tiny: greedy output is
gibberish but deterministic), through the official openai client; every body and event is
checked against the openai package's types and against the server's own declarations
(``responses.py``, which refuse a field they do not declare)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from spyre_serve.server.openai.generation.response_bodies import ResponsesResponse
from spyre_serve.server.openai.generation.response_bodies import (
    ResponseStreamEvent as DeclaredEvent,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
USER = {"type": "object", "additionalProperties": False, "required": ["name", "role"],
        "properties": {"name": {"type": "string", "maxLength": 8}, "role": {"enum": ["admin", "guest"]}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}


@pytest.fixture(scope="module")
def oai(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(client):
    return client.get("/v1/models").json()["data"][0]["id"]


def checked(r) -> Response:
    """``r`` (the client's Response) after its JSON passes both declarations."""
    body = r.to_dict()
    ResponsesResponse.model_validate(body)
    Response.model_validate(body)
    return r


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    body = {"messages": messages, "max_completion_tokens": max_tokens, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def count(client, messages: list[dict]) -> int:
    return client.post("/tokenize", json={"messages": messages}).json()["count"]


def test_a_string_input_is_the_chats_user_message_and_a_length_cut_is_incomplete(oai, client, model):
    r = checked(oai.responses.create(model=model, input="Say hello.", max_output_tokens=6, temperature=0))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    [item] = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "incomplete",
                                                                         "output_text")
    text, usage = chat_text(client, [{"role": "user", "content": "Say hello."}], 6)
    assert r.output_text == text and len(set(text)) > 3
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (usage["prompt_tokens"], 6, usage["prompt_tokens"] + 6)
    assert (r.max_output_tokens, r.temperature, r.store, r.previous_response_id) == (6, 0, True, None)
    assert oai.responses.retrieve(r.id).to_dict() == r.to_dict()


def test_items_and_instructions_are_the_chats_messages(oai, client, model):
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                            {"type": "input_text", "text": " in Oslo?"}]},
             {"role": "assistant", "content": "Let me look."}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "12 degrees"}]
    r = checked(oai.responses.create(model=model, input=items, instructions="Be brief.", max_output_tokens=5,
                                     temperature=0))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 degrees"}]
    text, usage = chat_text(client, messages, 5)
    assert r.output_text == text and r.usage.input_tokens == usage["prompt_tokens"] == count(client, messages)
    assert r.instructions == "Be brief."


def test_a_stream_sends_openais_events_in_order_ending_with_the_stored_response(oai, client, model):
    kw = dict(model=model, input="Tell me a story.", max_output_tokens=8, temperature=0, metadata={"k": "v"})
    with oai.responses.create(stream=True, **kw) as stream:
        events = list(stream)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert len(deltas) > 1 and "".join(deltas) == events[-4].text == final.output_text
    assert final.to_dict() == oai.responses.retrieve(final.id).to_dict() == checked(final).to_dict()
    whole = oai.responses.create(**kw)
    assert whole.output_text == final.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (final.usage.input_tokens,
                                                                     final.usage.output_tokens)
    assert final.metadata == {"k": "v"} and final.status == "incomplete"
    # the raw events: `event: <type>` lines, each event both declarations' shape
    with client.stream("POST", "/v1/responses", json={**kw, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        DeclaredEvent.model_validate(event)
        EVENTS.validate_python(event)


def test_text_format_json_schema_gives_json_matching_the_schema(oai, model):
    fmt = {"type": "json_schema", "name": "user", "schema": USER, "strict": True}
    r = checked(oai.responses.create(model=model, input="Invent a user.", max_output_tokens=60, temperature=0,
                                     text={"format": fmt}))
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), USER)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_tool_call_is_a_function_call_item_whose_arguments_parse(oai, model, choice):
    kw = dict(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=80,
              temperature=0)
    r = checked(oai.responses.create(**kw))
    assert r.status == "completed" and r.output and all(item.type == "function_call" for item in r.output)
    for item in r.output:
        assert item.name == "get_weather" and item.call_id.startswith("call_")
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather"
    assert (r.tool_choice if isinstance(choice, str) else r.tool_choice.to_dict()) == choice
    with oai.responses.create(stream=True, **kw) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [item.arguments for item in r.output]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == "".join(e.arguments for e in done)
    assert [i.type for i in events[-1].response.output] == ["function_call"] * len(r.output)


def test_previous_response_id_goes_on_from_its_conversation(oai, client, model):
    first = checked(oai.responses.create(model=model, input="Hi.", instructions="Be brief.", max_output_tokens=4,
                                         temperature=0))
    second = checked(oai.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                          max_output_tokens=4, temperature=0))
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And then?"}]
    # the previous turns are in the prompt, its instructions are not (OpenAI's rule)
    assert second.usage.input_tokens == count(client, turns) > first.usage.input_tokens + 4
    assert second.previous_response_id == first.id and second.instructions is None
    third = oai.responses.create(model=model, input="More.", previous_response_id=second.id, max_output_tokens=2,
                                 temperature=0)
    turns += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More."}]
    assert third.usage.input_tokens == count(client, turns)


def test_an_unknown_or_unstored_response_is_a_404_naming_it(oai, model):
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model=model, input="Hi.", previous_response_id="resp_nope", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id" and "resp_nope" in info.value.body["message"]
    unstored = oai.responses.create(model=model, input="Hi.", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.retrieve(unstored.id)
    assert info.value.body["param"] == "response_id" and info.value.body["code"] == 404


@pytest.mark.parametrize(("kw", "param"), [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"temperature": 3}, "temperature"),
])
def test_a_field_not_served_is_a_400_naming_it(oai, model, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=model, input="Hi.", max_output_tokens=2, **kw)
    assert info.value.body["param"] == param, info.value.body


def test_bad_input_is_a_400_and_the_server_serves_the_next_request(oai, client, model):
    for bad in (5, [], [{"type": "reasoning", "summary": []}],
                [{"role": "user", "content": [{"type": "input_image"}]}]):
        r = client.post("/v1/responses", json={"input": bad, "max_output_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert client.get("/v1/responses/resp_x", params={"stream": "true"}).json()["error"]["param"] == "stream"
    assert oai.responses.create(model=model, input="Hi.", max_output_tokens=2).status == "incomplete"


def test_vllms_extra_fields_act_as_on_a_chat(oai, client, model):
    """stop, ignore_eos, top_k, seed (guidellm sends stop: null and ignore_eos on each request):
    the response's text is the chat's with the same fields."""
    extra = {"ignore_eos": True, "stop": None, "top_k": 5, "seed": 11}
    r = checked(oai.responses.create(model=model, input="Count.", max_output_tokens=8, temperature=0.7,
                                     extra_body=extra))
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Count."}],
                                                     "max_completion_tokens": 8, "temperature": 0.7, **extra})
    assert r.output_text == chat.json()["choices"][0]["message"]["content"] and r.usage.output_tokens == 8
    stop = r.output_text[3:6]
    cut = checked(oai.responses.create(model=model, input="Count.", max_output_tokens=8, temperature=0.7,
                                       extra_body={**extra, "stop": [stop]}))
    assert cut.status == "completed" and cut.output_text == r.output_text[:r.output_text.index(stop)]
    with pytest.raises(openai.BadRequestError, match="priority"):
        oai.responses.create(model=model, input="x", extra_body={"priority": 3})
