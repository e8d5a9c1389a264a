"""``POST /v1/chat/completions``: chat (vLLM's fields), one JSON body or a stream.

The messages go through the tokenizer's chat template (``prompts.chat_prompt``, off the
event loop), whose text is encoded without special tokens unless ``add_special_tokens``; the
answer is an assistant message (no tool calls yet). A stream opens with one chunk per choice
naming the role, as OpenAI's does; a chunk's choice carries the new text as ``delta``.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request

from server.engine import SeqUpdate
from server.openai.bridge import Choice
from server.openai.errors import APIError
from server.openai.logprobs import TokenTexts, chat_logprobs
from server.openai.openapi import GENERATION_ERRORS, route
from server.openai.prompts import chat_prompt, truncated
from server.openai.protocol import ChatCompletionRequest
from server.openai.response import full_response, new_head, stream_response
from server.openai.sampling import generation_params
from server.openai.serving import serving_of
from server.openai.tools import ToolRequest, chat_structure, tool_choices

router = APIRouter()


@router.post("/v1/chat/completions", **route(ChatCompletionRequest, GENERATION_ERRORS, streams=True))
async def create_chat_completion(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, ChatCompletionRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    serving.check_limits(req)
    tools = ToolRequest.of(req)
    ids = await serving.blocking("rendering the chat template for these messages", "messages", chat_prompt,
                                 serving.tokenizer, req.messages, req.add_generation_prompt,
                                 req.chat_template_kwargs, req.add_special_tokens,
                                 tools.template_tools if tools is not None else None)
    [ids] = truncated([ids], req.truncate_prompt_tokens, serving.engine.max_model_len)
    serving.check_tokens(ids, "messages")
    max_tokens = serving.max_tokens(req.output_limit, [ids])
    k = (req.top_logprobs or 0) if req.logprobs else None  # top alternatives per token; None: no logprobs
    params = generation_params(req, max_tokens, k, prompt_logprobs=False, vocab_size=serving.vocab_size)
    await chat_structure(serving, req, tools, params)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    serving.check_fits(ids, params, {"prompt": "messages", "max_tokens": limit_param})
    serving.check_admission(req.n)
    finished, streamed = tool_choices(tools, finished_choice, streamed_choice)
    head = new_head("chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion", serving.model_name)
    sub = serving.submit(head["id"], [ids], params)
    if req.stream:
        return stream_response(sub, head, req.stream_usage, partial(streamed, serving.texts, k),
                               opening_choices(len(sub.choices)))
    return await full_response(sub, request.is_disconnected, head, partial(finished, serving.texts, k))


def message_logprobs(texts: TokenTexts, k: int | None, logprobs: list, ids: list[int]) -> dict | None:
    return {"content": chat_logprobs(texts, logprobs, ids, k)} if k is not None else None


def finished_choice(texts: TokenTexts, k: int | None, idx: int, c: Choice) -> dict:
    """A choice of the JSON body: the whole assistant message."""
    return {
        "index": idx,
        "message": {"role": "assistant", "content": c.text, "tool_calls": []},
        "logprobs": message_logprobs(texts, k, c.logprobs, c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def opening_choices(n: int) -> list[dict]:
    """The first chunk of each choice: the role, no text yet."""
    return [{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for idx in range(n)]


def streamed_choice(texts: TokenTexts, k: int | None, idx: int, u: SeqUpdate) -> dict:
    """A chunk's choice: the update's text as ``delta`` (an empty delta on a finish without
    text), and ``stop_reason`` once finished."""
    delta = {"content": u.text} if (u.text or u.finish_reason is None) else {}
    choice = {"index": idx, "delta": delta, "logprobs": message_logprobs(texts, k, u.logprobs, u.token_ids),
              "finish_reason": u.finish_reason}
    if u.finish_reason is not None:
        choice["stop_reason"] = u.stop_reason
    return choice
