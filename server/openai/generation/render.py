"""vLLM's render endpoints: a generation request's prompt token ids, without generating.

    POST /v1/completions/render       a completion's body -> [{"token_ids": [...], ...}, ...], one per prompt
    POST /v1/chat/completions/render  a chat's body       -> {"token_ids": [...], ...}

A prefix-aware router (vllm-router's ``cache_aware``, the Inference Extension's token producer)
asks for them before it picks a replica, so that it matches prompts by the tokens this model
reads rather than by characters. The prompt comes out exactly as the generation endpoint would
make it (the same tokenizer, chat template, tools, special tokens and ``truncate_prompt_tokens``)
and is checked as it would be before it is submitted (the body, the caps, the vocabulary), with
the same errors; nothing is submitted to the engine, so a prompt longer than the context is
refused by the generation, not here.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_serve.server.openai.generation import chat, completions
from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from spyre_serve.server.openai.generation.tools import ToolRequest
from spyre_serve.server.openai.openapi import BODY_ERRORS, route
from spyre_serve.server.openai.request_id import request_ids
from spyre_serve.server.openai.serving import Serving, serving_of

router = APIRouter()


@router.post("/v1/completions/render", **route(CompletionRequest, BODY_ERRORS))
async def render_completion(request: Request):
    serving = serving_of(request)
    _, request_id = request_ids(request, "cmpl")
    req = await serving.read(request, CompletionRequest)
    serving.check_limits(req)
    prompts = await completions.prompt_ids(serving, req)
    return [rendered(serving, req, f"{request_id}-{i}", ids) for i, ids in enumerate(prompts)]


@router.post("/v1/chat/completions/render", **route(ChatCompletionRequest, BODY_ERRORS))
async def render_chat_completion(request: Request):
    serving = serving_of(request)
    _, request_id = request_ids(request, "chatcmpl")
    req = await serving.read(request, ChatCompletionRequest)
    serving.check_limits(req)
    ids = await chat.prompt_ids(serving, req, ToolRequest.of(req))
    return rendered(serving, req, request_id, ids)


def rendered(serving: Serving, req: SamplingRequest, request_id: str, ids: list[int]) -> dict:
    """One prompt as vLLM's render answers it (its ``GenerateRequest`` fields that a text model has)."""
    return {"request_id": request_id, "model": serving.answered_as(req.model), "token_ids": ids, "features": None,
            "cache_salt": req.cache_salt, "priority": req.priority}
