"""A request body: read within the size limit, parsed as one JSON object, validated.

The endpoints read their bodies themselves (not through FastAPI's body parameters) so that
each refusal is made here, where it is found, in the OpenAI error shape: 413 for a body
over ``--max-body-bytes`` (by its Content-Length before reading, or while reading one sent
without), 400 for a body that is not JSON or not an object, 400 naming the field for a
value the endpoint's pydantic model refuses.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.openai.errors import APIError, validation_error

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes")
    return bytes(body)


def json_object(body: bytes) -> dict:
    """The body as a JSON object (an empty body is not one)."""
    try:
        data = json.loads(body or b"null")
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


async def read_request(request: Request, model: type[Body], limit: int) -> Body:
    """The body read, parsed and validated as ``model``."""
    data = json_object(await read_body(request, limit))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
