"""OpenAI request bodies (vLLM's field set), validated with pydantic.

Each check says what was asked and what is allowed; ``body.py`` turns a
validation failure into a 400 with ``param`` naming the field. Nothing a client sends is
dropped unseen: a field no model here declares is ignored and named in a warning, as vLLM
does, or refused by name with ``--strict-request-fields`` (``RequestModel``), and a
field the server knows but does not act on yet is accepted only at its neutral value
(``UNSUPPORTED``). The ranges are also written into the JSON schema (``/openapi.json``),
so that ``/docs`` and API tools show them.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from spyre_serve.server.openai.fields import (  # noqa: F401  (INT64, MAX_LOGPROBS, UNSUPPORTED: this module's interface)
    FLOORS,
    INT64,
    MAX_LOGPROBS,
    NESTED_FIELDS,
    RANGES,
    UNSUPPORTED,
    Integer,
    TemplateKwargs,
    TokenId,
    neutral,
    range_schema,
    refuse_unless_neutral,
    schema,
    served,
)

# Every list stops at its first bad item (pydantic's fail_fast): a body of 100,000 bad items
# then costs one error, not 100,000 (each a dict pydantic builds when asked for its errors;
# a 1 MiB body made ~1M of them, ~0.8 GB and seconds on the event loop). body.py reports
# the first error anyway.
FAIL_FAST = Field(fail_fast=True)


def truncate_prompt_tokens(v):
    """vLLM's truncate_prompt_tokens: -1 (the context length) or at least 1."""
    if v is not None and v != -1 and v < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {v}")
    return v


def not_empty(v, info):
    """A prompt (or input) that is not an empty list."""
    if isinstance(v, list) and len(v) == 0:
        raise ValueError(f"{info.field_name} must not be an empty list")
    return v


class RequestModel(BaseModel):
    """A request body or part of one. A field it does not declare is dropped and named in the
    validation context's ``ignored`` list (``body.read_request`` logs them, as vLLM does: routers
    such as vllm-router add fields of their own to every body), unless the context says
    ``strict`` (``--strict-request-fields``) or there is no context: then it is refused by name
    (``extra="forbid"``). A field declared here with a value it does not take is refused either way."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _unknown_fields(cls, data, handler, info):
        context = info.context
        if not isinstance(data, dict) or context is None or context.get("strict", True):
            return handler(data)
        known = cls._known_names()
        unknown = [name for name in data if name not in known]
        if not unknown:
            return handler(data)
        result = handler({name: value for name, value in data.items() if name in known})
        context.setdefault("ignored", []).extend(unknown)   # once this model took the rest (a union tries several)
        return result

    @classmethod
    @functools.cache
    def _known_names(cls) -> frozenset[str]:
        """Its fields' names and aliases (once per class)."""
        return frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n is not None)


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


