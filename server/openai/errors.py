"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Whatever refuses a request raises ``APIError`` where it finds the problem, with the status
that says why (400, 401, 404, 413, 500, 503 + Retry-After) and ``param`` naming the request
field at fault; the handlers ``install_error_handlers`` puts on the app turn it, or any
other exception (as a 500), into the response. ``validation_error`` says in one line which
field of a body pydantic refused and why.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# pydantic adds a union member's type name to an error's location; they are not fields
_NOT_FIELDS = {"str", "int", "list"}


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


def validation_error(exc: ValidationError) -> APIError:
    """A 400 for the first error pydantic found: ``"<field path>: <why>, got <value>"``, with
    ``param`` the top-level field (list indices and union member names left out)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    loc = [p for p in loc if p.isidentifier() and p not in _NOT_FIELDS]
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if "input" in err and err.get("type") not in {"value_error", "missing"}:
        msg = f"{msg}, got {json.dumps(err['input'])[:100]}"
    where = ".".join(loc)
    return APIError(400, f"{where}: {msg}" if where else msg, loc[0] if loc else None)


async def _api_error(_request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def install_error_handlers(app: FastAPI) -> None:
    """``APIError`` as its own status; anything else a handler raises as a 500 naming it."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
