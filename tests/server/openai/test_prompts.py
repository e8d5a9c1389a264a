"""prompts.py: a completion prompt in each of its forms, chat messages through the template."""

from __future__ import annotations

import pytest

from server.openai.errors import APIError
from server.openai.prompts import chat_prompt, completion_prompts
from server.openai.protocol import ChatMessage
from tests.server.openai.conftest import CharTokenizer, ids_of

TOK = CharTokenizer()


def test_a_string_is_one_prompt_encoded_without_special_tokens():
    assert completion_prompts(TOK, "ab") == [ids_of("ab")]


def test_a_list_of_strings_is_one_prompt_each():
    assert completion_prompts(TOK, ["ab", "c"]) == [ids_of("ab"), ids_of("c")]


def test_a_list_of_token_ids_is_one_prompt_as_given():
    assert completion_prompts(TOK, [5, 0, 7]) == [[5, 0, 7]]


def test_a_list_of_token_id_lists_is_one_prompt_each():
    assert completion_prompts(TOK, [[5], [6, 7]]) == [[5], [6, 7]]


def test_chat_messages_go_through_the_template_then_the_tokenizer():
    messages = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content=[
        {"type": "text", "text": "hi "}, {"type": "text", "text": "there"}])]
    assert chat_prompt(TOK, messages, True, None) == ids_of("system. be brief user. hi there assistant.")
    assert chat_prompt(TOK, messages, False, None) == ids_of("system. be brief user. hi there")


def test_a_template_that_cannot_render_is_a_400_naming_messages():
    with pytest.raises(APIError) as info:
        chat_prompt(TOK, [ChatMessage(role="user", content="hi")], True, {"enable_thinking": True})
    err = info.value
    assert (err.status, err.param) == (400, "messages")
    assert err.message == "the chat template could not render these messages: unknown template variables ['enable_thinking']"
