"""``POST /v1/responses``'s body (OpenAI's Responses API), validated with pydantic, and the
chat request it runs as.

A response is made as a chat (``responses_api``): ``instructions`` become a system message
first, then come the previous response's turns (``previous_response_id``), then ``input``: a
string is one user message; a list holds messages (role user, system, developer or
assistant; content a string or ``input_text`` parts, or an earlier answer's ``output_text``
parts), ``function_call`` items (an assistant's tool calls: those in a row, after an
assistant's message or not, are one turn) and ``function_call_output`` items (a tool message
answering one). An earlier response's ``output`` items may be sent back as they came.
Function tools come in the Responses API's flat shape and go to the chat as ``{"type":
"function", "function": {...}}``, ``tool_choice`` likewise; ``text.format`` is structured
output (``text_format``). The sampling fields are checked by the chat request
(``protocol.ChatCompletionRequest``: same names, same ranges).

As in protocol.py a field this server does not know is refused by name, and those of
OpenAI's it does not act on (``UNSUPPORTED``) are accepted only at their neutral values.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator

from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.errors import validation_error
from spyre_serve.server.openai.fields import (
    Integer,
    integer_at_least,
    neutral,
    range_schema,
    refuse_unless_neutral,
)
from spyre_serve.server.openai.generation.protocol import (
    FAIL_FAST,
    ChatCompletionRequest,
    RequestModel,
)
from spyre_serve.server.openai.limits import check_schema_size
from spyre_serve.server.structured_output.grammars import GrammarSpec, json_spec

FORMAT = "text.format"  # the field structured output comes from (errors name it)

# OpenAI's fields this server does not act on: (their neutral values, what they are)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "background": ((None, False), "background (answered later, polled)"),
    "conversation": ((None,), "conversation (OpenAI's stored conversations; previous_response_id chains responses)"),
    "include": ((None, []), "include (extra output data)"),
    "max_tool_calls": ((None,), "max_tool_calls"),
    "prompt": ((None,), "prompt (a stored prompt template)"),
    "prompt_cache_key": ((None,), "prompt_cache_key (prefix caching needs no key here)"),
    "reasoning": ((None,), "reasoning (a reasoning model's options)"),
    "safety_identifier": ((None,), "safety_identifier"),
    "service_tier": ((None, "auto", "default"), "service_tier"),
    "top_logprobs": ((None, 0), "top_logprobs (the output's log probabilities)"),
    "truncation": ((None, "disabled"), "truncation \"auto\" (input that does not fit is a 400)"),
    "verbosity": ((None, "medium"), "text.verbosity"),
}
MAX_METADATA = (16, 64, 512)  # OpenAI's: pairs, characters of a key, characters of a value


class ContentPart(RequestModel):
    """A message's text: ``input_text``, or ``output_text`` of an earlier answer sent back
    (its annotations and logprobs come with it and change nothing)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Annotated[list[Any], FAIL_FAST] | None = None
    logprobs: Annotated[list[Any], FAIL_FAST] | None = None


Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], FAIL_FAST]
    id: str | None = None
    status: Status | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made (an earlier response's ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(RequestModel):
    """What the client's function returned for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | Annotated[list[ContentPart], FAIL_FAST]
    id: str | None = None
    status: Status | None = None


def _item_type(item) -> str | None:
    """An input item's kind: its ``type`` (a message may leave it out, as OpenAI's easy form)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


def _input_kind(value) -> str:
    """Which form ``input`` takes, so that a list's errors are its own, not a string's ("str"
    and "list" are left out of the error's field path)."""
    return "str" if isinstance(value, str) else "list"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="input_item",
                                    custom_error_message="an input item is a message, a function_call or a "
                                                         "function_call_output (by its \"type\")")]
ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")] | None = None
    verbosity: Annotated[str | None, neutral("verbosity", UNSUPPORTED)] = None

    @field_validator("verbosity")
    @classmethod
    def _unsupported(cls, v, info):
        return refuse_unless_neutral(v, info, UNSUPPORTED)


