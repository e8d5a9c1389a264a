"""body.py: a body read within the limit, parsed as a JSON object, validated."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from spyre_serve.server.openai.body import json_object, read_request
from spyre_serve.server.openai.errors import APIError, install_error_handlers
from spyre_serve.server.openai.generation.protocol import DetokenizeRequest

LIMIT = 64


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/detokenize")
    async def echo_tokens(request: Request):
        return {"tokens": (await read_request(request, DetokenizeRequest, LIMIT)).tokens}

    return TestClient(app)


def test_a_valid_body_becomes_the_model(client):
    r = client.post("/detokenize", json={"tokens": [1, 2, 3]})
    assert r.status_code == 200 and r.json() == {"tokens": [1, 2, 3]}


def test_a_declared_length_over_the_limit_is_a_413_naming_both(client):
    r = client.post("/detokenize", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"request body is {LIMIT + 1} bytes, over the limit of {LIMIT} bytes"


def test_a_body_sent_without_a_length_is_cut_off_at_the_limit(client):
    def chunks():
        for _ in range(10):
            yield b"[1, 2, 3, 4, 5, 6, 7, 8, 9]"

    r = client.post("/detokenize", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["message"] == f"request body is over the limit of {LIMIT} bytes"


def test_a_validation_failure_is_a_400_naming_the_field(client):
    r = client.post("/detokenize", json={"tokens": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_json_object_reads_an_object():
    assert json_object(b'{"a": [1]}') == {"a": [1]}


def test_json_object_refuses_text_that_is_not_json():
    with pytest.raises(APIError, match="request body is not valid JSON: Expecting property name") as info:
        json_object(b"{not json")
    assert info.value.status == 400


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_json_object_refuses_json_that_is_not_an_object(body):
    with pytest.raises(APIError, match="request body must be a JSON object") as info:
        json_object(body)
    assert info.value.status == 400


@pytest.mark.parametrize(("body", "words"), [
    (b'{"prompt": "caf\xe9"}', "request body is not valid UTF-8: byte 0xe9 at position 15"),
    (b"[" * 100_000, "request body nests deeper than 32 levels"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, "request body nests deeper than 32 levels"),
    (b'{"temperature": NaN}', "request body is not valid JSON: NaN is not a JSON number"),
    (b'{"temperature": Infinity}', "request body is not valid JSON: Infinity is not a JSON number"),
    (b'{"temperature": -Infinity}', "request body is not valid JSON: -Infinity is not a JSON number"),
    (b'{"temperature": 1e400}', "request body holds the number 1e400, outside what a 64-bit float holds"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "request body holds a number over 4300 digits long"),
    (b"", "request body is empty: send a JSON object"),
    (b"  \n", "request body is empty: send a JSON object"),
])
def test_a_malformed_body_is_a_400_in_the_users_words(body, words):
    with pytest.raises(APIError) as info:
        json_object(body)
    assert (info.value.status, info.value.message) == (400, words)


def test_the_json_syntax_error_says_where_without_the_exceptions_name():
    with pytest.raises(APIError) as info:
        json_object(b'{"a": 1,}')
    assert info.value.message == "request body is not valid JSON: Expecting property name enclosed in double " \
                                 "quotes at line 1 column 9"


def test_nesting_up_to_the_limit_is_read():
    deep = b'{"a": ' * 31 + b"1" + b"}" * 31
    assert json_object(deep)["a"]["a"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1"])
def test_a_body_that_is_not_declared_json_is_a_400_naming_its_type(client, content_type):
    r = client.post("/detokenize", content=b'{"tokens": [1]}', headers={"content-type": content_type})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "request body must be JSON (Content-Type: application/json, in UTF-8), got ")
    assert content_type in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "application/vnd.api+json", "APPLICATION/JSON"])
def test_json_content_types_and_none_are_read(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/detokenize", content=b'{"tokens": [1]}', headers=headers)
    assert r.status_code == 200, r.text


def _depth(value) -> int:
    """The reference: how deep arrays and objects nest, by recursion on the parsed value."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_nesting_depth_of_the_text_is_the_parsed_values_depth():
    import json
    import random

    from spyre_serve.server.openai.body import nesting_depth

    rng = random.Random(0)
    tricky = ['[', ']', '{"', '\\\\', '\\"]', '"}', 'plain', '\\u005b']

    def make(level: int):
        kind = rng.random()
        if level > 6 or kind < 0.3:
            return rng.choice(tricky + [1, 2.5, None, True])
        if kind < 0.65:
            return [make(level + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(tricky) + str(i): make(level + 1) for i in range(rng.randint(0, 3))}

    for _ in range(500):
        value = {"v": make(0)}
        assert nesting_depth(json.dumps(value)) == _depth(value), value


def test_a_body_of_escaped_quotes_without_an_end_is_answered_at_once_beside_health():
    """Issue 38, finding 1: the strings of a body were cut out by a regular expression retried
    at every quote, so a body of many ``\\"`` pairs with no closing quote took time quadratic in
    its length on the event loop (40 KB: 10 s, /health held as long). 200 KB here would take
    minutes that way; a linear scan answers its 400 in milliseconds. The bounds are loose (a
    noisy 2-core machine), the failure they catch is a hundredfold."""
    import threading
    import time

    import httpx

    from spyre_serve.server.launch.settings import Settings
    from spyre_serve.server.openai.app import create_app
    from tests.server.openai.fakes import ScriptedEngine, fake_model
    from tests.server.servers import ServerThread

    body = b'{"prompt": "' + b'\\"' * 100_000
    answer: dict = {}
    with ServerThread(create_app(ScriptedEngine(), fake_model(), Settings())) as server, \
            httpx.Client(base_url=server.url, timeout=10) as client:
        def send():
            start = time.monotonic()
            try:
                answer["response"] = httpx.post(f"{server.url}/v1/completions", content=body, timeout=20,
                                                 headers={"content-type": "application/json"})
            except httpx.TimeoutException:
                pass
            answer["seconds"] = time.monotonic() - start

        sender = threading.Thread(target=send)
        sender.start()
        health = []
        while sender.is_alive():
            start = time.monotonic()
            try:
                status = client.get("/health").status_code
            except httpx.TimeoutException:
                status = None
            health.append((status, time.monotonic() - start))
            time.sleep(0.05)
        sender.join()
    assert "response" in answer, f"no answer in {answer['seconds']:.1f} s"
    r = answer["response"]
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "request body is not valid JSON: Unterminated string"), r.text
    assert answer["seconds"] < 10, answer
    assert all(status == 200 and seconds < 5 for status, seconds in health), health
