"""``create_app``: the FastAPI app of the OpenAI API over one engine.

It builds what the endpoints share (``Serving``), puts the error handlers on, includes
each endpoint module's router, behind the API key except /health, /ping, /version,
/metrics and the load a router reads (/load, /get_load), puts ``X-Request-Id`` on every
response (``request_id``), and puts the request bodies' schemas into /openapi.json
(``openapi``). Everything else lives in the modules named in ``server/openai/__init__.py``.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from spyre_serve.server.engine.seams import EngineClient
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.lora import api as lora_api
from spyre_serve.server.openai import fleet, status, tokenization
from spyre_serve.server.openai.auth import GuardPaths, api_key_guard
from spyre_serve.server.openai.errors import install_error_handlers
from spyre_serve.server.openai.generation import chat, completions, render
from spyre_serve.server.openai.generation.prompts import free_variables
from spyre_serve.server.openai.generation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from spyre_serve.server.openai.generation.response_bodies import GENERATION_RESPONSES
from spyre_serve.server.openai.openapi import install_openapi, served_values
from spyre_serve.server.openai.pooling import api as embeddings
from spyre_serve.server.openai.pooling.protocol import EmbeddingRequest, ScoreRequest
from spyre_serve.server.openai.request_counts import CountRequests, RequestCounts
from spyre_serve.server.openai.request_id import RequestIdMiddleware
from spyre_serve.server.openai.responses import api as responses_api
from spyre_serve.server.openai.responses.request import ResponsesRequest
from spyre_serve.server.openai.serving import Serving


def create_app(engine: EngineClient, model, settings: Settings, metrics=None) -> FastAPI:
    """The app serving ``model`` (``models.LoadedModel``) through ``engine``, with the limits,
    the API key and the served name of ``settings``; ``metrics`` renders /metrics."""
    app = FastAPI(title="spyre-serve", version=status.version(),
                  description="OpenAI-compatible inference server (vLLM's fields) on an emulated Spyre card. "
                              "Every error is `{\"error\": {message, type, param, code}}`.")
    app.state.serving = Serving.for_model(engine, model, settings)
    app.state.metrics = metrics
    app.add_middleware(RequestIdMiddleware)
    app.state.request_counts = RequestCounts()     # spyre_api_requests_total in /metrics
    app.add_middleware(CountRequests, counts=app.state.request_counts)
    if settings.api_key is not None and settings.guard_metrics_and_docs:
        app.add_middleware(GuardPaths, api_key=settings.api_key)
    install_error_handlers(app)
    guarded = [Depends(api_key_guard(settings.api_key))]
    for module in (completions, chat, render, responses_api, embeddings, tokenization, status, fleet):
        app.include_router(module.router, dependencies=guarded)
    if settings.allow_runtime_lora:      # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: else no such routes
        app.include_router(lora_api.router, dependencies=guarded)
    app.include_router(status.open_router)
    app.include_router(fleet.open_router)
    serving = app.state.serving
    values = served_values(serving.model_name, serving.vocab_size, settings, free_variables(serving.tokenizer))
    answers = [m for pair in GENERATION_RESPONSES.values() for m in pair]
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, ScoreRequest,
                          TokenizeRequest, DetokenizeRequest, *answers,
                          *(lora_api.MODELS if settings.allow_runtime_lora else [])],
                    values)
    return app
