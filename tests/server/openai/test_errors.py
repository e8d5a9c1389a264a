"""errors.py: the OpenAI error shape, pydantic's refusals as one line, the app's handlers."""

from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from spyre_serve.server.openai.errors import (
    APIError,
    error_body,
    error_response,
    install_error_handlers,
    validation_error,
)
from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest, CompletionRequest


def refusal(model, **body) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value)


def test_error_body_has_openais_four_fields_and_the_type_of_the_status():
    assert error_body(404, "no such model", "model") == {
        "error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}
    }


def test_an_unlisted_status_gets_the_generic_type():
    assert error_body(418, "teapot")["error"]["type"] == "Error"


def test_error_response_carries_the_status_and_the_body():
    r = error_response(APIError(413, "too big"))
    assert r.status_code == 413
    assert json.loads(r.body) == error_body(413, "too big")
    assert "retry-after" not in r.headers


def test_error_response_of_a_503_says_when_to_retry():
    assert error_response(APIError(503, "busy", retry_after=3)).headers["retry-after"] == "3"


def test_a_value_error_names_the_field_and_drops_pydantics_prefix():
    err = refusal(CompletionRequest, prompt="x", temperature=5.0)
    assert (err.status, err.param) == (400, "temperature")
    assert err.message == "temperature: temperature must be in [0, 2], got 5.0"


def test_a_type_error_quotes_the_value_given():
    err = refusal(CompletionRequest, prompt="x", top_k=2.5)
    assert err.param == "top_k" and err.message.endswith(", got 2.5")


def test_a_missing_field_names_it_without_a_value():
    err = refusal(CompletionRequest, max_tokens=1)
    assert err.param == "prompt" and err.message == "prompt: Field required"


def test_list_indices_and_union_member_names_are_left_out_of_the_path():
    err = refusal(ChatCompletionRequest, messages=[{"role": "robot", "content": "x"}])
    assert err.param == "messages" and err.message.startswith("messages.role: ")
    err = refusal(CompletionRequest, prompt=[[1, "a"]])
    assert err.param == "prompt" and err.message.startswith("prompt: ")


def test_a_quoted_value_is_cut_to_100_characters():
    err = refusal(CompletionRequest, prompt="x", top_k="9" * 500)
    assert len(err.message.split(", got ")[1]) == 100


def app_raising(exc: Exception) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/")
    async def fail():
        raise exc

    return TestClient(app, raise_server_exceptions=False)


def test_the_handlers_answer_an_api_error_with_its_status_and_shape():
    r = app_raising(APIError(401, "who are you")).get("/")
    assert r.status_code == 401 and r.json() == error_body(401, "who are you")


def test_the_handlers_answer_any_other_exception_with_a_500_that_names_only_a_request_id(caplog):
    with caplog.at_level(logging.ERROR, logger="spyre_serve.api"):
        r = app_raising(RuntimeError("secret detail")).get("/")
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert re.fullmatch(r"internal error \(request id [0-9a-f]{32}\): the server's log says what failed", message)
    assert "RuntimeError" not in r.text and "secret detail" not in r.text
    request_id = message.split("request id ")[1].split(")")[0]
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info[1].args == ("secret detail",)


def test_an_unknown_route_and_a_wrong_method_answer_in_the_openai_shape():
    client = app_raising(RuntimeError("x"))
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json() == error_body(404, "Not Found")
    r = client.post("/")
    assert r.status_code == 405 and r.json() == error_body(405, "Method Not Allowed")


def test_an_unknown_field_is_refused_as_not_supported():
    err = refusal(CompletionRequest, prompt="x", temprature=0.5)
    assert (err.param, err.message) == ("temprature", "temprature: this server does not know the field "
                                                      "`temprature`")


def test_a_value_too_deep_to_quote_is_left_unquoted():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    err = refusal(CompletionRequest, prompt="x", top_k=deep)
    assert err.param == "top_k" and err.message.startswith("top_k: ")


@pytest.mark.parametrize(("field", "words"), [("", 'this server does not know the field ""'),
                                              ("a b", 'this server does not know the field "a b"')])
def test_an_unknown_field_that_is_no_identifier_is_refused_quoted(field, words):
    err = refusal(CompletionRequest, prompt="x", **{field: 1})
    assert (err.param, err.message) == (None, words)
