"""The HTTP edge: OpenAI-shaped endpoints (vLLM's field set) over one Engine.

``create_app(engine, tokenizer, ...)`` returns a FastAPI app. Every request is
parsed and checked here; bad input stops here with
``{"error": {"message", "type", "param", "code"}}`` and the status that says
why (400, 401, 404, 413, 503 + Retry-After). Generation results arrive from
the engine thread through an ``asyncio.Queue`` per HTTP request
(``loop.call_soon_threadsafe``) and go out as one JSON body or as Server-Sent
Events. A client that goes away aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from models import SamplingParams
from server.engine import Engine, RequestRejected, SeqUpdate
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.sequence import GenerationParams, TokenLogprob

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
OPEN_PATHS = {"/health", "/metrics"}
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this instead


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status, headers=headers)


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_n: int = 8
    max_waiting: int = 1024  # requests waiting for admission before 503 + Retry-After
    max_body_bytes: int = 1 << 20
    retry_after_seconds: int = 1
    disconnect_poll_seconds: float = 0.05


@dataclass(slots=True)
class Choice:
    """One choice being assembled from engine updates."""

    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    started: bool = False
    text_offset: int = 0  # characters of text sent so far (streaming logprobs offsets)


class Submission:
    """One HTTP request's engine requests (one per prompt, ``n`` choices each)."""

    def __init__(self, engine: Engine, request_id: str, prompts: list[list[int]], params: list[GenerationParams]):
        self.engine = engine
        self.request_id = request_id
        self.n = len(params)
        self.choices = [Choice(ids) for ids in prompts for _ in params]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_finished = 0
        loop = asyncio.get_running_loop()
        self.sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        for i, ids in enumerate(prompts):
            def deliver(update: SeqUpdate, i=i) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, update))

            engine.add_request(self.sub_ids[i], ids, params, deliver)

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.choices)

    async def next(self) -> tuple[int, SeqUpdate]:
        """The next update as (choice index, update), folded into ``self.choices``."""
        i, u = await self.queue.get()
        idx = i * self.n + u.index
        c = self.choices[idx]
        c.text += u.text
        c.token_ids += u.token_ids
        c.logprobs += u.logprobs
        if u.prompt_logprobs is not None:
            c.prompt_logprobs = u.prompt_logprobs
        if u.finish_reason is not None:
            c.finish_reason, c.stop_reason, c.error = u.finish_reason, u.stop_reason, u.error
            self.num_finished += 1
        return idx, u

    def abort(self) -> None:
        for sub in self.sub_ids:
            self.engine.abort(sub)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    def usage(self) -> dict:
        prompt = sum(len(self.choices[i * self.n].prompt_ids) for i in range(len(self.sub_ids)))
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _check_auth(request: Request, api_key: str | None) -> None:
    if api_key is None or request.url.path in OPEN_PATHS:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>' with the key the server was started with")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    # union members add their type name to the location; keep the field names
    loc = [p for p in loc if p.isidentifier() and p not in {"str", "int", "list", "function-after"}]
    param = loc[0] if loc else None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if "input" in err and err.get("type") not in {"value_error", "missing"}:
        msg = f"{msg}, got {json.dumps(err['input'])[:100]}"
    where = ".".join(loc)
    return (f"{where}: {msg}" if where else msg), param


