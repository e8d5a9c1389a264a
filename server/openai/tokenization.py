"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served tokenizer, as the
completion and chat endpoints use it (``/tokenize`` with ``messages`` renders the chat
template as ``/v1/chat/completions`` does).

Named ``tokenization`` rather than ``tokenize``, which is a standard-library module.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.openai.prompts import chat_prompt
from server.openai.protocol import DetokenizeRequest, TokenizeRequest
from server.openai.serving import serving_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, TokenizeRequest)
    if req.messages is not None:
        ids = chat_prompt(serving.tokenizer, req.messages, req.add_generation_prompt, None)
    else:
        ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.special_tokens)
    return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, DetokenizeRequest)
    serving.check_tokens(req.tokens, "tokens")
    return {"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=False)}
