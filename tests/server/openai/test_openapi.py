"""openapi.py: /openapi.json declares every request body and the errors in the OpenAI shape,
from the same models the server validates with."""

from __future__ import annotations

import jsonschema
import pytest
import schemathesis

from spyre_serve.server.launch.settings import Settings
from tests.server.openai.fakes import VOCAB, client_for

BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}


@pytest.fixture(scope="module")
def doc() -> dict:
    return client_for().get("/openapi.json").json()


def resolve(doc: dict, ref: str) -> dict:
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    """A validator of the component ``name``, its references resolved within the document."""
    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(("path", "name"), BODIES.items())
def test_every_post_route_declares_its_json_body_by_its_model(doc, path, name):
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
    assert resolve(doc, body["content"]["application/json"]["schema"]["$ref"])["properties"]


def test_the_fields_carry_their_ranges_and_refuse_unknown_fields(doc):
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    props = completion["properties"]
    assert (props["temperature"]["minimum"], props["temperature"]["maximum"]) == (0.0, 2.0)
    assert props["top_p"]["exclusiveMinimum"] == 0.0 and props["n"]["minimum"] == 1
    assert props["logprobs"]["maximum"] == 20 and props["add_special_tokens"]["default"] is True
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["messages"]["minItems"] == 1


@pytest.mark.parametrize(("name", "body", "valid"), [
    ("CompletionRequest", {"prompt": "x", "temperature": 0.5, "stop": ["a"]}, True),
    ("CompletionRequest", {"prompt": [[1, 2], [3]], "n": 2}, True),
    ("CompletionRequest", {"prompt": "x", "temperature": 3}, False),
    ("CompletionRequest", {"prompt": "x", "temprature": 0.5}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "robot", "content": "x"}]}, False),
    ("DetokenizeRequest", {"tokens": [1, 2]}, True),
])
def test_the_schemas_accept_and_refuse_as_the_server_does(doc, name, body, valid):
    assert validator(doc, name).is_valid(body) is valid


@pytest.mark.parametrize("path", [*BODIES, "/v1/models"])
def test_every_api_route_declares_its_errors_in_the_openai_shape(doc, path):
    (method, operation), = doc["paths"][path].items()
    errors = {int(s): r for s, r in operation["responses"].items() if int(s) >= 400}
    assert 400 in errors or path == "/v1/models"
    assert 500 in errors and 401 in errors
    for response in errors.values():
        assert response["description"]
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    shape = doc["components"]["schemas"]["ErrorDetail"]
    assert set(shape["properties"]) == {"message", "type", "param", "code"}


def test_a_generating_route_declares_json_or_a_stream(doc):
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "text/event-stream"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_generating_route_declares_the_x_request_id_header(doc, path):
    [header] = doc["paths"][path]["post"]["parameters"]
    assert (header["name"], header["in"], header["required"]) == ("X-Request-Id", "header", False)
    assert header["schema"]["maxLength"] == 256


def test_the_document_loads_as_openapi_with_every_operation_and_docs_is_served(doc):
    labels = [result.ok().label for result in schemathesis.openapi.from_dict(doc).get_all_operations()]
    assert labels == ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/completions/render",
                      "POST /v1/chat/completions/render", "POST /v1/responses",
                      "GET /v1/responses/{response_id}", "POST /v1/embeddings", "POST /v1/score", "POST /score",
                      "POST /tokenize", "POST /detokenize", "GET /v1/models",
                      "GET /model_info", "GET /get_model_info", "GET /server_info", "GET /get_server_info",
                      "GET /version", "GET /health", "GET /ping", "POST /ping", "GET /metrics",
                      "GET /get_load", "GET /load"]
    r = client_for().get("/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


def test_the_document_names_the_served_model_and_bounds_token_ids_by_the_vocabulary(doc):
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["anyOf"][0] == {"const": "tiny"}
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (tokens["minimum"], tokens["maximum"]) == (0, VOCAB - 1) and "x-served" not in tokens
    assert validator(doc, "CompletionRequest").is_valid({"prompt": [[1, VOCAB - 1]], "model": "tiny"})
    assert not validator(doc, "CompletionRequest").is_valid({"prompt": [VOCAB]})
    assert not validator(doc, "CompletionRequest").is_valid({"prompt": "x", "model": "gpt-17"})


def test_the_document_carries_the_servers_caps_and_template_variables(doc):
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    defaults = Settings()
    assert props["n"]["maximum"] == defaults.max_n
    assert [branch.get("maxItems") for branch in props["prompt"]["anyOf"]] == [None, defaults.max_prompts, None,
                                                                               defaults.max_prompts]
    stop_list = props["stop"]["anyOf"][1]
    assert (stop_list["maxItems"], stop_list["items"]["maxLength"]) == (defaults.max_stop_strings,
                                                                        defaults.max_stop_length)
    kwargs = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]
    assert set(kwargs["properties"]) == {"fail", "greeting"} and kwargs["additionalProperties"] is False
    assert not validator(doc, "ChatCompletionRequest").is_valid(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "x"}})
    assert not validator(doc, "TokenizeRequest").is_valid({"prompt": "x", "messages": []})
