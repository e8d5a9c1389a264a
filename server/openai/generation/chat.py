"""``POST /v1/chat/completions``: chat (vLLM's fields), one JSON body or a stream.

The messages go through the tokenizer's chat template (``prompts.chat_prompt``, off the
event loop), whose text is encoded without special tokens unless ``add_special_tokens``; the
answer is an assistant message (its tool calls read out of it when the request has tools:
``tools.py``), or with ``add_generation_prompt`` false a
message of the last message's role, which it goes on (vLLM's rule). With ``echo`` (vLLM's) the
last message's content starts the answer when it has the answer's role. A stream opens with
one chunk per choice naming the role, as OpenAI's does (then the echo, one chunk per choice);
a chunk's choice carries the new text as ``delta``.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.bridge import Choice, Submission
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.logprobs import TokenTexts, chat_logprobs
from spyre_serve.server.openai.generation.prompts import chat_prompt
from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest
from spyre_serve.server.openai.generation.reply import (
    encoded,
    full_response,
    new_head,
    stream_response,
)
from spyre_serve.server.openai.generation.response_bodies import GENERATION_RESPONSES
from spyre_serve.server.openai.generation.sampling import generation_params
from spyre_serve.server.openai.generation.tools import ToolRequest, chat_structure, tool_choices
from spyre_serve.server.openai.openapi import GENERATION_ERRORS, route
from spyre_serve.server.openai.request_id import request_ids
from spyre_serve.server.openai.serving import Serving, serving_of
from spyre_serve.server.structured_output.grammars import GrammarSpec

router = APIRouter()


@router.post("/v1/chat/completions", **route(ChatCompletionRequest, GENERATION_ERRORS, streams=True,
                    answers=GENERATION_RESPONSES["chat"]))
async def create_chat_completion(request: Request):
    serving = serving_of(request)
    response_id, engine_id = request_ids(request, "chatcmpl")
    serving.check_admission(1)          # before the body is read: a full queue costs nothing
    req = await serving.read(request, ChatCompletionRequest)
    sub, tools = await start_chat(serving, req, engine_id)
    k = top_logprobs(req)
    finished, streamed = tool_choices(tools, finished_choice, streamed_choice)
    head = new_head("chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion",
                    serving.answered_as(req.model), serving.fingerprint, response_id)
    role = reply_role(req)
    echo = echoed(req, role)
    if req.stream:
        return stream_response(sub, head, req.stream_usage, partial(streamed, serving.texts, k),
                               opening_choices(len(sub.choices), role, echo))
    return encoded(await full_response(sub, request.is_disconnected, head,
                                       partial(finished, serving.texts, k, role, echo)))


async def start_chat(serving: Serving, req: ChatCompletionRequest, engine_id: str, input_param: str = "messages",
                     limit_param: str | None = None,
                     found: tuple[GrammarSpec, str] | None = None) -> tuple[Submission, ToolRequest | None]:
    """A chat's submission and its tools (None without): the request checked against the caps,
    its messages rendered by the chat template and tokenized, its choices' parameters (its
    grammar: a forced tool call's, or ``found`` when the caller read the structured output
    itself, else the request's fields), then started. The errors name ``input_param`` for the
    messages and ``limit_param`` for the output limit (the Responses API's ``input`` and
    ``max_output_tokens``)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    serving.check_limits(req)
    tools = ToolRequest.of(req)
    if tools is not None:
        await serving.blocking("checking the tools' JSON schemas", "tools", tools.check_schemas)
    ids = await prompt_ids(serving, req, tools, input_param)
    max_tokens = serving.max_tokens(req.output_limit, [ids])
    params = generation_params(req, max_tokens, top_logprobs(req), prompt_logprobs=False,
                               vocab_size=serving.vocab_size, defaults=serving.defaults)
    await chat_structure(serving, req, tools, params, found)
    if limit_param is None:
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return serving.start(engine_id, [ids], params, {"prompt": input_param, "max_tokens": limit_param},
                         model=req.model), tools


async def prompt_ids(serving: Serving, req: ChatCompletionRequest, tools: ToolRequest | None,
                     input_param: str = "messages") -> list[int]:
    """The chat's prompt as token ids, rendered by the chat template with its tools (a request
    within the caps: ``Serving.check_limits``; also /v1/chat/completions/render's); errors name
    ``input_param``."""
    serving.check_text_fits(["".join(message_texts(req.messages))], input_param, req.truncate_prompt_tokens)
    [ids] = await serving.prompt_ids("rendering the chat template for these messages", input_param,
                                     chat_prompts, serving.tokenizer, req.messages, req.add_generation_prompt,
                                     req.chat_template_kwargs, req.add_special_tokens,
                                     tools.template_tools if tools is not None else None,
                                     truncate=req.truncate_prompt_tokens)
    return ids


def top_logprobs(req: ChatCompletionRequest) -> int | None:
    """How many top alternatives each token's logprobs list; None: no logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


def message_texts(messages) -> list[str]:
    """Every text of a chat's messages (contents, text parts)."""
    out = []
    for m in messages:
        if isinstance(m.content, str):
            out.append(m.content)
        elif m.content:
            out.extend(part.text for part in m.content)
    return out


def chat_prompts(*args) -> list[list[int]]:
    """The chat's one prompt (``chat_prompt``), as the list ``Serving.prompt_ids`` takes."""
    return [chat_prompt(*args)]


def reply_role(req: ChatCompletionRequest) -> str:
    """The answer's role (vLLM's): the assistant's after a generation prompt, else the last
    message's, which the answer goes on."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echoed(req: ChatCompletionRequest, role: str) -> str:
    """What ``echo`` puts before the answer (vLLM's): the last message's content when that
    message has the answer's role, else nothing."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == role else ""


def message_logprobs(texts: TokenTexts, k: int | None, logprobs: list, ids: list[int]) -> dict | None:
    return {"content": chat_logprobs(texts, logprobs, ids, k)} if k is not None else None


def finished_choice(texts: TokenTexts, k: int | None, role: str, echo: str, idx: int, c: Choice) -> dict:
    """A choice of the JSON body: the whole message, after the echo."""
    return {
        "index": idx,
        "message": {"role": role, "content": echo + c.text, "tool_calls": []},
        "logprobs": message_logprobs(texts, k, c.logprobs, c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def opening_choices(n: int, role: str = "assistant", echo: str = "") -> list[dict]:
    """The first chunk of each choice: the role, no text yet; then, with an echo, one chunk
    of each choice with it (vLLM's order)."""
    chunks = [{"index": idx, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
              for idx in range(n)]
    if echo:
        chunks += [{"index": idx, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                   for idx in range(n)]
    return chunks


def streamed_choice(texts: TokenTexts, k: int | None, idx: int, u: SeqUpdate) -> dict:
    """A chunk's choice: the update's text as ``delta`` (an empty delta on a finish without
    text), and ``stop_reason`` once finished."""
    delta = {"content": u.text} if (u.text or u.finish_reason is None) else {}
    choice = {"index": idx, "delta": delta, "logprobs": message_logprobs(texts, k, u.logprobs, u.token_ids),
              "finish_reason": u.finish_reason}
    if u.finish_reason is not None:
        choice["stop_reason"] = u.stop_reason
    return choice
