"""A request body: read within the size limit, parsed as one JSON object, validated.

The endpoints read their bodies themselves (not through FastAPI's body parameters) so that
each refusal is made here, where it is found, in the OpenAI error shape: 413 for a body
over ``--max-body-bytes`` (by its Content-Length before reading, or while reading one sent
without), 400 for a body that is not JSON (a Content-Type that is not JSON, bytes that are
not UTF-8, text that is not JSON, NaN or Infinity, a number no float or int holds, nesting
deeper than ``MAX_DEPTH``) or not an object, 400 naming the field for a value the endpoint's
pydantic model refuses (and for a field it does not declare, with ``--strict-request-fields``;
without it such a field is ignored and named in a warning, as vLLM does). Every message is in
the user's words: no exception's name or text reaches the client.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError

from spyre_serve.server.openai.errors import APIError, validation_error

Body = TypeVar("Body", bound=BaseModel)
log = logging.getLogger("spyre_serve.api")

# Most ignored field names one warning line names (a body may hold thousands of made-up keys).
MAX_IGNORED_SHOWN = 10

# Deepest nesting of arrays and objects a body may have. The deepest field any endpoint reads
# is 4 levels down (messages[i].content[j].text); chat_template_kwargs may carry a little
# structure. Deeper bodies are refused here so that nothing after parsing (pydantic's error
# messages, json.dumps, a template) can run out of Python's recursion limit on them.
MAX_DEPTH = 32
# Most arrays and objects a body may hold. Parsing builds a Python object for each, on the
# event loop: a 1 MB body of 250,000 empty objects took 30 ms there. The largest real bodies
# hold a few thousand (a chat of many messages and parts, 256 token-id prompts, 128 tools).
MAX_CONTAINERS = 20_000
# Python refuses to convert longer integer literals (CVE-2020-10735); json.loads raises then.
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300


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


def check_content_type(content_type: str | None) -> None:
    """400 unless the body is declared JSON in UTF-8 (``application/json``, ``*/*+json``, any
    case, charset utf-8 if named), or not declared at all (curl without -H, some clients)."""
    if content_type is None:
        return
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), "utf-8")
    if (media == "application/json" or media.endswith("+json")) and charset in ("utf-8", "utf8"):
        return
    raise APIError(400, f"request body must be JSON (Content-Type: application/json, in UTF-8), "
                        f"got Content-Type: {content_type[:100]}")


def _no_constant(name: str):
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(400, f"request body holds the number {text[:40]}, outside what a 64-bit float holds")
    return value


def _parse(text: str):
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                            f"column {exc.colno}") from None
    except ValueError:  # the only other ValueError json.loads raises: int() of a too long literal
        raise APIError(400, f"request body holds a number over {MAX_INT_DIGITS} digits long") from None
    except RecursionError:
        raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels") from None


_BRACKET = np.zeros(256, np.int8)                           # byte -> +1 opens, -1 closes, 0 else
_BRACKET[[ord("["), ord("{")]], _BRACKET[[ord("]"), ord("}")]] = 1, -1


def structure(text: str | bytes) -> tuple[int, int]:
    """(how deep arrays and objects nest, how many there are) in the JSON ``text``, read
    before it is parsed, in numpy and linear in its length (4 ms for a 1 MB prompt, 40 ms for
    a MB of nothing but quotes and brackets): a quote starts or ends a string unless an odd run
    of backslashes comes right before it; a bracket counts when an even number of those quotes
    comes before it. (A regular expression cutting the strings out was retried at every quote:
    a body of many ``\\"`` pairs and no closing quote took quadratic time on the event loop,
    10 s for 40 KB, issue 38. A walk of the parsed value in Python took 0.1 s for a body of
    120,000 objects.) Bytes 0x22 and 0x5c never occur inside a UTF-8 character, so the bytes
    are read as they are. For text that is not JSON the figures are only what its brackets
    say; the parse then refuses it."""
    raw = np.frombuffer(text.encode() if isinstance(text, str) else text, np.uint8)
    quotes, slashes = np.flatnonzero(raw == ord('"')), np.flatnonzero(raw == ord("\\"))
    if quotes.size and slashes.size:   # drop the quotes escaped by an odd run of backslashes
        starts = np.ones(slashes.size, bool)
        starts[1:] = slashes[1:] != slashes[:-1] + 1
        run_start = np.maximum.accumulate(np.where(starts, slashes, 0))   # of each backslash's run
        last = np.maximum(np.searchsorted(slashes, quotes) - 1, 0)        # the backslash before it
        escaped = (slashes[last] == quotes - 1) & ((quotes - run_start[last]) % 2 == 1)
        quotes = quotes[~escaped]
    kinds = _BRACKET[raw]
    brackets = np.flatnonzero(kinds)
    step = kinds[brackets[np.searchsorted(quotes, brackets) % 2 == 0]]   # an even count of quotes before
    return int(np.cumsum(step, dtype=np.int64).max(initial=0)), int((step > 0).sum())


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text`` (``structure``)."""
    return structure(text)[0]


def json_object(body: bytes) -> dict:
    """The body as a JSON object: UTF-8, strict JSON (no NaN or Infinity, finite numbers),
    at most ``MAX_DEPTH`` levels deep and ``MAX_CONTAINERS`` arrays and objects (both
    checked before parsing)."""
    if not body.strip():
        raise APIError(400, "request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: byte 0x{body[exc.start]:02x} at position "
                            f"{exc.start}") from None
    depth, containers = structure(body)
    if depth > MAX_DEPTH:
        raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels")
    if containers > MAX_CONTAINERS:
        raise APIError(400, f"request body holds {containers} arrays and objects, over the limit of "
                            f"{MAX_CONTAINERS}")
    data = _parse(text)
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


async def read_request(request: Request, model: type[Body], limit: int, strict: bool = False) -> Body:
    """The body read, parsed and validated as ``model``. A field no model declares is ignored
    and named in one warning line (vLLM's behaviour), or refused by name when ``strict``."""
    check_content_type(request.headers.get("content-type"))
    data = json_object(await read_body(request, limit))
    context: dict = {"strict": strict, "ignored": []}
    try:
        body = model.model_validate(data, context=context)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if context["ignored"]:
        log.warning("%s %s: ignored fields this server does not know: %s", request.method, request.url.path,
                    ignored_names(context["ignored"]))
    return body


def ignored_names(names: list[str], shown: int = MAX_IGNORED_SHOWN) -> str:
    """The ignored fields for a log line: each once, at most ``shown`` of them and 40 characters
    of each (a body may hold thousands of made-up keys), then how many more there were."""
    unique = list(dict.fromkeys(names))
    text = ", ".join(json.dumps(name[:40]) for name in unique[:shown])
    return text + (f" and {len(unique) - shown} more" if len(unique) > shown else "")
