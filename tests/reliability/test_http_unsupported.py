"""No parameter is silently dropped, on a real server: each one the server does not act on
yet, and any field it does not know, is a 400 naming it; at its neutral value (what leaving
it out means) it is accepted; a normal request beside the refused ones gives its solo text."""

from __future__ import annotations

import asyncio

import pytest

from spyre_serve.server.openai.generation.protocol import UNSUPPORTED
from tests.reliability.servers import beside

# a value each field is refused with, and where it goes in the body
REFUSED = {
    "suffix": " and then",
    "best_of": 3,
    "temprature": 0.5,  # a field nobody knows (a typo)
}
NESTED: set[str] = set()  # nested fields not acted on (a message's, stream_options')


def body_for(path: str, field: str, value) -> dict:
    base = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    return {**base, "max_tokens": 2, field: value}


def test_every_unsupported_field_is_covered_here():
    assert set(UNSUPPORTED) - NESTED <= set(REFUSED)


# every field on both endpoints (suffix is a completion's own)
CASES = [(path, field) for path in ("/v1/completions", "/v1/chat/completions") for field in sorted(REFUSED)
         if field != "suffix" or path == "/v1/completions"]


@pytest.mark.parametrize(("path", "field"), CASES)
def test_a_field_not_acted_on_is_a_400_naming_it(http, path, field):
    r = http.post(path, json=body_for(path, field, REFUSED[field]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("logit_bias", {}),
    ("include_stop_str_in_output", False), ("skip_special_tokens", True), ("best_of", 1), ("user", "ann"),
])
def test_a_neutral_value_is_accepted(http, field, value):
    r = http.post("/v1/chat/completions", json=body_for("/v1/chat/completions", field, value))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("message", "field"), [
    ({"role": "user", "content": "x", "reasoning_content": "y"}, "reasoning_content"),
])
def test_a_message_field_not_acted_on_is_a_400(http, message, field):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}, message]})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_stream_options_without_stream_is_a_400(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_a_normal_request_beside_the_refused_ones_gives_its_solo_text(server, solo):
    async def refused(client):
        sent = [client.post(path, json=body_for(path, field, REFUSED[field])) for path, field in CASES]
        return await asyncio.gather(*sent)

    text, responses = beside(server, refused)
    assert text == solo and {r.status_code for r in responses} == {400}
