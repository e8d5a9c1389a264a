"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served tokenizer, as the
completion and chat endpoints use it (``/tokenize`` with ``messages`` renders the chat
template as ``/v1/chat/completions`` does), counting what the engine would get: special tokens
added to a prompt and not to a chat unless ``add_special_tokens`` says otherwise.

Named ``tokenization`` rather than ``tokenize``, which is a standard-library module.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request

from spyre_serve.server.openai.generation.prompts import chat_prompt, completion_prompts
from spyre_serve.server.openai.generation.protocol import DetokenizeRequest, TokenizeRequest
from spyre_serve.server.openai.openapi import BODY_ERRORS, route
from spyre_serve.server.openai.serving import serving_of

router = APIRouter()


@router.post("/tokenize", **route(TokenizeRequest, BODY_ERRORS))
async def tokenize(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, TokenizeRequest)
    if req.messages is not None:
        ids = await serving.blocking("rendering the chat template for these messages", "messages", chat_prompt,
                                     serving.tokenizer, req.messages, req.add_generation_prompt,
                                     req.chat_template_kwargs, req.special_tokens)
    else:
        [ids] = await serving.blocking("tokenizing the prompt", "prompt", completion_prompts, serving.tokenizer,
                                       req.prompt, req.special_tokens)
    return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}


@router.post("/detokenize", **route(DetokenizeRequest, BODY_ERRORS))
async def detokenize(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, DetokenizeRequest)
    serving.check_tokens(req.tokens, "tokens")
    text = await serving.blocking("decoding the tokens", "tokens", partial(serving.tokenizer.decode,
                                                                          skip_special_tokens=False), req.tokens)
    return {"prompt": text}
