"""prompts.py: a completion prompt in each of its forms, chat messages through the template."""

from __future__ import annotations

import pytest

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.prompts import (
    chat_prompt,
    completion_prompts,
    template_variables,
    truncated,
)
from spyre_serve.server.openai.generation.protocol import ChatMessage
from tests.server.openai.fakes import CharTokenizer, ids_of

TOK = CharTokenizer()


def test_a_string_is_one_prompt_encoded_with_special_tokens_as_vllm_does():
    assert completion_prompts(TOK, "ab") == [[0, *ids_of("ab")]]
    assert completion_prompts(TOK, "ab", add_special_tokens=False) == [ids_of("ab")]


def test_a_list_of_strings_is_one_prompt_each():
    assert completion_prompts(TOK, ["ab", "c"], add_special_tokens=False) == [ids_of("ab"), ids_of("c")]
    assert completion_prompts(TOK, ["ab", "c"]) == [[0, *ids_of("ab")], [0, *ids_of("c")]]


def test_a_list_of_token_ids_is_one_prompt_as_given():
    assert completion_prompts(TOK, [5, 0, 7]) == [[5, 0, 7]]


def test_a_list_of_token_id_lists_is_one_prompt_each():
    assert completion_prompts(TOK, [[5], [6, 7]]) == [[5], [6, 7]]


def test_truncation_keeps_the_last_tokens_or_the_context():
    assert truncated([[1, 2, 3], [4]], 2, 10) == [[2, 3], [4]]
    assert truncated([[1, 2, 3]], -1, 2) == [[2, 3]]
    assert truncated([[1, 2, 3]], None, 2) == [[1, 2, 3]]
    err = refused(truncated, [[1]], 11, 10)
    assert (err.param, err.message) == ("truncate_prompt_tokens",
                                        "truncate_prompt_tokens (11) is over this model's context length (10)")


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


MESSAGES = [ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content=[{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}])]


def test_chat_messages_go_through_the_template_then_the_tokenizer_without_special_tokens():
    assert chat_prompt(TOK, MESSAGES, True, None) == ids_of("system. be brief user. hi there assistant.")
    assert chat_prompt(TOK, MESSAGES, False, None) == ids_of("system. be brief user. hi there")
    assert chat_prompt(TOK, MESSAGES, False, None, add_special_tokens=True) == [0, *ids_of(
        "system. be brief user. hi there")]


def test_a_variable_of_the_template_may_be_set():
    assert chat_prompt(TOK, MESSAGES[1:], False, {"greeting": "yo"}) == ids_of("yo user. hi there")


def test_a_chat_template_in_the_kwargs_is_refused():
    err = refused(chat_prompt, TOK, MESSAGES, True, {"chat_template": "{{ 7 * 7 }}"})
    assert err.param == "chat_template_kwargs"
    assert err.message.startswith("chat_template_kwargs may not carry a chat_template")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "raise_exception", "tokenize"])
def test_a_variable_the_server_sets_is_refused(key):
    err = refused(chat_prompt, TOK, MESSAGES, True, {key: 1})
    assert err.message == f"chat_template_kwargs may not set `{key}`: the server sets it"


def test_a_name_the_template_does_not_read_is_refused_listing_what_it_reads():
    err = refused(chat_prompt, TOK, MESSAGES, True, {"enable_thinking": True})
    assert (err.status, err.param) == (400, "chat_template_kwargs")
    assert err.message == ("chat_template_kwargs: `enable_thinking` is not a variable of this model's chat "
                           "template (its variables are fail, greeting)")


def test_the_variables_of_a_template_are_what_it_reads_without_setting():
    assert template_variables("{% set x = 1 %}{{ x }}{{ y }}{% for m in messages %}{{ m }}{% endfor %}") == \
        {"y", "messages"}
    assert template_variables("{% generation %}{{ a }}{% endgeneration %}") == {"a"}
    assert template_variables("{% if %}") is None


def test_the_templates_own_refusal_is_quoted():
    err = refused(chat_prompt, TOK, MESSAGES, True, {"fail": "roles must alternate"})
    assert (err.param, err.message) == ("messages", "the chat template could not render these messages: "
                                                    "roles must alternate")


class Broken(CharTokenizer):
    def apply_chat_template(self, convo, **kwargs) -> str:
        raise KeyError("internal detail")


def test_any_other_failure_of_the_template_is_a_400_without_its_text():
    err = refused(chat_prompt, Broken(), MESSAGES, True, None)
    assert (err.param, err.message) == ("messages", "the chat template could not render these messages")


def test_a_message_name_reaches_the_template():
    assert ChatMessage(role="user", content="x", name="ann").for_template() == {"role": "user", "content": "x",
                                                                                 "name": "ann"}
