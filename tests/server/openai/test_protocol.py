"""protocol.py: what each request body accepts and refuses, in words naming the value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest


def message(model, **body) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()[0]["msg"]


@pytest.mark.parametrize(("field", "value", "words"), [
    ("temperature", 2.5, "temperature must be in [0, 2], got 2.5"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("presence_penalty", -2.5, "presence_penalty must be in [-2, 2], got -2.5"),
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 2], got 0.0"),
])
def test_a_value_outside_its_range_is_refused_naming_the_range(field, value, words):
    assert message(CompletionRequest, prompt="x", **{field: value}) == f"Value error, {words}"


@pytest.mark.parametrize(("field", "value"), [("temperature", 0.0), ("temperature", 2.0), ("top_p", 1.0),
                                              ("min_p", 0.0), ("presence_penalty", -2.0), ("repetition_penalty", 2.0)])
def test_the_ends_of_a_range_are_accepted_where_included(field, value):
    assert getattr(CompletionRequest(prompt="x", **{field: value}), field) == value


def test_a_single_stop_string_becomes_a_list_and_an_empty_one_is_refused():
    assert CompletionRequest(prompt="x", stop="!").stop == ["!"]
    assert message(CompletionRequest, prompt="x", stop=["a", ""]) == "Value error, stop strings must not be empty"


def test_an_empty_prompt_list_is_refused():
    assert message(CompletionRequest, prompt=[]) == "Value error, prompt must not be an empty list"


def test_completion_limits_name_the_value():
    assert "logprobs must be between 0 and 5, got 6" in message(CompletionRequest, prompt="x", logprobs=6)
    assert "max_tokens must be >= 0, got -1" in message(CompletionRequest, prompt="x", max_tokens=-1)
    assert "n must be at least 1, got 0" in message(CompletionRequest, prompt="x", n=0)
    assert "min_tokens must be >= 0, got -1" in message(CompletionRequest, prompt="x", min_tokens=-1)


def test_chat_wants_a_message_and_prefers_max_completion_tokens():
    assert "at least 1 item" in message(ChatCompletionRequest, messages=[])
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=3)
    assert req.output_limit == 3


def test_a_message_reads_its_text_parts_joined():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}])
    assert req.messages[0].text() == "ab"


def test_stream_usage_needs_stream_and_include_usage():
    assert CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}).stream_usage
    assert not CompletionRequest(prompt="x", stream_options={"include_usage": True}).stream_usage


def test_tokenize_wants_exactly_one_of_prompt_and_messages():
    assert "exactly one of prompt or messages" in message(TokenizeRequest)