def create_app(engine: Engine, tokenizer, config: ServerConfig, metrics=None) -> FastAPI:
    app = FastAPI(title="spyre-serve", version="0.1.0")
    app.state.engine = engine
    app.state.config = config
    vocab_size = getattr(getattr(engine.runner, "config", None), "vocab_size", None) or len(tokenizer)
    token_text_cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        s = token_text_cache.get(token_id)
        if s is None:
            s = tokenizer.decode([token_id], skip_special_tokens=False)
            token_text_cache[token_id] = s
        return s

    def auth(request: Request) -> None:
        _check_auth(request, config.api_key)

    guarded = [Depends(auth)]

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def read_json(request: Request, model: type[BaseModel]):
        limit = config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes")
        try:
            data = json.loads(body or b"null")
        except json.JSONDecodeError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{config.model_name}`.", "model")

    def check_admission() -> None:
        if not engine.alive:
            raise APIError(503, "the engine is not running", retry_after=config.retry_after_seconds)
        if not engine.accepting:
            raise APIError(503, "the server is shutting down and admits no new requests", retry_after=config.retry_after_seconds)
        waiting = engine.num_waiting_requests
        if waiting >= config.max_waiting:
            raise APIError(
                503,
                f"the waiting queue is full: {waiting} requests waiting, the limit is {config.max_waiting} (--max-waiting)",
                retry_after=config.retry_after_seconds,
            )

    def check_tokens(ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param)

    def gen_params(req, max_tokens: int, logprobs: int | None, prompt_logprobs: bool) -> list[GenerationParams]:
        if req.n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {req.n}", "n")
        out = []
        for i in range(req.n):
            sampling = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=max(0, req.top_k or 0),
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=None if req.seed is None else req.seed + i,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                logprobs=logprobs or 0,
            )
            out.append(
                GenerationParams(
                    sampling=sampling,
                    max_tokens=max_tokens,
                    min_tokens=min(req.min_tokens, max_tokens),
                    stop=list(req.stop or []),
                    stop_token_ids=list(req.stop_token_ids or []),
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return out

    def check_fits(ids: list[int], max_tokens: int) -> None:
        try:
            engine.check_request(len(ids), max_tokens)
        except RequestRejected as exc:
            raise APIError(400, str(exc), exc.param) from None

    async def collect(request: Request, sub: Submission) -> None:
        """Wait for every choice; abort if the client goes away first."""
        getter: asyncio.Future | None = None
        poll = config.disconnect_poll_seconds
        next_check = time.monotonic() + poll
        try:
            while not sub.done:
                if getter is None:
                    getter = asyncio.ensure_future(sub.next())
                done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - time.monotonic()))
                if getter in done:
                    getter.result()
                    getter = None
                if time.monotonic() >= next_check:  # updates may arrive faster than the poll
                    if await request.is_disconnected():
                        return
                    next_check = time.monotonic() + poll
        finally:
            if getter is not None:
                getter.cancel()
            if not sub.done:
                sub.abort()

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def sse_stream(sub: Submission, head: dict, include_usage: bool, choice_of, opening=()) -> AsyncIterator[str]:
        """A streaming response's Server-Sent Events, common to completions and chat.

        One chunk ``{**head, "choices": [choice]}`` per choice of ``opening``, then one per
        engine update with the choice ``choice_of(index, update)`` makes; then the usage
        chunk when ``include_usage``, and ``[DONE]``. An update carrying an error ends the
        stream with an error chunk (no usage) and ``[DONE]``. Whatever ends the stream
        early (an error, the client going away) aborts what is left of the submission."""
        try:
            for choice in opening:
                yield sse({**head, "choices": [choice]})
            while not sub.done:
                idx, u = await sub.next()
                if u.error:
                    yield sse(error_body(500, u.error))
                    sub.abort()
                    break
                yield sse({**head, "choices": [choice_of(idx, u)]})
            else:
                if include_usage:
                    yield sse({**head, "choices": [], "usage": sub.usage()})
            yield sse("[DONE]")
        finally:
            if not sub.done:
                sub.abort()

    # ---- completions -------------------------------------------------------------

    def completion_logprobs(tokens: list[TokenLogprob | None], ids: list[int], offset: int) -> dict:
        """vLLM's completion logprobs; ``text_offset`` counts characters from ``offset``."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in zip(ids, tokens, strict=True):
            s = token_text(t)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(lp.logprob, LOGPROB_FLOOR))
            top = {token_text(tid): max(v, LOGPROB_FLOOR) for tid, v in lp.top}
            top.setdefault(s, max(lp.logprob, LOGPROB_FLOOR))
            out["top_logprobs"].append(top)
        return out

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        req: CompletionRequest = await read_json(request, CompletionRequest)
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p, add_special_tokens=False)]
        elif all(isinstance(x, str) for x in p):
            prompts = [tokenizer.encode(x, add_special_tokens=False) for x in p]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        for ids in prompts:
            check_tokens(ids, "prompt")
        max_tokens_for = [
            req.max_tokens if req.max_tokens is not None else max(0, engine.max_model_len - len(ids)) for ids in prompts
        ]
        if len(set(max_tokens_for)) > 1:  # null max_tokens with prompts of different lengths
            max_tokens_for = [min(max_tokens_for)] * len(prompts)
        max_tokens = max_tokens_for[0]
        for ids in prompts:
            check_fits(ids, max_tokens)
        params = gen_params(req, max_tokens, req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None)
        check_admission()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        sub = Submission(engine, request_id, prompts, params)
        prompt_texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts] if req.echo else None

        def echo_parts(idx: int) -> tuple[str, dict | None]:
            c = sub.choices[idx]
            text = prompt_texts[idx // req.n]
            lps = None
            if req.logprobs is not None:
                plps = c.prompt_logprobs or [None] * len(c.prompt_ids)
                lps = completion_logprobs(plps, c.prompt_ids, 0)
            return text, lps

        if req.stream:
            return StreamingResponse(
                stream_completion(req, sub, request_id, created, echo_parts), media_type="text/event-stream"
            )
        await collect(request, sub)
        if not sub.done:
            return Response(status_code=499)
        if sub.error:
            raise APIError(500, sub.error)
        choices = []
        for idx, c in enumerate(sub.choices):
            text, lps = c.text, None
            if req.logprobs is not None:
                lps = completion_logprobs(c.logprobs, c.token_ids, 0)
            if req.echo:
                ptext, plps = echo_parts(idx)
                text = ptext + text
                if lps is not None:
                    shifted = completion_logprobs(c.logprobs, c.token_ids, len(ptext))
                    lps = {k: plps[k] + shifted[k] for k in plps}
            choices.append(
                {"index": idx, "text": text, "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": sub.usage(),
        }

    def stream_completion(req, sub: Submission, request_id, created, echo_parts) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": created, "model": config.model_name}

        def choice_of(idx: int, u: SeqUpdate) -> dict:
            c = sub.choices[idx]
            text, lps = u.text, None
            prefix = None
            if req.echo and not c.started:
                ptext, prefix = echo_parts(idx)
                text = ptext + text
                if prefix is not None:
                    c.text_offset = sum(len(t) for t in prefix["tokens"])
            c.started = True
            if req.logprobs is not None:
                lps = completion_logprobs(u.logprobs, u.token_ids, c.text_offset)
                c.text_offset += sum(len(t) for t in lps["tokens"])
                if prefix is not None:
                    lps = {key: prefix[key] + lps[key] for key in prefix}
            return {
                "index": idx,
                "text": text,
                "logprobs": lps,
                "finish_reason": u.finish_reason,
                "stop_reason": u.stop_reason,
            }

        return sse_stream(sub, head, req.stream_usage, choice_of)

    # ---- chat --------------------------------------------------------------------

    def chat_prompt(messages, add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = tokenizer.apply_chat_template(
                convo, add_generation_prompt=add_generation_prompt, tokenize=False, **(kwargs or {})
            )
        except Exception as exc:  # a template error is the caller's input
            raise APIError(400, f"the chat template could not render these messages: {exc}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    def chat_logprobs(tokens: list[TokenLogprob], ids: list[int], k: int) -> list[dict]:
        out = []
        for t, lp in zip(ids, tokens, strict=True):
            s = token_text(t)
            top = [
                {"token": token_text(tid), "logprob": max(v, LOGPROB_FLOOR), "bytes": list(token_text(tid).encode())}
                for tid, v in lp.top[:k]
            ]
            out.append({"token": s, "logprob": max(lp.logprob, LOGPROB_FLOOR), "bytes": list(s.encode()), "top_logprobs": top})
        return out

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        ids = chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        check_tokens(ids, "messages")
        limit = req.output_limit
        max_tokens = limit if limit is not None else max(0, engine.max_model_len - len(ids))
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            engine.check_request(len(ids), max_tokens)
        except RequestRejected as exc:
            raise APIError(400, str(exc), param if exc.param == "max_tokens" else "messages") from None
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = gen_params(req, max_tokens, k, prompt_logprobs=False)
        check_admission()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        sub = Submission(engine, request_id, [ids], params)
        if req.stream:
            return StreamingResponse(stream_chat(req, sub, request_id, created, k), media_type="text/event-stream")
        await collect(request, sub)
        if not sub.done:
            return Response(status_code=499)
        if sub.error:
            raise APIError(500, sub.error)
        choices = []
        for idx, c in enumerate(sub.choices):
            lps = {"content": chat_logprobs(c.logprobs, c.token_ids, k)} if k is not None else None
            choices.append(
                {
                    "index": idx,
                    "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": sub.usage(),
        }

    def stream_chat(req, sub: Submission, request_id, created, k) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": config.model_name}
        opening = [
            {"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for idx in range(len(sub.choices))
        ]

        def choice_of(idx: int, u: SeqUpdate) -> dict:
            lps = {"content": chat_logprobs(u.logprobs, u.token_ids, k)} if k is not None else None
            delta = {"content": u.text} if (u.text or u.finish_reason is None) else {}
            choice = {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": u.finish_reason}
            if u.finish_reason is not None:
                choice["stop_reason"] = u.stop_reason
            return choice

        return sse_stream(sub, head, req.stream_usage, choice_of, opening)

    # ---- the rest ----------------------------------------------------------------

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "spyre-serve",
                    "root": config.model_path or config.model_name,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if not engine.alive:
            reason = f": {type(engine.error).__name__}: {engine.error}" if engine.error else ""
            return error_response(APIError(503, f"the engine loop is not running{reason}"))
        if not engine.accepting:
            return error_response(APIError(503, "the server is shutting down", retry_after=config.retry_after_seconds))
        return Response(status_code=200)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        req: TokenizeRequest = await read_json(request, TokenizeRequest)
        check_model(req.model)
        if req.messages is not None:
            ids = chat_prompt(req.messages, req.add_generation_prompt, None)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        req: DetokenizeRequest = await read_json(request, DetokenizeRequest)
        check_model(req.model)
        check_tokens(req.tokens, "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics is None:
            return Response("", media_type="text/plain")
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app
