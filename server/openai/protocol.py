"""OpenAI request bodies (vLLM's field set), validated with pydantic.

Each check says what was asked and what is allowed; ``body.py`` turns a
validation failure into a 400 with ``param`` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_LOGPROBS = 5

# The sampling fields with a range: (low, high, whether low itself is allowed); high is.
RANGES = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
    "repetition_penalty": (0.0, 2.0, False),
}
# The integer sampling fields with a floor: (the floor, how a refusal says it).
FLOORS = {"n": (1, "at least 1"), "min_tokens": (0, ">= 0")}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, v, info):
        low, high, low_included = RANGES[info.field_name]
        if v is not None and not ((low <= v if low_included else low < v) and v <= high):
            interval = f"{'[' if low_included else '('}{low:g}, {high:g}]"
            raise ValueError(f"{info.field_name} must be in {interval}, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {v}")
        return v

    @field_validator(*FLOORS)
    @classmethod
    def _at_least(cls, v, info):
        low, words = FLOORS[info.field_name]
        if v < low:
            raise ValueError(f"{info.field_name} must be {words}, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def stream_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 0:
            raise ValueError(f"max_tokens must be >= 0, got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

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


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]
