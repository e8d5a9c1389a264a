"""What every endpoint shares, and the checks each makes before it submits.

One ``Serving`` per app (``app.state.serving``, read with ``serving_of``): the engine, the
tokenizer, the name clients use for the model, the settings' limits. Its checks refuse a
request before the engine sees it, each with the status and numbers that say why: an
unknown model (404), a token id outside the vocabulary, a request that can never fit the
context or the KV cache (400), an engine that is down, draining or has too many requests
waiting (503 + Retry-After).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from server.engine import Engine, RequestRejected
from server.openai.body import Body, read_request
from server.openai.errors import APIError
from server.openai.logprobs import TokenTexts
from server.settings import Settings

RETRY_AFTER_SECONDS = 1  # what a 503 tells the client to wait


@dataclass
class Serving:
    engine: Engine
    tokenizer: object
    settings: Settings
    model_name: str  # what clients put in "model"
    model_root: str  # where the model came from (/v1/models' "root")
    vocab_size: int
    texts: TokenTexts = field(init=False)  # token id -> text, for logprobs

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)

    @classmethod
    def for_model(cls, engine: Engine, model, settings: Settings) -> Serving:
        """For a loaded model (``models.LoadedModel``: name, path, config, tokenizer)."""
        return cls(engine, model.tokenizer, settings, settings.served_name(model), str(model.path),
                   model.config.vocab_size)

    async def read(self, request: Request, model: type[Body]) -> Body:
        """The request's body as ``model``, within ``--max-body-bytes``, for the model this
        server serves (every body may name it)."""
        body = await read_request(request, model, self.settings.max_body_bytes)
        self.check_model(body.model)
        return body

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.", "model")

    def check_tokens(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def max_tokens(self, requested: int | None, prompts: list[list[int]]) -> int:
        """``requested``, or when the request leaves it out, what the longest prompt leaves of
        the context (the same for every prompt of a request)."""
        if requested is not None:
            return requested
        return min(max(0, self.engine.max_model_len - len(ids)) for ids in prompts)

    def check_fits(self, ids: list[int], max_tokens: int, params: dict[str, str] | None = None) -> None:
        """400 when the prompt and ``max_tokens`` can never run; ``params`` renames the fields
        the engine names (``prompt``, ``max_tokens``) to the request's."""
        try:
            self.engine.check_request(len(ids), max_tokens)
        except RequestRejected as exc:
            raise APIError(400, str(exc), (params or {}).get(exc.param, exc.param)) from None

    def check_admission(self) -> None:
        engine = self.engine
        if not engine.alive:
            raise APIError(503, "the engine is not running", retry_after=RETRY_AFTER_SECONDS)
        if not engine.accepting:
            raise APIError(503, "the server is shutting down and admits no new requests", retry_after=RETRY_AFTER_SECONDS)
        waiting, limit = engine.num_waiting_requests, self.settings.max_waiting
        if waiting >= limit:
            raise APIError(
                503,
                f"the waiting queue is full: {waiting} requests waiting, the limit is {limit} (--max-waiting)",
                retry_after=RETRY_AFTER_SECONDS,
            )


def serving_of(request: Request) -> Serving:
    return request.app.state.serving
