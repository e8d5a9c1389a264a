"""body.py: a body read within the limit, parsed as a JSON object, validated."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from server.openai.body import json_object, read_request
from server.openai.errors import APIError, install_error_handlers
from server.openai.protocol import DetokenizeRequest

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
    with pytest.raises(APIError, match="request body is not valid JSON: Expecting") as info:
        json_object(b"{not json")
    assert info.value.status == 400


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"3", b""])
def test_json_object_refuses_json_that_is_not_an_object(body):
    with pytest.raises(APIError, match="request body must be a JSON object") as info:
        json_object(body)
    assert info.value.status == 400
