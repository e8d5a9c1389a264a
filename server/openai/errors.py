"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Whatever refuses a request raises ``APIError`` where it finds the problem, with the status
that says why (400, 401, 404, 413, 500, 503 + Retry-After) and ``param`` naming the request
field at fault; the handlers ``install_error_handlers`` puts on the app turn it, Starlette's
own refusals (404 no such route, 405 wrong method) and any other exception into the
response. Any other exception is a 500 that names only a request id: its class and text
are the server's business, so they go to the log under that id, never to the client
(``internal_error``). ``validation_error`` says in one line which field of a body pydantic
refused and why.
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("spyre_serve.api")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# What the OpenAPI document lists under each route's error responses.
ERROR_DESCRIPTIONS = {
    400: "the request is malformed or asks for something this server does not do; `param` names the field",
    401: "no API key, or a wrong one (with --api-key)",
    404: "`model` names a model this server does not serve",
    413: "the body is over --max-body-bytes",
    500: "the server failed; the message names a request id to find in the server's log",
    503: "the engine is down, draining, or its waiting queue is full: retry after Retry-After seconds",
}
# pydantic adds a union member's type name to an error's location; they are not fields
_NOT_FIELDS = {"str", "int", "list"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error (the OpenAPI document's schema for it)."""

    error: ErrorDetail


class APIError(Exception):
    """A refused request: its status, the message for the user, the field at fault, and how
    many seconds to wait before retrying (503s)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status, headers=headers)


def json_head(value, limit: int) -> str | None:
    """``value`` as JSON, encoded only until it is past ``limit`` characters (a list of
    100,000 items costs what its first ones do), so at most ``limit`` + a piece; None when it
    cannot be encoded (too deep, not JSON)."""
    out, size = [], 0
    try:
        for piece in json.JSONEncoder().iterencode(value):
            out.append(piece)
            size += len(piece)
            if size > limit:
                break
    except (RecursionError, TypeError, ValueError):
        return None
    return "".join(out)


def _quoted(value) -> str | None:
    """``value`` as JSON, cut to 100 characters; None when it cannot be encoded."""
    head = json_head(value, 100)
    return None if head is None else head[:100]


def validation_error(exc: ValidationError) -> APIError:
    """A 400 for the first error pydantic found: ``"<field path>: <why>, got <value>"``, with
    ``param`` the top-level field (list indices and union member names left out). A field
    the request model does not have is refused by name: nothing a client sends is ignored."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    loc = [p for p in loc if p.isidentifier() and p not in _NOT_FIELDS]
    where = ".".join(loc)
    if err.get("type") == "extra_forbidden":  # the field's own name, whatever it is (even "")
        name = str(err["loc"][-1])
        shown = f"`{name}`" if name.isidentifier() else json.dumps(name)[:100]
        return APIError(400, f"{where + ': ' if where else ''}this server does not know the field {shown}",
                        loc[0] if loc else None)
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    quoted = _quoted(err["input"]) if "input" in err and err.get("type") not in {"value_error", "missing"} else None
    if quoted is not None:
        msg = f"{msg}, got {quoted}"
    return APIError(400, f"{where}: {msg}" if where else msg, loc[0] if loc else None)


def internal_error(what: str, request_id: str | None = None, exc: BaseException | None = None) -> APIError:
    """The 500 a client sees when the server failed: a request id and nothing else. ``what``
    (the engine's message, the route that failed) and ``exc``'s traceback go to the log under
    that id."""
    request_id = request_id or uuid.uuid4().hex
    log.error("internal error (request id %s): %s", request_id, what, exc_info=exc)
    return APIError(500, f"internal error (request id {request_id}): the server's log says what failed")


def failure(message: str, request_id: str) -> APIError:
    """A choice the engine ended with an error: a 400 with its message when the request caused
    it (``engine.outputs.RequestFault``: its grammar could not go on), else ``internal_error``."""
    from spyre_serve.server.engine.outputs import RequestFault

    if isinstance(message, RequestFault):
        return APIError(400, str(message))
    return internal_error(message, request_id)


async def _api_error(_request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail)))


def request_id_of(request: Request) -> str:
    """The id a 500 names: the client's ``X-Request-Id`` if it is one ``request_id`` would take,
    else the id the endpoint made, else a new one (kept on the request for the header)."""
    given = request.headers.get("x-request-id")
    if given is not None and 0 < len(given) <= 256 and given.isprintable():
        return given
    made = getattr(request.state, "request_id", None) or uuid.uuid4().hex
    request.state.request_id = made
    return made


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Any exception an endpoint raised: a 500 naming the request id, which the response's
    ``X-Request-Id`` carries too (this handler answers outside the middleware that sets it)."""
    rid = request_id_of(request)
    response = error_response(internal_error(f"{request.method} {request.url.path} raised", rid, exc))
    response.headers.setdefault("x-request-id", request.headers.get("x-request-id") or rid)
    return response


def install_error_handlers(app: FastAPI) -> None:
    """``APIError`` as its own status, Starlette's 404/405 in the same shape, anything else
    as a 500 that names a request id (the traceback is logged under it)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