class ResponsesRequest(RequestModel):
    task: ClassVar[str] = "generate"    # served by a generating runner only, as a chat is
    model: str | None = None
    input: Annotated[Annotated[str, Tag("str")]
                     | Annotated[list[InputItem], Field(min_length=1), FAIL_FAST, Tag("list")],
                     Discriminator(_input_kind)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: integer_at_least(1) | None = None
    temperature: Annotated[float | None, range_schema("temperature")] = None
    top_p: Annotated[float | None, range_schema("top_p")] = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], FAIL_FAST] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    metadata: Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA[1])],
                             Annotated[str, Field(max_length=MAX_METADATA[2])]] | None,
                        Field(max_length=MAX_METADATA[0])] = None
    user: str | None = None  # OpenAI's end-user id, for the caller's own records: no effect
    # vLLM's extra fields, as a chat takes them (guidellm sends stop and ignore_eos on every
    # request to get exactly max_output_tokens); checked by the chat they are handed to
    priority: Integer = 0
    cache_salt: str | None = None
    top_k: Integer | None = None
    seed: Integer | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    background: Annotated[bool | None, neutral("background", UNSUPPORTED)] = None
    conversation: Annotated[Any, neutral("conversation", UNSUPPORTED)] = None
    include: Annotated[list[str] | None, neutral("include", UNSUPPORTED)] = None
    max_tool_calls: Annotated[Integer | None, neutral("max_tool_calls", UNSUPPORTED)] = None
    prompt: Annotated[Any, neutral("prompt", UNSUPPORTED)] = None
    prompt_cache_key: Annotated[str | None, neutral("prompt_cache_key", UNSUPPORTED)] = None
    reasoning: Annotated[Any, neutral("reasoning", UNSUPPORTED)] = None
    safety_identifier: Annotated[str | None, neutral("safety_identifier", UNSUPPORTED)] = None
    service_tier: Annotated[str | None, neutral("service_tier", UNSUPPORTED)] = None
    top_logprobs: Annotated[Integer | None, neutral("top_logprobs", UNSUPPORTED)] = None
    truncation: Annotated[str | None, neutral("truncation", UNSUPPORTED)] = None

    @field_validator(*(f for f in UNSUPPORTED if f != "verbosity"))
    @classmethod
    def _unsupported(cls, v, info):
        return refuse_unless_neutral(v, info, UNSUPPORTED)

    def format_dict(self) -> dict:
        """``text`` as the response object reports it (``{"format": {"type": "text"}}`` by default)."""
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}


def chat_messages(items: str | list) -> list[dict]:
    """``input`` (or an earlier response's ``output`` items, validated as ``ITEMS``) as chat
    messages: dicts of ``protocol.ChatMessage``'s fields."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":   # one turn: the message and its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return out


def as_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat that makes ``req``'s response: its instructions, ``history`` (the previous
    response's conversation), its input; and the messages its input adds. A value the chat
    refuses (a temperature out of range...) is a 400 naming the field, which has the same
    name in both."""
    turns = chat_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif not tools and choice in ("auto", "none"):   # OpenAI's default without tools: nothing to call
        choice = None
    body = {"messages": system + history + turns, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "stream": req.stream,
            "tools": tools or None, "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
            "priority": req.priority, "cache_salt": req.cache_salt, "top_k": req.top_k, "seed": req.seed,
            "stop": req.stop, "ignore_eos": req.ignore_eos, "model": req.model}
    try:
        return ChatCompletionRequest.model_validate(body), turns
    except ValidationError as exc:
        raise validation_error(exc) from None


def text_format(req: ResponsesRequest, settings: Settings) -> tuple[GrammarSpec, str] | None:
    """``text.format`` as structured output (the grammar's spec, and ``FORMAT`` for the errors
    to name), None for text; a JSON schema is held to ``--max-schema-bytes`` as
    ``response_format``'s is."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_spec({"type": "object"}), FORMAT
    check_schema_size(fmt.schema_, FORMAT, settings)
    return json_spec(fmt.schema_), FORMAT
