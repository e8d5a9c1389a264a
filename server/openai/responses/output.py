"""The Responses API's answer: the response object, its output items, and the events of a
streamed one.

A response's ``output`` is one ``message`` item (the reply as ``output_text``) or, when the
request has tools and the reply is calls (``tools.ToolRequest.parse``, as the chat endpoint
reads them), one ``function_call`` item per call. Its ``status`` is "completed", or
"incomplete" with ``incomplete_details.reason`` "max_output_tokens" when the reply was cut
by its token limit (the last item is "incomplete" too). ``usage`` counts input and output
tokens; the engine does not say how many of a prompt's tokens came from the prefix cache, so
``cached_tokens`` (and ``cache_write_tokens``) is 0.

A stream (``ResponseEvents``) sends OpenAI's events, each ``event: <type>`` and its JSON with
``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``; per
item ``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` (one per engine update that brings text),
``response.output_text.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta`` and ``.done``, then ``response.output_item.done``;
last ``response.completed`` (or ``response.incomplete``) with the whole response, the one
stored. A failure ends it with an ``error`` event naming the request id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.sampling import NEUTRAL
from spyre_serve.server.openai.generation.sse import sse
from spyre_serve.server.openai.generation.tools import ToolRequest
from spyre_serve.server.openai.responses.request import (
    ITEMS,
    NamedFunction,
    ResponsesRequest,
    chat_messages,
)
from spyre_serve.server.openai.responses.store import ResponseStore, Stored


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"), "name": name,
            "arguments": arguments, "status": status}


def status_of(finish_reason: str | None) -> str:
    """A response's (and its last item's) status: cut by its token limit, or done."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(tools: ToolRequest | None, text: str, finish_reason: str | None) -> list[dict]:
    """A finished reply's output: its tool calls when the request has tools and the reply is
    calls, else one message."""
    calls, _ = tools.parse(text) if tools is not None and tools.parses_calls else ([], text)
    if not calls:
        return [message_item(text, status_of(finish_reason))]
    items = [function_call_item(c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    items[-1]["status"] = status_of(finish_reason)
    return items


def responses_usage(usage: dict) -> dict:
    """A submission's usage (``bridge.Submission.usage``) as the Responses API counts it."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"], **({"spyre": usage["spyre"]} if "spyre" in usage else {})}


@dataclass
class Answer:
    """One response being made: the fields every form of it carries (``base``), where it is
    kept when done (None: ``store: false``), and the conversation before its output (the
    previous response's and its input's messages)."""

    id: str
    base: dict
    store: ResponseStore | None
    conversation: list[dict]

    @classmethod
    def of(cls, response_id: str, req: ResponsesRequest, model: str, defaults: dict, store: ResponseStore,
           conversation: list[dict]) -> Answer:
        """For ``req``, served as ``model`` with the sampling ``defaults`` of its
        generation_config.json (the temperature and top_p a request leaves unset)."""
        unset = {**NEUTRAL, **defaults}
        choice = req.tool_choice
        base = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id,
                "temperature": unset["temperature"] if req.temperature is None else req.temperature,
                "top_p": unset["top_p"] if req.top_p is None else req.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls, "text": req.format_dict(), "store": req.store,
                "metadata": req.metadata or {}, "user": req.user, "truncation": "disabled", "background": False,
                "error": None}
        return cls(response_id, base, store if req.store else None, conversation)

    def body(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.base, "status": status, "incomplete_details": details, "output": output, "usage": usage}

    def finish(self, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
        """The finished response (``usage``: the submission's), stored unless ``store: false``."""
        body = self.body(status_of(finish_reason), output, responses_usage(usage))
        if self.store is not None:
            self.store.put(self.id, Stored(body, self.conversation + chat_messages(ITEMS.validate_python(output))))
        return body


class ResponseEvents:
    """A streamed response's events, made from its engine updates as they come (``events``):
    the items stream as the reply's text, or its tool calls (``tools.ToolStream``), arrive."""

    def __init__(self, answer: Answer, tools: ToolRequest | None) -> None:
        self.answer = answer
        self.calls = tools.stream() if tools is not None and tools.parses_calls else None
        self.number = 0               # the next event's sequence_number
        self.output: list[dict] = []  # the items so far, the last one open while ``streaming``
        self.streaming = False

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return sse(payload, kind)

    def opening(self) -> Iterator[str]:
        shell = self.answer.body("in_progress", [])
        yield self.event("response.created", response=shell)
        yield self.event("response.in_progress", response=shell)

    def events(self, _idx: int, u: SeqUpdate) -> Iterator[str]:
        """The events of one engine update: its text, or the calls it completes."""
        text, calls = u.text, []
        if self.calls is not None:
            final = u.finish_reason is not None
            text, calls = self.calls.feed(u.text, final=final)
            text = (text or "") + ((self.calls.leftover() or "") if final else "")
        if text:
            yield from self.text(text)
        for delta in calls:
            yield from self.call(delta)

    def text(self, delta: str) -> Iterator[str]:
        if not (self.streaming and self.output[-1]["type"] == "message"):
            yield from self.message()
        self.output[-1]["content"][0]["text"] += delta
        yield self.event("response.output_text.delta", **self.where(), content_index=0, delta=delta, logprobs=[])

    def call(self, delta: dict) -> Iterator[str]:
        """A tool-call delta (the chat stream's): a new call's carries its name."""
        fn = delta["function"]
        if "name" in fn:
            yield from self.added(function_call_item(fn["name"], "", "in_progress"))
        if fn.get("arguments"):
            self.output[-1]["arguments"] += fn["arguments"]
            yield self.event("response.function_call_arguments.delta", **self.where(), delta=fn["arguments"])

    def message(self) -> Iterator[str]:
        """A new message item, and its text part, opened."""
        yield from self.added(message_item("", "in_progress"))
        yield self.event("response.content_part.added", **self.where(), content_index=0, part=text_part(""))

    def where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def added(self, item: dict) -> Iterator[str]:
        yield from self.done("completed")
        self.output.append(item)
        self.streaming = True
        yield self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def done(self, status: str) -> Iterator[str]:
        """The open item's closing events, if one is open."""
        if not self.streaming:
            return
        item = self.output[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event("response.output_text.done", **self.where(), content_index=0, text=part["text"],
                             logprobs=[])
            yield self.event("response.content_part.done", **self.where(), content_index=0, part=part)
        else:
            yield self.event("response.function_call_arguments.done", **self.where(), arguments=item["arguments"])
        self.streaming = False
        yield self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def closing(self, finish_reason: str | None, usage: dict) -> Iterator[str]:
        """The last item closed (an empty message when there was no output), then the whole
        response, stored."""
        if not self.output:
            yield from self.message()
        yield from self.done(status_of(finish_reason))
        body = self.answer.finish(self.output, finish_reason, usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=body)

    def failed(self, err: APIError) -> str:
        """The ``error`` event that ends a failed stream."""
        return self.event("error", code=str(err.status), message=err.message, param=err.param)
