"""The response bodies of the generation endpoints, as pydantic models (OpenAI's and vLLM's
shapes): ``/openapi.json`` documents them, and the tests validate every answer the server gives
against them (``extra="forbid"``: a field the handlers add that is not declared here fails).

The handlers build the bodies as dicts on the hot path (a stream's chunk is one dict per
token); these models are the declaration those dicts keep to, not a conversion step.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Declared(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(Declared):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Declared):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Declared):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class Envelope(Declared):
    id: str
    created: int
    model: str
    # OpenAI's field for the backend configuration: here the numbers the step computes with
    # (weights, GEMM inputs, KV cache formats and the kernels' ISA: models.ModelRunner.numerics)
    system_fingerprint: str


class CompletionResponse(Envelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Declared):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Declared):
    content: list[ChatTokenLogprob] | None


class FunctionCall(Declared):
    name: str
    arguments: str


class ToolCall(Declared):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Declared):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(Declared):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage | None = None


class ToolCallDelta(Declared):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(Declared):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Declared):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """A stream's chunk: the body's shape (one choice's new text per chunk)."""


# what each generation endpoint answers: (the JSON body, a stream's chunk)
GENERATION_RESPONSES = {"completions": (CompletionResponse, CompletionChunk),
                        "chat": (ChatCompletionResponse, ChatCompletionChunk)}
