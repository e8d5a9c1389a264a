"""tokenization.py: /tokenize and /detokenize with the served tokenizer."""

from __future__ import annotations

import pytest

from tests.server.openai.fakes import VOCAB, client_for, ids_of


@pytest.fixture(scope="module")
def client():
    return client_for()


def test_tokenize_counts_the_prompts_tokens_with_special_tokens_by_default(client):
    r = client.post("/tokenize", json={"prompt": "ab"}).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": [0, *ids_of("ab")]}


def test_tokenize_can_leave_special_tokens_out(client):
    assert client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()["tokens"] == ids_of("ab")


def test_tokenize_renders_messages_with_the_chat_template(client):
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["tokens"] == ids_of("user. hi assistant.")


def test_tokenize_wants_exactly_one_of_prompt_and_messages(client):
    r = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "exactly one of prompt or messages" in r.json()["error"]["message"]


def test_detokenize_keeps_special_tokens(client):
    assert client.post("/detokenize", json={"tokens": [0, *ids_of("ab")]}).json() == {"prompt": "<eos>ab"}


def test_detokenize_refuses_an_id_outside_the_vocabulary(client):
    r = client.post("/detokenize", json={"tokens": [1, VOCAB]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_tokenize_counts_messages_as_the_chat_endpoint_sends_them(client):
    messages = [{"role": "user", "content": "hi"}]
    assert client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"] == [
        0, *ids_of("user. hi assistant.")]
    r = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"greeting": "yo"}}).json()
    assert r["tokens"] == ids_of("yo user. hi assistant.")


def test_tokenize_refuses_template_kwargs_the_template_does_not_read(client):
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                       "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
