"""protocol.py: what each request body accepts and refuses, in words naming the value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spyre_serve.server.openai.generation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)


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
    ("top_n_sigma", -2.0, "top_n_sigma must be in [-1, 1000], got -2.0"),
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
    assert "logprobs must be between 0 and 20, got 21" in message(CompletionRequest, prompt="x", logprobs=21)
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
    assert not CompletionRequest(prompt="x", stream=True).stream_usage


def test_tokenize_wants_exactly_one_of_prompt_and_messages():
    assert "exactly one of prompt or messages" in message(TokenizeRequest)


def refusal(model, **body) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = info.value.errors()[0]
    return err["loc"], err["msg"].removeprefix("Value error, ")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("suffix", " the end", "suffix (insertion) is not supported yet"),
])
def test_a_field_the_server_does_not_act_on_is_refused_by_name(field, value, words):
    loc, msg = refusal(CompletionRequest, prompt="x", **{field: value})
    assert loc == (field,) and msg.startswith(words)


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("logit_bias", {}),
    ("response_format", {"type": "json_object"}), ("guided_regex", "a+"), ("logit_bias", {"5": 10}),
    ("include_stop_str_in_output", False), ("skip_special_tokens", True), ("response_format", None),
])
def test_the_neutral_value_of_an_unsupported_field_is_what_leaving_it_out_means(field, value):
    ChatCompletionRequest(**CHAT, **{field: value})
    CompletionRequest(prompt="x", **{field: value})


CHAT = {"messages": [{"role": "user", "content": "x"}]}


def test_an_unknown_field_is_refused_not_ignored():
    loc, _ = refusal(CompletionRequest, prompt="x", temprature=0.5)
    assert loc == ("temprature",)
    loc, _ = refusal(ChatCompletionRequest, **CHAT, max_token=3)
    assert loc == ("max_token",)
    loc, _ = refusal(ChatCompletionRequest, messages=[{"role": "user", "content": "x", "reasoning": "y"}])
    assert loc == ("messages", 0, "reasoning")


def test_best_of_is_n_or_refused():
    assert CompletionRequest(prompt="x", n=2, best_of=2).best_of == 2
    loc, msg = refusal(CompletionRequest, prompt="x", n=2, best_of=1)
    assert loc == ("best_of",) and msg == "best_of must be at least n (2), got 1"
    loc, msg = refusal(CompletionRequest, prompt="x", n=1, best_of=3)
    assert loc == ("best_of",) and msg.startswith("best_of larger than n (3 > 1) is not supported")


def test_stream_options_need_stream():
    loc, msg = refusal(CompletionRequest, prompt="x", stream_options={"include_usage": True})
    assert loc == ("stream_options",) and msg == "stream_options are only for streams: set stream to true"
    loc, _ = refusal(ChatCompletionRequest, **CHAT, stream=False, stream_options={"include_usage": True})
    assert loc == ("stream_options",)


def test_add_special_tokens_defaults_as_vllms_true_for_completions_false_for_chat():
    assert CompletionRequest(prompt="x").add_special_tokens is True
    assert ChatCompletionRequest(**CHAT).add_special_tokens is False


def test_truncate_prompt_tokens_is_minus_one_or_positive():
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    loc, msg = refusal(CompletionRequest, prompt="x", truncate_prompt_tokens=0)
    assert msg == "truncate_prompt_tokens must be -1 (the context length) or at least 1, got 0"


def test_a_message_may_carry_a_name_tool_calls_and_a_tool_call_id_for_the_template():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x", "name": "ann"}])
    assert req.messages[0].name == "ann"
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    req = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [call]},
                                          {"role": "tool", "content": "4", "tool_call_id": "1"}])
    assistant, tool = (m.for_template() for m in req.messages)
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"a": 1}   # as templates read them
    assert tool == {"role": "tool", "content": "4", "tool_call_id": "1"}


def test_a_seed_must_fit_64_bits():
    assert CompletionRequest(prompt="x", seed=-(2**63)).seed == -(2**63)
    loc, msg = refusal(CompletionRequest, prompt="x", seed=2**63)
    assert loc == ("seed",) and msg == f"seed must be a 64-bit integer, got {2**63}"


def test_tokenize_takes_chat_template_kwargs_and_special_tokens_per_form():
    assert TokenizeRequest(prompt="x").add_special_tokens is None
    assert TokenizeRequest(**CHAT, chat_template_kwargs={"a": 1}).chat_template_kwargs == {"a": 1}
    loc, _ = refusal(TokenizeRequest, prompt="x", return_token_strs=True)
    assert loc == ("return_token_strs",)


def test_a_suffix_is_refused_as_not_supported():
    loc, msg = refusal(CompletionRequest, prompt="x", suffix="end")
    assert loc == ("suffix",) and msg.startswith("suffix (insertion) is not supported yet")
    assert CompletionRequest(prompt="x", suffix="").suffix == ""


@pytest.mark.parametrize(("options", "usage"), [
    ({"include_usage": True, "continuous_usage_stats": True}, "continuous"),
    ({"include_usage": True}, "final"),
    ({"continuous_usage_stats": True}, ""),            # vLLM's: only with include_usage
    ({}, ""),
])
def test_stream_options_say_what_usage_a_stream_reports(options, usage):
    assert CompletionRequest(prompt="x", stream=True, stream_options=options).stream_usage == usage


def test_a_value_in_range_that_leaves_it_as_a_32_bit_float_is_refused():
    assert message(CompletionRequest, prompt="x", top_p=1e-300) == \
        "Value error, top_p must be in (0, 1], got 1e-300 (0 as a 32-bit float)"
    assert "repetition_penalty" in message(CompletionRequest, prompt="x", repetition_penalty=5e-324)


def test_the_schema_of_a_field_not_acted_on_lists_its_neutral_values():
    props = CompletionRequest.model_json_schema()["properties"]
    assert props["suffix"]["enum"] == [None, ""]


def test_prompt_logprobs_are_0_to_5_and_not_for_a_stream_as_in_vllm():
    assert CompletionRequest(prompt="x", prompt_logprobs=5).prompt_logprobs == 5
    assert "prompt_logprobs must be between 0 and 20, got 21" in message(CompletionRequest, prompt="x",
                                                                         prompt_logprobs=21)
    assert "prompt_logprobs are not available when stream is true" in message(
        CompletionRequest, prompt="x", stream=True, prompt_logprobs=1)
    assert CompletionRequest(prompt="x", stream=True, prompt_logprobs=0).prompt_logprobs == 0


def test_the_fields_vllm_adds_are_taken_at_any_value():
    req = CompletionRequest(prompt="x", include_stop_str_in_output=True, skip_special_tokens=False)
    assert (req.include_stop_str_in_output, req.skip_special_tokens, req.repetition_penalty) == (True, False, None)
    assert ChatCompletionRequest(**CHAT, echo=True).echo


def test_an_integer_may_be_written_as_json_schema_allows_but_not_as_a_fraction_a_string_or_a_bool():
    assert CompletionRequest(prompt=[1.0, 2], n=2.0, max_tokens=3.0).model_dump(include={"prompt", "n", "max_tokens"}) \
        == {"prompt": [1, 2], "n": 2, "max_tokens": 3}
    for value in (2.5, "2", True):
        assert "valid integer" in message(CompletionRequest, prompt="x", n=value)
