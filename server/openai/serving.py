"""What every endpoint shares, and the checks each makes before it submits.

One ``Serving`` per app (``app.state.serving``, read with ``serving_of``): the engine, the
tokenizer (with ``--chat-template`` if given), the name clients use for the model, the
settings' limits, the Responses API's stored responses (``responses_store``), and the
threads that render and tokenize off the event loop (``blocking``). A generation endpoint
reads its body (``read``, ``check_limits``), gets its prompts (``prompt_ids``), builds its
parameters, and ``start``s. Its checks refuse a request
before the engine sees it, each with the status
and numbers that say why: an unknown model (404), a request over a cap (``limits``), a
token id outside the vocabulary, a request that can never fit the context or the KV cache,
a template that renders too long (400), an engine that is down, draining or has too many
sequences waiting (503 + Retry-After).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from spyre_serve.server.engine.core import EngineUnavailable, RequestRejected
from spyre_serve.server.engine.seams import EngineClient
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.lora.adapters import LoraNames
from spyre_serve.server.openai.body import Body, read_request
from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.logprobs import TokenTexts
from spyre_serve.server.openai.generation.prompts import truncated, with_chat_template
from spyre_serve.server.openai.generation.protocol import SamplingRequest
from spyre_serve.server.openai.generation.sampling import generation_defaults
from spyre_serve.server.openai.limits import check_limits, num_prompts
from spyre_serve.server.openai.offload import Offload, PoolFull, TimedOut
from spyre_serve.server.openai.responses.store import ResponseStore
from spyre_serve.server.sched.sequence import GenerationParams
from spyre_serve.server.structured_output.grammars import Grammars

log = logging.getLogger("spyre_serve.api")

RETRY_AFTER_SECONDS = 1  # what a 503 tells the client to wait
# Threads rendering templates and tokenizing at once: more would only share the GIL, and
# each request waits for one at most --render-timeout anyway.
OFFLOAD_THREADS = 4
T = TypeVar("T")


def version() -> str:
    """This server's version (the installed package's)."""
    try:
        return importlib.metadata.version("spyre-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class Serving:
    engine: EngineClient   # the in-process Engine or the engine process's client
    tokenizer: object
    settings: Settings
    model_name: str  # what clients put in "model"
    model_root: str  # where the model came from (/v1/models' "root")
    vocab_size: int
    hidden_size: int  # an embedding's dimensions
    # the model's sampling defaults (generation_config.json, ``--generation-config``)
    defaults: dict = field(default_factory=dict)
    texts: TokenTexts = field(init=False)  # token id -> text, for logprobs
    offload: Offload = field(init=False)  # threads for rendering and tokenizing
    grammars: Grammars = field(init=False)  # structured output: compiled grammars (LRU)
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses (--max-stored-responses)
    fingerprint: str = field(init=False)  # responses' system_fingerprint: the engine's numerics
    longest_token: int | None = field(init=False)  # characters of the vocabulary's longest token
    loras: LoraNames = field(init=False)  # the LoRA adapters a request may name (server/lora/adapters.py)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)
        self.offload = Offload(OFFLOAD_THREADS, self.settings.render_timeout, self.settings.offload_wait)
        self.grammars = Grammars(self.tokenizer, self.vocab_size,
                                 self.engine.eos_token_ids)
        self.responses = ResponseStore(self.settings.max_stored_responses)
        self.fingerprint = f"spyre-serve-{version()}:{self.engine.numerics}"
        self.longest_token = longest_token(self.tokenizer, self.vocab_size)
        self.loras = LoraNames.of(self.settings, self.model_name)

    @classmethod
    def for_model(cls, engine: EngineClient, model, settings: Settings) -> Serving:
        """For a loaded model (``models.LoadedModel``: name, path, config, tokenizer)."""
        tokenizer = with_chat_template(model.tokenizer, settings.chat_template)
        return cls(engine, tokenizer, settings, settings.served_name(model), str(model.path),
                   model.config.vocab_size, model.config.hidden_size,
                   generation_defaults(model.path, settings.generation_config))

    async def read(self, request: Request, model: type[Body]) -> Body:
        """The request's body as ``model``, within ``--max-body-bytes``, for the model this
        server serves (every body may name it) and an endpoint of its kind: a body whose
        ``task`` is "generate" or "pooling" is a 400 on a model that does the other."""
        body = await read_request(request, model, self.settings.max_body_bytes, self.settings.strict_request_fields)
        self.check_model(body.model)
        task = getattr(model, "task", None)
        pools = self.engine.pooling is not None
        if task is not None and (task == "pooling") != pools:
            path = request.url.path
            raise APIError(400, f"{path} is not served by this model: it "
                                + ("serves embeddings (/v1/embeddings, /score; --runner pooling)" if pools else
                                   "generates (start the server with --runner pooling, or an embedding "
                                   "model, for embeddings and scores)"))
        return body

    def check_limits(self, req: SamplingRequest) -> int:
        """400 for a request over one of the caps (``limits``); else how many prompts it holds."""
        prompts = num_prompts(req)
        check_limits(req, prompts, self.settings)
        return prompts

    async def blocking(self, what: str, param: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` off the event loop; a 400 naming ``param`` when it takes longer than
        ``--render-timeout`` (``what`` says what took so long)."""
        try:
            return await self.offload.run(fn, *args)
        except PoolFull:
            raise APIError(503, f"the server's {self.offload.workers} threads for templates and tokenizing "
                                f"stayed busy for {self.offload.wait:g} s (--offload-wait): retry",
                           retry_after=RETRY_AFTER_SECONDS) from None
        except TimedOut:
            raise APIError(400, f"{what} took longer than {self.offload.timeout:g} s (--render-timeout)",
                           param) from None

    def check_text_fits(self, texts: list[str], param: str, truncate: int | None) -> None:
        """400 for a text that cannot fit the context whatever its tokens: more characters
        than ``max_model_len`` tokens of the vocabulary's longest could hold. Refused before
        it is rendered or tokenized (that work grows with the text; a client could send
        megabytes of it); unless the request truncates its prompt."""
        cap = None if self.longest_token is None else self.engine.max_model_len * self.longest_token
        if truncate is not None or cap is None:
            return
        for text in texts:
            if len(text) > cap:
                raise APIError(400, f"{param} holds {len(text)} characters: at least "
                                    f"{len(text) // self.longest_token} tokens (no token is longer than "
                                    f"{self.longest_token} characters), over the model's context of "
                                    f"{self.engine.max_model_len} tokens", param)

    async def prompt_ids(self, what: str, param: str, render: Callable[..., list[list[int]]], *args,
                         truncate: int | None) -> list[list[int]]:
        """The request's prompts as token ids: ``render(*args)`` (tokenize, or apply the chat
        template) off the event loop, cut to ``truncate`` tokens (truncate_prompt_tokens), each
        id checked against the vocabulary (400 naming ``param``)."""
        prompts = await self.blocking(what, param, render, *args)
        prompts = truncated(prompts, truncate, self.engine.max_model_len)
        for ids in prompts:
            self.check_tokens(ids, param)
        return prompts

    def start(self, request_id: str, prompts: list[list[int]], params: list[GenerationParams],
              renames: dict[str, str] | None = None, model: str | None = None) -> Submission:
        """Every prompt checked to fit with its choices (``check_fits``), the engine's room for
        them (``check_admission``), then the submission: the last steps of every generation
        endpoint, in this order and with no await between them. ``model``: the request's, which
        may name a LoRA adapter (its choices then run with it)."""
        lora = self.loras.resolve(model)
        for p in params:
            p.lora, p.lora_id = lora if lora else (None, 0)
        for ids in prompts:
            self.check_fits(ids, params, renames)
        self.check_scored(prompts, params)
        self.check_admission(len(prompts) * len(params))
        return self.submit(request_id, prompts, params)

    def check_scored(self, prompts: list[list[int]], params: list[GenerationParams]) -> None:
        """400 when the request would have more prompt tokens scored (prompt logprobs: every
        choice scores its prompt) than ``--max-scored-prompt-tokens``."""
        cap = self.settings.max_scored_prompt_tokens
        scored = sum(map(len, prompts)) * len(params) if params and params[0].prompt_logprobs else 0
        if scored > cap:
            raise APIError(400, f"this request asks for the logprobs of {scored} prompt tokens (its "
                                f"prompts' {sum(map(len, prompts))} tokens x n = {len(params)}), over the "
                                f"limit of {cap} (--max-scored-prompt-tokens)", "prompt_logprobs")

    def answered_as(self, name: str | None) -> str:
        """The ``model`` an answer names: the adapter's the request named, else the base's."""
        return name if self.loras.resolve(name) else self.model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.loras.resolve(name) is None:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.", "model")

    def check_tokens(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def max_tokens(self, requested: int | None, prompts: list[list[int]]) -> int:
        """``requested``, or when the request leaves it out, what the longest prompt leaves of
        the context (the same for every prompt of a request); at most the model's
        ``max_new_tokens`` (generation_config.json), as vLLM caps it."""
        if requested is None:
            requested = min(max(0, self.engine.max_model_len - len(ids)) for ids in prompts)
        cap = self.defaults.get("max_tokens")
        return requested if cap is None else min(requested, cap)

    def check_fits(self, ids: list[int], params: list[GenerationParams], renames: dict[str, str] | None = None) -> None:
        """400 when the prompt and its choices can never run: too long for the context or
        the KV cache, or a value a step cannot hold (the engine's ``check_request``);
        ``renames`` renames the fields the engine names (``prompt``, ``max_tokens``) to the
        request's."""
        try:
            self.engine.check_request(len(ids), params[0].max_tokens, params, ids)
        except RequestRejected as exc:
            raise APIError(400, str(exc), (renames or {}).get(exc.param, exc.param)) from None

    def submit(self, request_id: str, prompts: list[list[int]], params: list[GenerationParams]) -> Submission:
        """The engine requests of one HTTP request, added. The checks above have passed, so
        the engine refuses one only if it is dying meanwhile (503) or checks more than they
        did (400); either way nothing of the request is left in it."""
        try:
            return Submission(self.engine, request_id, prompts, params, self.settings.stream_send_timeout)
        except RequestRejected as exc:
            raise APIError(400, str(exc), exc.param) from None
        except EngineUnavailable as exc:
            log.warning("request %s refused: %s", request_id, exc)
            raise APIError(503, "the engine is not running", retry_after=RETRY_AFTER_SECONDS) from None

    def check_admission(self, sequences: int) -> None:
        """503 + Retry-After unless the engine runs, admits, and has room in its waiting queue
        for ``sequences`` more (``--max-waiting`` counts sequences: every choice of every
        prompt, ``engine.num_waiting_sequences``). Nothing may await between this check and
        the submission, so that concurrent requests cannot all pass it at once."""
        engine = self.engine
        if not engine.alive:
            raise APIError(503, "the engine is not running", retry_after=RETRY_AFTER_SECONDS)
        if not engine.accepting:
            raise APIError(503, "the server is shutting down and admits no new requests",
                           retry_after=RETRY_AFTER_SECONDS)
        waiting, limit = engine.num_waiting_sequences, self.settings.max_waiting
        if waiting + sequences > limit:
            raise APIError(
                503,
                f"the waiting queue is full: {waiting} sequences waiting, this request adds {sequences}, "
                f"the limit is {limit} (--max-waiting)",
                retry_after=RETRY_AFTER_SECONDS,
            )


def longest_token(tokenizer, vocab_size: int) -> int | None:
    """Characters of the tokenizer's longest token as it stores it (a byte-level or
    SentencePiece token decodes to no more characters than that); None when it cannot say."""
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        return max((len(t) for t in tokens if isinstance(t, str)), default=None)
    except (AttributeError, TypeError, IndexError, ValueError):
        return None


def serving_of(request: Request) -> Serving:
    return request.app.state.serving
