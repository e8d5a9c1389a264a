"""vLLM's runtime LoRA endpoints (only with ``--allow-runtime-lora``; without it they do not exist):

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

Answered as vLLM answers: 200 with a line of text on success; 400 for a missing field, a name
already loaded, or adapter files the server cannot serve (the message names the problem: rank
over --max-lora-rank, DoRA, a target module, a file whose safetensors header is malformed:
models/checkpoints/hf.py's CheckpointError); 404 for unloading an unknown name; 500 for anything
else, naming only the request id (the failure goes to the log under it).
A path is read only under --allowed-lora-root (``adapters.runtime_path``, checked off the event
loop); every path refused there gets one 400, whatever exists at it.
The engine (its own process, or this one's) reads the adapter and places it in its registry; the
slots on the card are filled when a request first uses it (models/lora/arena.py).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from spyre_serve.server.lora.adapters import lora_roots, refused_path, runtime_path
from spyre_serve.server.openai.body import read_request
from spyre_serve.server.openai.errors import APIError, internal_error, request_id_of
from spyre_serve.server.openai.generation.protocol import RequestModel
from spyre_serve.server.openai.openapi import route
from spyre_serve.server.openai.serving import serving_of

router = APIRouter()


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str | None = Field(None, description="the name requests give as `model` (required)")
    lora_path: str | None = Field(None, description="a PEFT adapter's directory on the server (required)")


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str | None = Field(None, description="the loaded adapter's name (required)")
    lora_int_id: int | None = Field(None, description="vLLM's; accepted and not used")


MODELS = [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]   # their schemas in /openapi.json


async def update(request: Request, engine, op: str, name: str, path: str | None, given: str | None = None) -> None:
    """Apply the change in the engine (its process, or this one's runner); APIError if refused
    (a message naming the real ``path`` names it as the client ``given`` it). The engine
    process's 500 (an exception the load did not expect) is logged here under the request id,
    which is all the client sees of it."""
    refused = await engine.lora_update(op, name, path)
    if refused is not None:
        status, message = refused
        if status >= 500 and status != 503:
            raise internal_error(f"{request.method} {request.url.path}: {message}", request_id_of(request))
        if path and given:
            message = message.replace(path, given)
        raise APIError(status, message, "lora_path" if status == 400 and op == "load" else "lora_name")


@router.post("/v1/load_lora_adapter", **route(LoadLoRAAdapterRequest, (400, 401, 413, 500)))
async def load_lora_adapter(request: Request):
    serving = serving_of(request)
    req = await read_request(request, LoadLoRAAdapterRequest, serving.settings.max_body_bytes,
                             serving.settings.strict_request_fields)
    if not req.lora_name or not req.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if req.lora_name in serving.loras.adapters or req.lora_name == serving.model_name:
        raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    real = await asyncio.to_thread(lambda: runtime_path(req.lora_path, lora_roots(serving.settings)))
    if real is None:
        raise APIError(400, refused_path(req.lora_path), "lora_path")
    await update(request, serving.engine, "load", req.lora_name, real, req.lora_path)
    serving.loras.add(req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", **route(UnloadLoRAAdapterRequest, (400, 401, 404, 413, 500)))
async def unload_lora_adapter(request: Request):
    serving = serving_of(request)
    req = await read_request(request, UnloadLoRAAdapterRequest, serving.settings.max_body_bytes,
                             serving.settings.strict_request_fields)
    if not req.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    if req.lora_name not in serving.loras.adapters:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
    await update(request, serving.engine, "unload", req.lora_name, None)
    serving.loras.adapters.pop(req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
