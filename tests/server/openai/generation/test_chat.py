"""chat.py: /v1/chat/completions over an engine that answers "ok." at once."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.app import create_app
from spyre_serve.server.openai.generation.chat import opening_choices, streamed_choice
from spyre_serve.server.openai.generation.logprobs import TokenTexts
from tests.server.openai.fakes import (
    CharTokenizer,
    ScriptedEngine,
    client_for,
    fake_model,
    ids_of,
)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(reply="ok.")


def chat(engine, status=200, **body):
    r = client_for(engine).post("/v1/chat/completions", json={"messages": HI, **body})
    assert r.status_code == status, r.text
    return r.json()


def test_a_chat_answer_is_an_assistant_message_in_vllms_envelope(engine):
    body = chat(engine)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ok.", "tool_calls": []},
                                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    assert body["usage"]["prompt_tokens"] == len(ids_of("user. hi assistant."))


def test_the_messages_reach_the_engine_through_the_chat_template(engine):
    chat(engine, add_generation_prompt=False)
    assert engine.added[0][1] == ids_of("user. hi")


def test_without_a_limit_the_answer_may_fill_the_context(engine):
    chat(engine)
    assert engine.added[0][2][0].max_tokens == 64 - len(ids_of("user. hi assistant."))


def test_top_logprobs_without_logprobs_is_a_400(engine):
    assert chat(engine, 400, top_logprobs=2)["error"]["param"] == "top_logprobs"


def test_a_limit_over_the_context_is_a_400_naming_the_field_given(engine):
    assert chat(engine, 400, max_completion_tokens=100)["error"]["param"] == "max_completion_tokens"
    assert chat(engine, 400, max_tokens=100)["error"]["param"] == "max_tokens"


def test_logprobs_give_each_token_with_top_logprobs_alternatives(engine):
    content = chat(engine, logprobs=True, top_logprobs=1)["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["o", "k", "."]
    assert content[0]["top_logprobs"] == [{"token": "p", "logprob": -1.0, "bytes": [ord("p")]}]


def test_logprobs_without_top_logprobs_list_no_alternatives(engine):
    content = chat(engine, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert all(t["top_logprobs"] == [] for t in content)


def test_a_stream_opens_with_the_role_then_sends_deltas_then_done(engine):
    r = client_for(engine).post("/v1/chat/completions", json={"messages": HI, "stream": True, "n": 2})
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    text = {0: "", 1: ""}
    for c in chunks[2:]:
        text[c["choices"][0]["index"]] += c["choices"][0]["delta"]["content"]
    assert text == {0: "ok.", 1: "ok."}


def test_the_opening_chunks_name_the_role_for_every_choice():
    assert [c["index"] for c in opening_choices(3)] == [0, 1, 2]
    assert opening_choices(1)[0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}


def test_a_finish_without_text_is_an_empty_delta_with_the_stop_reason():
    u = SeqUpdate(index=0, text="", token_ids=[], logprobs=[], finish_reason="stop", stop_reason=0)
    assert streamed_choice(TokenTexts(CharTokenizer()), None, 1, u) == {
        "index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": 0}


def test_a_running_chunk_has_no_stop_reason():
    u = SeqUpdate(index=0, text="", token_ids=[], logprobs=[])
    assert streamed_choice(TokenTexts(CharTokenizer()), None, 0, u) == {
        "index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}


def test_a_chat_template_sent_in_the_kwargs_is_a_400(engine):
    err = chat(engine, 400, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"})["error"]
    assert err["param"] == "chat_template_kwargs" and "may not carry a chat_template" in err["message"]
    assert engine.added == []


def test_a_variable_of_the_template_reaches_it(engine):
    chat(engine, chat_template_kwargs={"greeting": "yo"})
    assert engine.added[0][1] == ids_of("yo user. hi assistant.")


def test_add_special_tokens_puts_the_tokenizers_in_front_of_the_rendered_chat(engine):
    chat(engine, add_special_tokens=True)
    assert engine.added[0][1] == [0, *ids_of("user. hi assistant.")]


class Spinning(CharTokenizer):
    """A template that never finishes rendering (pure Python, as Jinja renders)."""

    def apply_chat_template(self, convo, **kwargs) -> str:
        while True:
            pass


def test_a_template_rendering_longer_than_the_bound_is_a_400_naming_the_flag(engine):
    model = fake_model()
    model.tokenizer = Spinning()
    client = TestClient(create_app(engine, model, Settings(render_timeout=0.3)))
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 400 and time.monotonic() - t0 < 5
    assert r.json()["error"] == {"message": "rendering the chat template for these messages took longer than 0.3 s "
                                            "(--render-timeout)", "type": "BadRequestError", "param": "messages",
                                 "code": 400}
    assert engine.added == []


def test_the_chat_template_flag_replaces_the_tokenizers(engine, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ greeting }}{{ messages }}")
    for value in [str(template), "{{ greeting }}{{ messages }}"]:
        app = create_app(engine, fake_model(), Settings(chat_template=value))
        assert app.state.serving.tokenizer.chat_template == "{{ greeting }}{{ messages }}"
    assert fake_model().tokenizer.chat_template != "{{ greeting }}{{ messages }}"


GRANITE_4_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Boston"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]


def test_granite_4_tool_calls_come_back_as_openais_tool_calls_whole_and_streamed():
    engine = ScriptedEngine(reply=GRANITE_4_CALLS, max_model_len=1024)
    body = chat(engine, tools=WEATHER_TOOLS, max_tokens=len(GRANITE_4_CALLS) + 1)
    message = body["choices"][0]["message"]
    # (the scripted engine ends every reply at its length: a reply cut so keeps "length")
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "length"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Boston"}), ("get_time", {})]
    r = client_for(engine).post("/v1/chat/completions", json={"messages": HI, "tools": WEATHER_TOOLS, "stream": True,
                                                              "max_tokens": len(GRANITE_4_CALLS) + 1})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_weather"), (1, "get_time")]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
