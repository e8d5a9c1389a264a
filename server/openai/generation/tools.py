"""Tool calls on chat completions: the tools into the chat template, the model's calls out of
its text, and ``tool_choice`` enforced with structured output.

    tools = ToolRequest.of(req)          # validated tools and tool_choice (400 naming the field)
    tools.template_tools                 # what the chat template gets as ``tools`` (None: none)
    tools.grammar_spec()                 # "required" / a named function: the JSON the reply must be
    calls, content = tools.parse(text)   # the finished reply: tool calls and what is left as text
    stream = tools.stream()              # one per choice: stream.feed(delta) -> (content, tool deltas)

``tool_choice`` (OpenAI's, vLLM's behaviour):
- "none": the template still sees the tools (vLLM's default), the reply is text.
- "auto" (the default when tools are given): the reply is parsed as Granite writes calls,
  ``<|tool_call|>[{"name": ..., "arguments": {...}}]`` (Granite 3.0's token; 3.1 writes the string
  ``<tool_call>``; with ``skip_special_tokens`` the token is gone from the text and the reply
  starts at ``[``), as vLLM's granite tool parser reads it, or as Granite 4.0 writes them, one
  object a block: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (vLLM's hermes
  parser, which vLLM serves Granite 4.0 with); text that is neither is content.
- "required": the reply is constrained to a JSON list of ``{"name": one of the tools,
  "parameters": that tool's parameter schema}`` (at least one), vLLM's schema.
- {"type": "function", "function": {"name": N}}: the reply is constrained to N's parameter
  schema and is N's arguments.
``parallel_tool_calls: false`` allows one call: "required" asks for a list of one, "auto" keeps
the first call it reads.
So "required" and a named function hold whatever the weights (granite-tiny's are random).
A reply with tool calls has ``finish_reason`` "tool_calls" (unless it was cut: "length").

Streaming follows vLLM's delta shapes: a call's first delta carries ``index``, ``id``, ``type``
and ``function.name``, later ones ``index`` and ``function.arguments`` pieces. A named function's
arguments stream as the text comes; a list of calls ("auto", "required") is sent call by call,
each once its JSON object is complete (name and whole arguments in one delta).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.structured_output import request as structured
from spyre_serve.server.structured_output.grammars import GrammarSpec, json_spec
from spyre_serve.server.structured_output.request import check_json_schema

BOT_TOKEN = "<|tool_call|>"    # Granite 3.0
BOT_STRING = "<tool_call>"     # Granite 3.1, and each of Granite 4.0's calls
EOT_STRING = "</tool_call>"    # Granite 4.0: the end of one call
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    out = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    if index is not None:
        out["index"] = index
    return out


@dataclass
class ToolRequest:
    tools: list[dict]                       # each {"type": "function", "function": {...}}
    choice: str                             # "none" | "auto" | "required" | "named"
    named: str | None = None                # the function's name when choice is "named"
    by_name: dict[str, dict] = field(default_factory=dict)
    parallel: bool = True                   # parallel_tool_calls: false allows one call at most

    @classmethod
    def of(cls, req) -> ToolRequest | None:
        """The request's tools and tool_choice, checked; None when it has no tools and no choice."""
        tools, choice = req.tools, req.tool_choice
        if not tools:
            if choice in (None, "none"):
                return None
            raise APIError(400, "tool_choice needs tools: give the functions the model may call", "tool_choice")
        by_name: dict[str, dict] = {}
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise APIError(400, f"tools[{i}].function.name must be a non-empty string", "tools")
            if name in by_name:
                raise APIError(400, f"tools: two functions are named {name!r}", "tools")
            params = fn.get("parameters", EMPTY_PARAMETERS)
            if not isinstance(params, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
            by_name[name] = fn
        named = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, dict):
            fn = choice.get("function")
            named = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(named, str):
                raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                    '"function": {"name": ...}}', "tool_choice")
            if named not in by_name:
                raise APIError(400, f"tool_choice names {named!r}, which is not one of the tools "
                                    f"({', '.join(sorted(by_name))})", "tool_choice")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                           "tool_choice")
        return cls(list(tools), choice, named, by_name, getattr(req, "parallel_tool_calls", True))

    def check_schemas(self) -> None:
        """A 400 naming the first tool whose parameters are not a JSON schema (a cost that grows
        with the schemas: the chat endpoint runs it on a worker thread)."""
        for i, fn in enumerate(self.by_name.values()):
            check_json_schema(fn.get("parameters", EMPTY_PARAMETERS), f"tools[{i}].function.parameters", "tools")

    @property
    def template_tools(self) -> list[dict]:
        return self.tools

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def parameters(self, name: str) -> dict:
        return self.by_name[name].get("parameters", EMPTY_PARAMETERS)

    def grammar_spec(self) -> GrammarSpec | None:
        """The JSON the reply must be: a named function's arguments, or for "required" a list
        of calls (vLLM's schema); None for "auto" and "none"."""
        if self.choice == "named":
            return json_spec(self.parameters(self.named))
        if self.choice == "required":
            items = [{"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": self.parameters(name)},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name in self.by_name]
            return json_spec({"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                              "items": items[0] if len(items) == 1 else {"anyOf": items}})
        return None

    # ---- the finished reply ---------------------------------------------------------------
    def parse(self, text: str) -> tuple[list[dict], str | None]:
        """(tool calls, content) of a finished reply: ``content`` None when it is all calls."""
        if self.choice == "named":
            return [tool_call(self.named, text)], None
        if self.choice == "none":
            return [], text
        calls = parse_call_list(text, "parameters" if self.choice == "required" else "arguments")
        if calls is None and self.choice == "auto":
            calls = parse_tagged_calls(text)
        if calls is None:
            return [], text
        return [tool_call(name, args) for name, args in calls[:None if self.parallel else 1]], None

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _after_bot(text: str) -> str:
    """The text after leading spaces and Granite's tool-call marker (token or string)."""
    stripped = text.lstrip()
    for bot in (BOT_TOKEN, BOT_STRING):
        if stripped.startswith(bot):
            stripped = stripped[len(bot):].lstrip()
    return stripped


def parse_call_list(text: str, args_key: str) -> list[tuple[str, str]] | None:
    """[(name, arguments as JSON text)] of a JSON list of calls ``[{"name", args_key}]`` after
    Granite's marker, or None when the text is no such list (vLLM's granite parser)."""
    body = _after_bot(text)
    if not body.startswith("["):
        return None
    try:
        raw = json.loads(body)
    except ValueError:
        return None
    if not isinstance(raw, list):
        return None
    out = [_name_and_arguments(call, args_key) for call in raw]
    return None if None in out else out


def _name_and_arguments(call, args_key: str = "arguments") -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one parsed call object, or None when it is none."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    args = call.get(args_key, call.get("arguments", {}))
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _tagged_call(body: str) -> tuple[str, str] | None:
    """One of Granite 4.0's calls: the JSON object between ``<tool_call>`` and ``</tool_call>``."""
    try:
        return _name_and_arguments(json.loads(body))
    except ValueError:
        return None


def parse_tagged_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments as JSON text)] of Granite 4.0's calls: the reply a run of ``<tool_call>
    {object} </tool_call>`` blocks (the last may be unclosed, a reply cut at its end), or None
    when it is not that (vLLM's hermes parser)."""
    rest = text.lstrip()
    if not rest.startswith(BOT_STRING):
        return None
    out = []
    while rest:
        if not rest.startswith(BOT_STRING):
            return None
        body, _, rest = rest[len(BOT_STRING):].partition(EOT_STRING)
        call = _tagged_call(body)
        if call is None:
            return None
        out.append(call)
        rest = rest.lstrip()
    return out


class ListScanner:
    """The objects of a growing JSON list, found as the text grows: ``scan(text)`` reads only
    what was appended since the last call (a stream's deltas cost their own length, not the
    reply's), from the list's ``[`` at ``start``, and returns the objects completed by it."""

    def __init__(self, start: int = 0) -> None:
        self.pos = start           # the next character to read
        self.depth = 0
        self.in_string = self.escaped = False
        self.item_start: int | None = None
        self.closed = False        # the list's ``]`` was read

    def scan(self, text: str) -> list[str]:
        items = []
        for i in range(self.pos, len(text)):
            if self.closed:
                break
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                if self.depth == 1 and ch == "{":
                    self.item_start = i
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                elif self.depth == 1 and self.item_start is not None:
                    items.append(text[self.item_start:i + 1])
                    self.item_start = None
        self.pos = len(text)
        return items


def complete_items(body: str) -> tuple[list[str], bool]:
    """The objects of a JSON list ``body`` (starting at its ``[``) that are complete so far,
    as texts, and whether the list is closed."""
    scanner = ListScanner()
    return scanner.scan(body), scanner.closed


class ToolStream:
    """One streamed choice: ``feed(delta)`` -> (content delta or None, tool-call deltas)."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.text = ""
        self.mode = "named" if tools.choice == "named" else ("text" if tools.choice == "none" else None)
        self.sent = 0             # calls sent so far
        self.sent_text = 0        # characters of text sent as content
        self.scanner: ListScanner | None = None   # the list of calls, once the text is one
        self.tag_pos = 0          # tagged calls (Granite 4.0's): where the next block is looked for

    @property
    def called(self) -> bool:
        return self.sent > 0

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, list[dict]]:
        self.text += delta
        if self.mode == "named":
            return self._named(delta)
        if self.mode is None:
            body = _after_bot(self.text)
            stripped = self.text.lstrip()
            undecided = not body or BOT_TOKEN.startswith(stripped) or BOT_STRING.startswith(stripped)
            if undecided and not final:
                return None, []
            tagged = stripped.startswith(BOT_STRING) and body.startswith("{") and self.tools.choice == "auto"
            self.mode = "list" if body.startswith("[") else "tagged" if tagged else "text"
            if self.mode == "list":
                self.scanner = ListScanner(len(self.text) - len(body))
        if self.mode == "text":
            out = self.text[self.sent_text:]
            self.sent_text = len(self.text)
            return (out or None), []
        return None, self._tagged(final) if self.mode == "tagged" else self._list(final)

    def _tagged(self, final: bool) -> list[dict]:
        """Granite 4.0's calls completed by the text so far, each sent once its ``</tool_call>``
        arrives (at the end, an unclosed last one too)."""
        out = []
        while True:
            start = self.text.find(BOT_STRING, self.tag_pos)
            if start < 0:
                break
            end = self.text.find(EOT_STRING, start)
            if end < 0 and not final:
                break
            body = self.text[start + len(BOT_STRING):end if end >= 0 else len(self.text)]
            self.tag_pos = end + len(EOT_STRING) if end >= 0 else len(self.text)
            call = _tagged_call(body)
            if call is not None and (self.tools.parallel or self.sent == 0):
                out.append(tool_call(*call, index=self.sent))
                self.sent += 1
        return out

    def _named(self, delta: str) -> tuple[None, list[dict]]:
        if self.sent == 0:
            self.sent = 1
            return None, [tool_call(self.tools.named, delta, index=0)]
        if not delta:
            return None, []
        return None, [{"index": 0, "function": {"arguments": delta}}]

    def _list(self, final: bool) -> list[dict]:
        new = self.scanner.scan(self.text)
        key = "parameters" if self.tools.choice == "required" else "arguments"
        out = []
        if not self.tools.parallel:
            new = new[:max(0, 1 - self.sent)]
        for item in new:
            try:
                call = json.loads(item)
            except ValueError:
                continue
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                continue
            args = call.get(key, call.get("arguments", {}))
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append(tool_call(call["name"], args, index=self.sent))
            self.sent += 1
        return out

    def leftover(self) -> str | None:
        """At the end: text of a list that never parsed as calls, to send as content."""
        if self.mode in ("list", "tagged") and self.sent == 0:
            return self.text or None
        return None


# ---- the chat endpoint's choices, with tool calls ------------------------------------------

def finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that made calls and stopped by itself ends with "tool_calls" (OpenAI's, vLLM's)."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_choices(tools: ToolRequest | None, finished, streamed):
    """The chat endpoint's ``finished_choice`` and ``streamed_choice``, reading tool calls out of
    the reply when the request has tools to call (as they are otherwise)."""
    if tools is None or not tools.parses_calls:
        return finished, streamed

    def finished_with_calls(*args):
        choice = finished(*args)
        c = args[-1]
        calls, content = tools.parse(c.text)
        if calls:
            choice["message"]["content"] = content
            choice["message"]["tool_calls"] = calls
            choice["finish_reason"] = finish_reason(choice["finish_reason"], True)
        return choice

    streams: dict[int, ToolStream] = {}

    def streamed_with_calls(*args):
        choice = streamed(*args)
        idx, u = args[-2], args[-1]
        stream = streams.setdefault(idx, tools.stream())
        final = u.finish_reason is not None
        content, calls = stream.feed(u.text, final=final)
        if final:
            left = stream.leftover()
            content = (content or "") + (left or "") or None
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not final:
            delta = {"content": ""}
        choice["delta"] = delta
        choice["finish_reason"] = finish_reason(choice["finish_reason"], stream.called)
        return choice

    return finished_with_calls, streamed_with_calls


async def chat_structure(serving, req, tools: ToolRequest | None, params: list,
                         found: tuple[GrammarSpec, str] | None = None) -> list:
    """A chat request's grammar (a forced tool call's, or its structured output: ``found``, the
    spec and its field when the caller read it from a field of its own, else the request's
    structured-output fields') and logit bias into its choices' params; a 400 for both a
    forced call and a response format."""
    spec = tools.grammar_spec() if tools is not None else None
    found = found if found is not None else structured.grammar_spec(req)
    if spec is not None and found is not None:
        raise APIError(400, f"tool_choice {tools.choice!r} constrains the reply to tool calls: leave "
                            f"{found[1]} out", found[1])
    grammar = None
    if spec is not None:
        grammar = await structured.compile_grammar(serving, spec, "tools")
    elif found is not None:
        grammar = await structured.compile_grammar(serving, *found)
    return structured.apply(params, grammar, structured.logit_bias(req, serving.vocab_size))
