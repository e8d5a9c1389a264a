"""A request's structured-output fields as one grammar, and its logit_bias as the card takes it.

The forms (one per request at most; two is a 400 naming the second):

    response_format   {"type": "text"} (none), {"type": "json_object"} (any JSON object),
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json       a JSON schema (object or its text)          vLLM's older fields
    guided_regex      a regular expression
    guided_choice     a list of strings: the output is one of them
    guided_grammar    a Lark or GBNF grammar
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM's newer)

The grammar is checked (a JSON schema against its draft's meta-schema) and compiled by
``server.structured_output.grammars.Grammars`` on a worker thread (``Serving.blocking``, within
--render-timeout), never on the event loop; their size is capped before (``limits``). A
schema that is not a JSON schema, or one llguidance cannot compile, is a 400 naming the
field and the problem. The tools of a chat request make a grammar too
(``server.openai.generation.tools``).
"""

from __future__ import annotations

import json
import math

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.protocol import SamplingRequest
from spyre_serve.server.structured_output.grammars import GrammarError, GrammarSpec, json_spec

LOGIT_BIAS_MAX = 100.0   # vLLM clamps each bias to [-100, 100] (OpenAI's range)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# where in a field its JSON schema sits, for the messages about it
SCHEMA_WHERE = {"response_format": "response_format.json_schema.schema", "text.format": "text.format.schema"}


def _schema_of(value, param: str):
    """A JSON schema given as an object (or bool) or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema (an object), got {type(value).__name__}", param)
    return value


def check_json_schema(schema, what: str, param: str | None = None) -> None:
    """400 naming ``param`` (else ``what``) unless ``schema`` is a valid JSON schema (its own
    draft's meta-schema, 2020-12 when it names none); the message says ``what`` is wrong."""
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise APIError(400, f"{what} is not a valid JSON schema: {exc.message} (at {where})",
                       param or what) from None
    except Exception as exc:  # noqa: BLE001 - a "$schema" that is no URI, a schema jsonschema cannot read
        raise APIError(400, f"{what} is not a valid JSON schema: {type(exc).__name__}: {str(exc)[:200]}",
                       param or what) from None


def _from_response_format(rf: dict) -> tuple[GrammarSpec, str] | None:
    kind = rf.get("type")
    if kind == "text":
        if set(rf) != {"type"}:
            raise APIError(400, "response_format of type text takes no other field", "response_format")
        return None
    if kind == "json_object":
        return json_spec({"type": "object"}), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise APIError(400, 'response_format of type json_schema needs "json_schema": {"name": ..., '
                                '"schema": {...}}', "response_format")
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise APIError(400, f"response_format.json_schema: unknown field {sorted(unknown)[0]!r}",
                           "response_format")
        schema = _schema_of(js.get("schema", {"type": "object"}), "response_format.json_schema.schema")
        return json_spec(schema), "response_format"
    raise APIError(400, f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
                   "response_format")


def _choice(values, param: str) -> GrammarSpec:
    if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
        raise APIError(400, f"{param} must be a non-empty list of strings", param)
    return GrammarSpec("choice", json.dumps(values))


def _text(value, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string ({what})", param)
    return value


def _from_structured_outputs(so: dict) -> tuple[GrammarSpec, str]:
    given = [k for k in so if so[k] not in (None, False)]
    unknown = [k for k in so if k not in STRUCTURED_KEYS]
    if unknown:
        raise APIError(400, f"structured_outputs: unknown field {unknown[0]!r} (give one of "
                            f"{', '.join(STRUCTURED_KEYS)})", "structured_outputs")
    if len(given) != 1:
        raise APIError(400, f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}",
                       "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json":
        return json_spec(_schema_of(so[key], param)), param
    if key == "json_object":
        return json_spec({"type": "object"}), param
    if key == "choice":
        return _choice(so[key], param), param
    if key == "regex":
        return GrammarSpec("regex", _text(so[key], param, "a regular expression")), param
    return GrammarSpec("grammar", _text(so[key], param, "a Lark or GBNF grammar")), param


def grammar_spec(req: SamplingRequest) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the field it came from, or None; a 400 for a malformed one or
    for two at once."""
    found: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append(spec)
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    if req.guided_json is not None:
        found.append((json_spec(_schema_of(req.guided_json, "guided_json")), "guided_json"))
    if req.guided_regex is not None:
        found.append((GrammarSpec("regex", _text(req.guided_regex, "guided_regex", "a regular expression")),
                      "guided_regex"))
    if req.guided_choice is not None:
        found.append((_choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((GrammarSpec("grammar", _text(req.guided_grammar, "guided_grammar", "a Lark or GBNF grammar")),
                      "guided_grammar"))
    if len(found) > 1:
        raise APIError(400, f"give one kind of structured output, not {found[0][1]} and {found[1][1]}",
                       found[1][1])
    return found[0] if found else None


def _checked_and_compiled(grammars, spec: GrammarSpec, param: str):
    """A JSON schema checked against its draft (a 400 naming ``param``), then the grammar
    compiled: on a worker thread, both costs growing with the schema. A schema whose grammar
    is in the cache was checked when it went in."""
    if spec.kind == "json" and not grammars.cached(spec):
        check_json_schema(json.loads(spec.source), SCHEMA_WHERE.get(param, param))
    return grammars.compile(spec)


async def compile_grammar(serving, spec: GrammarSpec, param: str):
    """The compiled grammar (``server.structured_output.grammars.Grammar``), on a worker thread; a 400 naming
    ``param`` when the schema is invalid or llguidance refuses it."""
    try:
        return await serving.blocking("checking and compiling the grammar", param, _checked_and_compiled,
                                      serving.grammars, spec, param)
    except GrammarError as exc:
        raise APIError(400, f"{param}: the grammar is invalid: {str(exc).strip()[:500]}", param) from None


async def request_grammar(serving, req: SamplingRequest):
    """The request's compiled grammar, or None (``grammar_spec``, then ``compile_grammar``)."""
    found = grammar_spec(req)
    if found is None:
        return None
    return await compile_grammar(serving, *found)


def logit_bias(req: SamplingRequest, vocab_size: int) -> dict[int, float] | None:
    """``logit_bias`` as {token id: bias}: keys are token ids (as strings, OpenAI's form) below
    the vocabulary's size, each bias clamped to [-100, 100] as vLLM does; a 400 otherwise."""
    if not req.logit_bias:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key[:50]!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias: token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                           "logit_bias")
        if not math.isfinite(bias):
            raise APIError(400, f"logit_bias: the bias of token {token} is not a finite number", "logit_bias")
        out[token] = min(LOGIT_BIAS_MAX, max(-LOGIT_BIAS_MAX, float(bias)))
    return out


def apply(params: list, grammar, bias: dict[int, float] | None) -> list:
    """Every choice's ``GenerationParams`` with the grammar and the logit bias (each choice gets
    its own matcher from the grammar when the engine admits it)."""
    for p in params:
        p.grammar = grammar
        p.sampling.logit_bias = bias
    return params
