"""No parameter is silently dropped, on a real server: each one the server knows and does not act
on yet is a 400 naming it, and accepted at its neutral value (what leaving it out means); a field
it does not know at all is ignored and named in a warning line, as vLLM does (vllm-router adds
SGLang's fields to every body it forwards), or refused with --strict-request-fields
(tests/server/openai/test_e2e_errors.py); a normal request beside the refused ones gives its solo
text."""

from __future__ import annotations

import asyncio
import logging

import pytest

from spyre_serve.server.openai.generation.protocol import UNSUPPORTED
from tests.reliability.servers import beside

# a value each field is refused with, and where it goes in the body
REFUSED = {
    "suffix": " and then",
    "best_of": 3,
    "continue_final_message": True,
    "no_stop_trim": True,
    "return_hidden_states": True,
}
CHAT_ONLY, COMPLETION_ONLY = {"continue_final_message"}, {"suffix"}
# what vllm-router 0.1.17 adds to a chat it forwards (SGLang's fields, and vLLM's at their defaults)
ROUTER_CHAT_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False, "include_reasoning": True}
NESTED: set[str] = set()  # nested fields not acted on (a message's, stream_options')


def body_for(path: str, field: str, value) -> dict:
    base = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    return {**base, "max_tokens": 2, field: value}


def test_every_unsupported_field_is_covered_here():
    assert set(UNSUPPORTED) - NESTED <= set(REFUSED)


# every field on the endpoints that have it
CASES = [(path, field) for path in ("/v1/completions", "/v1/chat/completions") for field in sorted(REFUSED)
         if field not in (CHAT_ONLY if path == "/v1/completions" else COMPLETION_ONLY)]


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


def test_the_fields_a_router_adds_at_their_defaults_pass_without_a_warning(http, caplog):
    body = {**body_for("/v1/chat/completions", "max_tokens", 2), **ROUTER_CHAT_FIELDS}
    with caplog.at_level(logging.WARNING, logger="spyre_serve.api"):
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert not [rec for rec in caplog.records if "ignored fields" in rec.getMessage()]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_nobody_knows_is_ignored_and_named_in_a_warning(http, caplog, path):
    body = body_for(path, "temprature", 0.5)   # a typo
    if path == "/v1/chat/completions":       # and one inside a message
        body["messages"] = [{"role": "user", "content": "Hi", "reasoning_content": "y"}]
    with caplog.at_level(logging.WARNING, logger="spyre_serve.api"):
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    [line] = [rec.getMessage() for rec in caplog.records if "ignored fields" in rec.getMessage()]
    assert path in line and '"temprature"' in line
    assert ('"reasoning_content"' in line) == (path == "/v1/chat/completions")


def test_a_body_of_many_unknown_fields_names_ten_in_one_line(http, caplog):
    body = {**body_for("/v1/completions", "max_tokens", 1), **{f"made_up_{i}": i for i in range(5000)}}
    with caplog.at_level(logging.WARNING, logger="spyre_serve.api"):
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    [line] = [rec.getMessage() for rec in caplog.records if "ignored fields" in rec.getMessage()]
    assert line.endswith("and 4990 more") and len(line) < 400


def test_stream_options_without_stream_is_a_400(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_a_normal_request_beside_the_refused_ones_gives_its_solo_text(server, solo):
    async def refused(client):
        sent = [client.post(path, json=body_for(path, field, REFUSED[field])) for path, field in CASES]
        return await asyncio.gather(*sent)

    text, responses = beside(server, refused)
    assert text == solo and {r.status_code for r in responses} == {400}
