"""What ``/openapi.json`` (and so ``/docs``) declares of each route: its request body and its
error responses.

The endpoints read their bodies themselves (``body.py``: size limit, strict JSON, the
OpenAI error shape), so FastAPI sees no body parameter and would declare none. ``route``
declares it instead, as a reference to the request's pydantic model (``protocol.py``), and
the error responses, as the OpenAI error shape (``errors.ErrorResponse``);
``install_openapi`` puts the models' JSON schemas (their ranges included) into the
document's components. What the document says and what the server checks come from the
same models.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from spyre_serve.server.openai.errors import ERROR_DESCRIPTIONS, ErrorResponse
from spyre_serve.server.openai.request_id import HEADER, MAX_LENGTH

REF = "#/components/schemas/{model}"
# The errors a route that generates can answer with; the others list fewer.
GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)
BODY_ERRORS = (400, 401, 404, 413, 500)


def errors(*statuses: int) -> dict:
    """The ``responses`` of a route that may fail with ``statuses``, each the error shape."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def route(model: type[BaseModel], statuses: tuple[int, ...], streams: bool = False,
          answers: tuple[type[BaseModel], type[BaseModel]] | None = None) -> dict:
    """Keyword arguments for ``router.post``: the JSON body ``model``, the error responses,
    and with ``streams`` (a generation) a 200 that is JSON (``answers[0]``, responses.py) or,
    with ``"stream": true``, server-sent events (each ``data:`` one ``answers[1]``), and the
    ``X-Request-Id`` header that names it."""
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
    responses = errors(*statuses)
    extra: dict = {"requestBody": body}
    if streams:
        body, chunk = ({"schema": {"$ref": REF.format(model=m.__name__)}} for m in answers) if answers else ({}, {})
        responses[200] = {"description": "the completion; with `stream`, server-sent events ending `data: [DONE]`, "
                                         "each event's data a chunk",
                          "content": {"application/json": body, "text/event-stream": chunk}}
        extra["parameters"] = [{"name": HEADER, "in": "header", "required": False,
                                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH},
                                "description": "the request's id (vLLM's): the answer's id is `cmpl-<id>`, "
                                               "`chatcmpl-<id>` or `resp_<id>`, and the response carries the "
                                               "header back"}]
    return {"openapi_extra": extra, "responses": responses}


def served_values(model_name: str, vocab_size: int, settings, template_variables: list[str]) -> dict:
    """What this server writes into its document: the values ``protocol.served`` markers
    name (its caps, the last token id, the chat template's variables)."""
    return {"model_name": model_name, "last_token_id": vocab_size - 1, "max_n": settings.max_n,
            "max_prompts": settings.max_prompts, "max_stop_strings": settings.max_stop_strings,
            "max_stop_length": settings.max_stop_length, "max_stop_token_ids": settings.max_stop_token_ids,
            "template_variables": {name: {} for name in template_variables}, "closed": False}


def install_openapi(app: FastAPI, models: list[type[BaseModel]], values: dict) -> None:
    """Make ``app.openapi()`` add the JSON schema of each of ``models`` (and of the models
    they hold) to the document's components, where ``route``'s references point, with what
    this server serves written in (``served``, from ``served_values``)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schemas = defs.get("$defs", {})
            for schema in schemas.values():
                served(schema, values)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def served(schema: dict, values: dict) -> None:
    """Write this server's ``values`` into a request model's ``schema``: ``model`` is the
    served name (or null), and each ``x-served`` marker becomes the keywords it names."""
    if "model" in schema.get("properties", {}):
        schema["properties"]["model"] = {"anyOf": [{"const": values["model_name"]}, {"type": "null"}],
                                         "default": None, "description": "the served model's name (or left out)"}
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            for keyword, name in node.pop("x-served", {}).items():
                node[keyword] = values[name]
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
