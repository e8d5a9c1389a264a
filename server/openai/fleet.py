"""What a router in front of several replicas asks one of them, beside /health and /metrics.

    GET /get_model_info, /model_info    the model: its path, its served name, whether it generates
    GET /get_server_info, /server_info  that, and the engine's sizes (block size, batch, context, cards)
    GET /get_load                       {"load": N}           (SGLang's, vllm-router's power_of_two)
    GET /load                           {"server_load": N}    (vLLM's)

N is the requests the engine holds, waiting or running: what the replica still has to do. The
load routes are open like /health (a count, nothing else); the information routes are behind
the API key like /v1. A request's token ids for a prefix-aware router come from the render
endpoints (``generation/render.py``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_serve.server.openai.serving import Serving, serving_of, version

router = APIRouter()
open_router = APIRouter()


def model_info(serving: Serving) -> dict:
    return {"model_path": serving.model_root, "tokenizer_path": serving.model_root,
            "served_model_name": serving.model_name, "is_generation": serving.engine.pooling is None,
            "max_model_len": serving.engine.max_model_len}


def server_info(serving: Serving) -> dict:
    s = serving.settings
    return {**model_info(serving), "version": version(), "numerics": serving.engine.numerics,
            "kv_block_size": s.block_size, "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens, "enable_prefix_caching": s.enable_prefix_caching,
            "tp_size": s.tensor_parallel_size, "dp_size": 1}


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request):
    """The served model (SGLang's /get_model_info shape, which routers read)."""
    return model_info(serving_of(request))


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request):
    """The model and the engine's sizes."""
    return server_info(serving_of(request))


@open_router.get("/get_load")
async def get_load(request: Request):
    """``{"load": N}``: the requests the engine holds, waiting or running."""
    return {"load": serving_of(request).engine.num_requests}


@open_router.get("/load")
async def load(request: Request):
    """vLLM's ``{"server_load": N}``: the same count."""
    return {"server_load": serving_of(request).engine.num_requests}
