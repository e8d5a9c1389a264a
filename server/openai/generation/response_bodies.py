"""The response bodies of the generation endpoints, as pydantic models (OpenAI's and vLLM's
shapes): ``/openapi.json`` documents them, and the tests validate every answer the server gives
against them (``extra="forbid"``: a field the handlers add that is not declared here fails).

The handlers build the bodies as dicts on the hot path (a stream's chunk is one dict per
token); these models are the declaration those dicts keep to, not a conversion step.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class Declared(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpyreUsage(Declared):
    """What the request's steps take on a real Spyre card, projected from their shapes
    (models/sizing/projection.py; bridge.spyre_usage): seconds to the first token, per later token
    (the mean), and in all."""

    projected_ttft_seconds: float
    projected_tpot_seconds: float
    projected_seconds: float


class Usage(Declared):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spyre: SpyreUsage | None = None   # when the engine projects its steps (a ModelRunner does)


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


# ---- the Responses API (/v1/responses: responses_api.py) ------------------------------------

class OutputText(Declared):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(Declared):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(Declared):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class ResponsesUsage(Declared):
    input_tokens: int
    input_tokens_details: dict[Literal["cached_tokens", "cache_write_tokens"], int]
    output_tokens: int
    output_tokens_details: dict[Literal["reasoning_tokens"], int]
    total_tokens: int
    spyre: SpyreUsage | None = None


class ResponsesResponse(Declared):
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[Literal["reason"], Literal["max_output_tokens"]] | None
    error: None
    output: list[OutputItem]
    usage: ResponsesUsage | None  # None while in progress
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Literal["none", "auto", "required"] | dict[str, str]
    parallel_tool_calls: bool
    text: dict[Literal["format"], dict[str, Any]]
    store: bool
    metadata: dict[str, str]
    user: str | None
    truncation: Literal["disabled"]
    background: Literal[False]


class Event(Declared):
    sequence_number: int


class ResponseLifecycleEvent(Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponsesResponse


class OutputItemEvent(Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ItemEvent(Event):
    item_id: str
    output_index: int


class ContentPartEvent(ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int
    part: OutputText


class TextDeltaEvent(ItemEvent):
    type: Literal["response.output_text.delta"]
    content_index: int
    delta: str
    logprobs: list[Any]


class TextDoneEvent(ItemEvent):
    type: Literal["response.output_text.done"]
    content_index: int
    text: str
    logprobs: list[Any]


class ArgumentsDeltaEvent(ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str


class ArgumentsDoneEvent(ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    arguments: str


class ErrorEvent(Event):
    type: Literal["error"]
    code: str
    message: str
    param: str | None


class ResponseStreamEvent(RootModel[Annotated[
        ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
        | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent, Field(discriminator="type")]]):
    """One event of a streamed response (``event: <type>``, its data this)."""


# what each generation endpoint answers: (the JSON body, a stream's chunk or event)
GENERATION_RESPONSES = {"completions": (CompletionResponse, CompletionChunk),
                        "chat": (ChatCompletionResponse, ChatCompletionChunk),
                        "responses": (ResponsesResponse, ResponseStreamEvent)}
