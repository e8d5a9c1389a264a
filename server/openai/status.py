"""What the server serves and whether it is up: ``GET /v1/models``, ``/health`` (and vLLM's
``/ping``, GET or POST), ``/version``, ``/metrics``.

``router`` (/v1/models) is guarded by the API key like the other /v1 routes; ``open_router``
(/health, /ping, /version, /metrics) is not, so that load balancers and Prometheus need no key.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spyre_serve.server.openai.errors import APIError, error_response
from spyre_serve.server.openai.openapi import errors
from spyre_serve.server.openai.serving import RETRY_AFTER_SECONDS, serving_of, version

router = APIRouter()
open_router = APIRouter()


@router.get("/v1/models", responses=errors(401, 500))
async def list_models(request: Request):
    """The base model, then each LoRA adapter (its ``root`` its path, its ``parent`` the base), as vLLM lists them."""
    serving = serving_of(request)
    created = int(time.time())

    def card(name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "spyre-serve", "root": root,
                "parent": parent, "max_model_len": serving.engine.max_model_len}

    adapters = [card(name, path, serving.model_name) for name, (_, path) in serving.loras.adapters.items()]
    return {"object": "list", "data": [card(serving.model_name, serving.model_root, None), *adapters]}


@open_router.get("/version")
async def get_version():
    """``{"version": ...}``, as vLLM answers."""
    return {"version": version()}


@open_router.get("/health", responses=errors(503))
async def health(request: Request):
    """200 while the engine loop runs and admits requests, with the threads that render and
    tokenize (``{"offload": {workers, busy, waiting, refused}}``: all busy means new requests
    wait, then get 503); 503 otherwise. What stopped the engine is in the server's log (the
    engine logs it as it dies), not in the answer."""
    serving = serving_of(request)
    engine = serving.engine
    if not engine.alive:
        return error_response(APIError(503, "the engine loop is not running (the server's log says why)"))
    if not engine.accepting:
        return error_response(APIError(503, "the server is shutting down", retry_after=RETRY_AFTER_SECONDS))
    return {"offload": serving.offload.stats()}


@open_router.get("/ping", responses=errors(503))
@open_router.post("/ping", responses=errors(503))
async def ping(request: Request):
    """vLLM's /ping (SageMaker's health check, GET or POST): /health's answer."""
    return await health(request)


@open_router.get("/metrics")
async def metrics(request: Request):
    """Prometheus's text format (empty when the app was made without metrics)."""
    source = request.app.state.metrics
    if source is None:
        return Response("", media_type="text/plain")
    body, content_type = await source.render_async()
    return Response(body, media_type=content_type)
