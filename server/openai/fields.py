"""The request fields' constraints, declared once: the sampling ranges and floors, the fields
accepted only at their neutral value, and the annotated types (integers, token ids, template
variables) the request models of protocol.py are built from; each also writes its JSON-schema
keywords for ``/openapi.json``."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictInt

MAX_LOGPROBS = 20
INT64 = (-(2**63), 2**63 - 1)

# The sampling fields with a range: (low, high, whether low itself is allowed); high is.
RANGES = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "top_n_sigma": (-1.0, 1000.0, True),    # llama.cpp's; <= 0 (its default -1) is off
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
    "repetition_penalty": (0.0, 2.0, False),
}
# The integer sampling fields with a floor: (the floor, how a refusal says it).
FLOORS = {"n": (1, "at least 1"), "min_tokens": (0, ">= 0")}

# Fields a client may send that this server does not act on yet: each is accepted at its
# neutral values (what leaving it out means) and refused otherwise, naming it. Implement a
# field, then delete its row here (structured output, tool calls and logit_bias went so).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (insertion)"),
    "continue_final_message": ((None, False), "continue_final_message (continuing the last assistant message)"),
    # SGLang's, which vllm-router adds to every body it forwards, at these neutral values
    "no_stop_trim": ((None, False), "no_stop_trim (SGLang's; include_stop_str_in_output keeps the stop string)"),
    "return_hidden_states": ((None, False), "return_hidden_states (SGLang's)"),
}

# the rows above that are not the request's own fields but a chat message's or stream_options'
NESTED_FIELDS: tuple[str, ...] = ()


def refuse_unless_neutral(v, info, table: dict[str, tuple[tuple, str]] = UNSUPPORTED):
    """Refuse a value of an ``UNSUPPORTED`` field (or of ``table``'s, a body's own such
    fields) other than its neutral ones."""
    neutral, what = table[info.field_name]
    if any(v == n and type(v) is type(n) for n in neutral):
        return v
    shown = [json.dumps(n) for n in neutral if n is not None]
    also = f", or send {' or '.join(shown)}" if shown else ""
    raise ValueError(f"{what} is not supported yet: leave {info.field_name} out{also}")


def schema(**keywords) -> Any:
    """A field's JSON-schema keywords (minimum, maximum...) for the OpenAPI document; the
    validators below make the checks, with their own messages."""
    return Field(json_schema_extra=keywords)


def range_schema(name: str) -> Any:
    low, high, low_included = RANGES[name]
    return schema(**{"minimum" if low_included else "exclusiveMinimum": low, "maximum": high})


def neutral(name: str, table: dict[str, tuple[tuple, str]] = UNSUPPORTED) -> Any:
    """The JSON schema of an ``UNSUPPORTED`` field (or of ``table``'s): only its neutral
    values (null = left out)."""
    values, what = table[name]

    def only_neutral(field_schema: dict) -> None:
        field_schema.clear()
        field_schema.update({"enum": list(values), "description": f"not supported yet ({what}): only these values "
                                                                  "are accepted (null: left out)"})

    return Field(json_schema_extra=only_neutral)


def served(**keywords: str) -> dict:
    """JSON-schema keywords whose values are this server's (``openapi.served``): each names
    the entry of ``openapi.served_values`` it takes, e.g. ``maxItems="max_prompts"``."""
    return {"x-served": keywords}


def _integral(v):
    """JSON Schema's integer: a number without a fractional part, 3.0 as well as 3 (not a
    string, not a bool: those stay refused)."""
    if type(v) is float and v.is_integer():
        return int(v)
    return v


Integer = Annotated[StrictInt, BeforeValidator(_integral)]


def integer_at_least(low: int) -> Any:
    """An ``Integer`` of at least ``low``: pydantic checks the bound (its own message) and
    writes it into the JSON schema as ``minimum``."""
    return Annotated[StrictInt, Field(ge=low), BeforeValidator(_integral)]
# A token id: below the vocabulary's size, which the OpenAPI document writes in.
TokenId = Annotated[Integer, schema(minimum=0, **served(maximum="last_token_id"))]


# Variables for the chat template: the document lists the served template's (the server
# checks them: ``prompts.check_template_kwargs``).
TemplateKwargs = Annotated[dict[str, Any] | None,
                           schema(**served(properties="template_variables", additionalProperties="closed"))]


