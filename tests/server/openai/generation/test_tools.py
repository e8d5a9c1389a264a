"""server/openai/generation/tools.py: tools and tool_choice checked, Granite's calls parsed (whole and
streamed, in vLLM's delta shapes), the forced choices' schemas, and the template's tools."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.prompts import chat_prompt
from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest
from spyre_serve.server.openai.generation.tools import (
    ToolRequest,
    complete_items,
    parse_call_list,
    parse_tagged_calls,
    tool_choices,
)

TEMPLATE = Path(__file__).resolve().parents[4] / "examples" / "tool_chat_template_granite.jinja"
F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}
MSG = [{"role": "user", "content": "hi"}]


def tools_of(**body):
    return ToolRequest.of(ChatCompletionRequest(messages=MSG, **body))


def test_tool_choice_defaults_to_auto_with_tools_and_names_must_exist():
    assert tools_of() is None and tools_of(tools=[F]).choice == "auto"
    assert tools_of(tools=[F], tool_choice={"type": "function", "function": {"name": "f"}}).named == "f"
    for body, param in [({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
                        ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": [F, F]}, "tools"),
                        ({"tools": [{"type": "retrieval"}]}, "tools")]:
        with pytest.raises(APIError) as info:
            tools_of(**body)
        assert info.value.param == param, body
    bad_schema = tools_of(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}])
    with pytest.raises(APIError, match=r"tools\[0\].function.parameters is not a valid JSON schema") as info:
        bad_schema.check_schemas()          # off the event loop: the chat endpoint's worker thread
    assert info.value.param == "tools"


@pytest.mark.parametrize("text", ['<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]',
                                  ' <tool_call> [{"name": "f", "arguments": {"x": 1}}]',
                                  '[{"name": "f", "arguments": {"x": 1}}]'])
def test_granite_calls_are_parsed_with_or_without_the_marker(text):
    assert parse_call_list(text, "arguments") == [("f", '{"x": 1}')]
    calls, content = tools_of(tools=[F]).parse(text)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"


@pytest.mark.parametrize("text", ["Hello there", "[not json", '{"name": "f"}', '[1, 2]'])
def test_text_that_is_no_call_list_stays_content(text):
    assert tools_of(tools=[F]).parse(text) == ([], text)


def test_none_never_parses_and_named_is_the_arguments():
    assert tools_of(tools=[F], tool_choice="none").parse('[{"name": "f", "arguments": {}}]')[0] == []
    calls, _ = tools_of(tools=[F], tool_choice={"type": "function", "function": {"name": "f"}}).parse('{"x": 2}')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 2}'}


def test_required_builds_vllms_schema_of_a_list_of_calls():
    schema = json.loads(tools_of(tools=[F, G], tool_choice="required").grammar_spec().source)
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {}}], schema)
    assert tools_of(tools=[F]).grammar_spec() is None
    calls, _ = tools_of(tools=[F, G], tool_choice="required").parse('[{"name": "g", "parameters": {"y": "z"}}]')
    assert calls[0]["function"] == {"name": "g", "arguments": '{"y": "z"}'}


def test_complete_items_skips_brackets_inside_strings():
    assert complete_items('[{"a": "}]"}, {"b": 1') == (['{"a": "}]"}'], False)
    assert complete_items('[{"a": 1}]') == (['{"a": 1}'], True)


def stream(tools, pieces):
    """Run tool_choices' streamed choice over text pieces, the last one finishing with "stop"."""
    def plain(texts, k, idx, u):
        return {"index": idx, "delta": {"content": u.text}, "finish_reason": u.finish_reason}

    _, streamed = tool_choices(tools, None, plain)
    return [streamed(None, None, 0, SimpleNamespace(text=p, finish_reason="stop" if i == len(pieces) - 1 else None))
            for i, p in enumerate(pieces)]


def test_a_streamed_call_list_is_sent_call_by_call_in_vllms_delta_shape():
    text = '<|tool_call|>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    chunks = stream(tools_of(tools=[F, G]), [text[i:i + 7] for i in range(0, len(text), 7)])
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [(0, "f", '{"x": 1}'), (1, "g", "{}")]
    assert all(d["id"] and d["type"] == "function" for d in deltas)
    assert not any(c["delta"].get("content") for c in chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_streamed_text_stays_content_and_a_named_call_streams_its_arguments():
    chunks = stream(tools_of(tools=[F]), [" ", "Hel", "lo"])
    assert "".join(c["delta"].get("content", "") for c in chunks) == " Hello"
    assert chunks[-1]["finish_reason"] == "stop"
    chunks = stream(tools_of(tools=[F], tool_choice={"type": "function", "function": {"name": "f"}}),
                    ['{"x"', ": 4", "}"])
    deltas = [d for c in chunks for d in c["delta"]["tool_calls"]]
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "f"
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"x": 4}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_the_template_gets_the_tools_and_the_calls_of_the_conversation():
    from spyre_serve.models import resolve_model
    from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
    from spyre_serve.server.openai.generation.prompts import with_chat_template

    tokenizer = with_chat_template(load_tokenizer(resolve_model("granite-tiny")), str(TEMPLATE))
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "x?"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "42"}], tools=[F])
    text = tokenizer.decode(chat_prompt(tokenizer, req.messages, True, None, False, req.tools))
    assert "<|start_of_role|>available_tools<|end_of_role|>" in text and '"name": "f"' in text
    assert '<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]' in text
    assert "<|start_of_role|>tool_response<|end_of_role|>42" in text