MAX_CACHE_SALT = 1024  # characters of a cache_salt


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    task: ClassVar[str] = "generate"    # served by a generating runner only (Serving.read)
    model: str | None = None
    temperature: Annotated[float | None, range_schema("temperature")] = None
    top_p: Annotated[float | None, range_schema("top_p")] = None
    top_k: Annotated[Integer | None, schema(minimum=-1)] = None
    min_p: Annotated[float | None, range_schema("min_p")] = None
    top_n_sigma: Annotated[float, range_schema("top_n_sigma")] = -1.0
    seed: Annotated[Integer | None, schema(minimum=INT64[0], maximum=INT64[1])] = None
    stop: Annotated[str, schema(minLength=1, **served(maxLength="max_stop_length"))] \
        | Annotated[list[Annotated[str, schema(minLength=1, **served(maxLength="max_stop_length"))]],
                    schema(**served(maxItems="max_stop_strings")), FAIL_FAST] | None = None
    stop_token_ids: Annotated[Annotated[list[Annotated[Integer, schema(minimum=0, maximum=2**31 - 1)]],
                                        FAIL_FAST] | None,
                              schema(**served(maxItems="max_stop_token_ids"))] = None
    n: Annotated[Integer, schema(minimum=1, **served(maximum="max_n"))] = 1
    best_of: Annotated[Integer | None, schema(minimum=1)] = None
    ignore_eos: bool = False
    no_stop_trim: Annotated[bool | None, neutral("no_stop_trim")] = None
    return_hidden_states: Annotated[bool | None, neutral("return_hidden_states")] = None
    min_tokens: Annotated[Integer, schema(minimum=0)] = 0
    presence_penalty: Annotated[float, range_schema("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, range_schema("frequency_penalty")] = 0.0
    # None: the model's generation_config.json default (``--generation-config``), else 1
    repetition_penalty: Annotated[float | None, range_schema("repetition_penalty")] = None
    truncate_prompt_tokens: Annotated[Integer | None, schema(minimum=-1)] = None
    user: str | None = None  # OpenAI's end-user id, for the caller's own records: no effect
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) kept
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens in the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured output (server/structured_output/request.py: checked and compiled there, a 400 naming
    # the field): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar": ...}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], FAIL_FAST] | None = None
    guided_grammar: str | None = None
    # tool calls (chat; server/openai/generation/tools.py)
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | a named function
    # token id (as a string) -> bias, clamped to [-100, 100]; values checked by _bias_values
    logit_bias: Annotated[dict[str, Any] | None, schema(additionalProperties={"type": "number"})] = None
    # vLLM's: requests share prefix-cache blocks only when their salts are equal (none: unsalted)
    cache_salt: Annotated[str | None, Field(min_length=1, max_length=MAX_CACHE_SALT)] = None
    # vLLM's: lower runs first under --scheduling-policy priority; anything but 0 is a 400 without it
    priority: Integer = 0

    @field_validator(*(f for f in UNSUPPORTED if f not in NESTED_FIELDS), check_fields=False)
    @classmethod
    def _unsupported(cls, v, info):
        return refuse_unless_neutral(v, info)

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v):
        """Each bias a number (JSON's: not a bool), stopping at the first that is not."""
        for key, bias in (v or {}).items():
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"logit_bias[{json.dumps(key)[:50]}] must be a number, got {json.dumps(bias)[:50]}")
        return None if v is None else {k: float(b) for k, b in v.items()}

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, v, info):
        """The range holds for the value and for the 32-bit float the card computes with (a
        top_p of 1e-300 is 0 there)."""
        low, high, low_included = RANGES[info.field_name]
        if v is None:
            return v
        def inside(x: float) -> bool:
            return (low <= x if low_included else low < x) and x <= high

        interval = f"{'[' if low_included else '('}{low:g}, {high:g}]"
        if not inside(v):
            raise ValueError(f"{info.field_name} must be in {interval}, got {v}")
        as_f32 = float(np.float32(v))
        if not inside(as_f32):
            raise ValueError(f"{info.field_name} must be in {interval}, got {v} ({as_f32:g} as a 32-bit float)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not INT64[0] <= v <= INT64[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {v}")
        return v

    @field_validator(*FLOORS)
    @classmethod
    def _at_least(cls, v, info):
        low, words = FLOORS[info.field_name]
        if v < low:
            raise ValueError(f"{info.field_name} must be {words}, got {v}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        """vLLM's best_of: that many candidates, the n best returned. best_of = n is what
        every request does; more candidates than n are not generated here."""
        n = info.data.get("n")
        if v is None or n is None or v == n:
            return v
        if v < n:
            raise ValueError(f"best_of must be at least n ({n}), got {v}")
        raise ValueError(f"best_of larger than n ({v} > {n}) is not supported: leave best_of out or make it n")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        return truncate_prompt_tokens(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options are only for streams: set stream to true")
        return v

    @property
    def stream_usage(self) -> str:
        """What usage a stream reports: "" (none), "final" (a last chunk of the whole request's,
        include_usage) or "continuous" (that too, and each chunk its choice's so far, as vLLM's
        continuous_usage_stats: only with include_usage)."""
        o = self.stream_options
        if not (self.stream and o and o.include_usage):
            return ""
        return "continuous" if o.continuous_usage_stats else "final"


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[str], schema(minItems=1, **served(maxItems="max_prompts")), FAIL_FAST] \
        | Annotated[list[TokenId], schema(minItems=1), FAIL_FAST] \
        | Annotated[list[Annotated[list[TokenId], FAIL_FAST]], schema(minItems=1, **served(maxItems="max_prompts")),
                    FAIL_FAST]
    max_tokens: Annotated[Integer | None, schema(minimum=0)] = 16
    logprobs: Annotated[Integer | None, schema(minimum=0, maximum=MAX_LOGPROBS)] = None
    echo: bool = False
    # vLLM's: each prompt token's logprob, rank and top alternatives, in the choice
    prompt_logprobs: Annotated[Integer | None, schema(minimum=0, maximum=MAX_LOGPROBS)] = None
    suffix: Annotated[str | None, neutral("suffix")] = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v, info):
        return not_empty(v, info)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 0:
            raise ValueError(f"max_tokens must be >= 0, got {v}")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v, info):
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"{info.field_name} must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v, info):
        """vLLM's rule: a stream has no place for them (0 asks for none, and passes)."""
        if v and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return v


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = None  # handed to the chat template with the message, as vLLM does
    tool_calls: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it: role, content as text, name if given, an
        assistant's tool calls (their JSON arguments as objects, as vLLM hands them to templates)
        and a tool message's call id."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _call_for_template(call: dict) -> dict:
    """A tool call with its ``function.arguments`` parsed from JSON text when they are (templates
    iterate over them, e.g. ``arguments | tojson``)."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": args}}
    return call


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1), FAIL_FAST]
    max_tokens: Annotated[Integer | None, schema(minimum=1)] = None
    max_completion_tokens: Annotated[Integer | None, schema(minimum=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[Integer | None, schema(minimum=0, maximum=MAX_LOGPROBS)] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the chat template writes the special tokens itself
    chat_template_kwargs: TemplateKwargs = None
    echo: bool = False  # vLLM's: the last message's content before the reply, when it has the reply's role
    parallel_tool_calls: bool = True  # OpenAI's: false allows one tool call at most
    continue_final_message: Annotated[bool | None, neutral("continue_final_message")] = None
    # SGLang's, which vllm-router adds to every chat it forwards: this server parses no reasoning out
    # of the text, so there is none to separate, stream apart or leave out, whatever they say
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v, info):
        if v is not None and v < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @property
    def output_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [{"required": ["prompt"]},
                                                                           {"required": ["messages"]}]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[Annotated[list[ChatMessage], FAIL_FAST] | None, Field(min_length=1)] = None
    add_special_tokens: bool | None = None  # None: as the endpoint would (prompt yes, messages no)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs are for messages, not a prompt")
        return self

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens, as the completion (prompt) or the
        chat (messages) endpoint would unless told."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: Annotated[list[TokenId], FAIL_FAST]
