"""Every malformed body is a 400 in the OpenAI error shape, in the user's words (no exception's
name or text), and a normal request beside them gives its solo text; on a real server."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.reliability.servers import beside

JSON = {"content-type": "application/json"}
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
# (what, body bytes, headers, words the message starts with)
MALFORMED = [
    ("invalid UTF-8", b'{"prompt": "caf\xe9 \xff"}', JSON, "request body is not valid UTF-8"),
    ("100,000 nested arrays", b"[" * 100_000 + b"]" * 100_000, JSON, "request body nests deeper than 32 levels"),
    ("40 nested objects", b'{"a": ' * 40 + b"1" + b"}" * 40, JSON, "request body nests deeper than 32 levels"),
    ("text/plain", b'{"prompt": "x"}', {"content-type": "text/plain"}, "request body must be JSON"),
    ("a form", b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, "request body must be JSON"),
    ("empty", b"", JSON, "request body is empty"),
    ("an array", b"[1, 2]", JSON, "request body must be a JSON object"),
    ("null", b"null", JSON, "request body must be a JSON object"),
    ("a float past float64", b'{"temperature": 1e400}', JSON, "request body holds the number 1e400"),
    ("NaN", b'{"temperature": NaN}', JSON, "request body is not valid JSON: NaN"),
    ("Infinity", b'{"top_p": -Infinity}', JSON, "request body is not valid JSON: -Infinity"),
    ("a 5000-digit integer", b'{"seed": ' + b"7" * 5000 + b"}", JSON, "request body holds a number over"),
    ("cut short", b'{"prompt": "a', JSON, "request body is not valid JSON"),
    ("not JSON", b"\x00\x01\x02", JSON, "request body is not valid JSON"),
]
# what a message written from an exception would carry
LEAKS = re.compile(r"Traceback|Exception|[A-Z][a-z]+Error|\bline \d+, in\b")


def check_refusal(r, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["message"].startswith(words), err["message"]
    assert not LEAKS.search(err["message"]), err["message"]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(("what", "body", "headers", "words"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_body_is_a_400_in_the_users_words(http, path, what, body, headers, words):
    check_refusal(http.post(path, content=body, headers=headers), words)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_a_value_of_the_wrong_kind_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not LEAKS.search(r.json()["error"]["message"])


def test_an_unknown_route_and_a_wrong_method_answer_in_the_openai_shape(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_a_normal_request_beside_every_malformed_body_gives_its_solo_text(server, http, solo):
    async def malformed(client):
        sent = [client.post(path, content=body, headers=headers)
                for path in ENDPOINTS for _, body, headers, _ in MALFORMED]
        return await asyncio.gather(*sent)

    text, responses = beside(server, malformed)
    assert text == solo
    assert [r.status_code for r in responses] == [400] * len(responses)
    assert http.get("/health").status_code == 200