def test_parallel_tool_calls_false_allows_one_call():
    tools = tools_of(tools=[F, G], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(tools.grammar_spec().source)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}, {"name": "g", "parameters": {}}], schema)
    text = '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    calls, _ = tools_of(tools=[F, G], parallel_tool_calls=False).parse(text)
    assert [c["function"]["name"] for c in calls] == ["f"]
    chunks = stream(tools_of(tools=[F, G], parallel_tool_calls=False), [text[:20], text[20:]])
    assert [d["function"]["name"] for c in chunks for d in c["delta"].get("tool_calls", [])] == ["f"]


def test_a_streamed_list_of_calls_is_read_once_however_many_deltas_it_comes_in():
    """Each delta costs its own length (the list's scanner keeps its place), not the reply's:
    a 60,000-character reply fed one character at a time reads as the same calls as fed whole,
    in well under the time a rescan per delta would take (~1.8e9 character steps)."""
    import time

    calls = [{"name": "f", "arguments": {"x": "y" * 100, "i": i}} for i in range(500)]
    text = "<|tool_call|>" + json.dumps(calls)
    whole = tools_of(tools=[F]).stream()
    _, want = whole.feed(text, final=True)
    stream = tools_of(tools=[F]).stream()
    got = []
    t0 = time.perf_counter()
    for ch in text:
        got += stream.feed(ch)[1]
    got += stream.feed("", final=True)[1]
    assert time.perf_counter() - t0 < 5
    assert len(got) == len(want) == 500 and [c["function"] for c in got] == [c["function"] for c in want]
    assert json.loads(got[7]["function"]["arguments"])["i"] == 7


# Granite 4.0 writes each call in its own block (vLLM serves it with its hermes parser)
GRANITE_4 = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def test_granite_4_calls_are_parsed_one_block_each():
    assert parse_tagged_calls(GRANITE_4) == [("f", '{"x": 1}'), ("g", "{}")]
    calls, content = tools_of(tools=[F, G]).parse(GRANITE_4)
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    # a reply cut inside its last block's closing tag still gives the calls it holds
    assert parse_tagged_calls('<tool_call>{"name": "f", "arguments": {"x": 2}}') == [("f", '{"x": 2}')]
    calls, _ = tools_of(tools=[F, G], parallel_tool_calls=False).parse(GRANITE_4)
    assert [c["function"]["name"] for c in calls] == ["f"]


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {}</tool_call>',       # bad JSON
                                  '<tool_call>{"arguments": {}}</tool_call>',                   # no name
                                  '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then',
                                  'First <tool_call>{"name": "f", "arguments": {}}</tool_call>'])
def test_text_that_is_not_only_granite_4_blocks_stays_content(text):
    assert tools_of(tools=[F]).parse(text) == ([], text)


def test_granite_4_calls_stream_one_by_one_as_each_block_closes():
    chunks = stream(tools_of(tools=[F, G]), [GRANITE_4[i:i + 5] for i in range(0, len(GRANITE_4), 5)])
    deltas = [(c, d) for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for _, d in deltas] == \
        [(0, "f", '{"x": 1}'), (1, "g", "{}")]
    first_chunk = next(i for i, c in enumerate(chunks) if c["delta"].get("tool_calls"))
    assert "</tool_call>" in "".join(GRANITE_4[i:i + 5] for i in range(0, 5 * (first_chunk + 1), 5))
    assert not any(c["delta"].get("content") for c in chunks) and chunks[-1]["finish_reason"] == "tool_calls"
    # a block left open at the end is read then; one that never parses is sent as content
    chunks = stream(tools_of(tools=[F]), ['<tool_call>{"name": "f", ', '"arguments": {"x": 3}}'])
    assert chunks[-1]["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 3}'}
    chunks = stream(tools_of(tools=[F]), ["<tool_call>{", "nope"])
    assert "".join(c["delta"].get("content", "") for c in chunks) == "<tool_call>{nope"
