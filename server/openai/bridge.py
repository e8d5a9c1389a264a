"""From the engine thread to the HTTP request's event loop, and back.

A ``Submission`` is one HTTP request's engine requests: one per prompt, each with ``n``
choices. The engine calls each request's ``on_update`` on its own thread; the update is
handed to the event loop with ``loop.call_soon_threadsafe`` and queued, and ``next()``
folds it into its ``Choice``. ``collect`` waits for every choice of a non-streaming
request, and aborts the engine requests if the client goes away first (polled, since a
waiting handler hears nothing from a closed connection).

A slow reader: a stream whose client stops reading blocks in the socket's send, and the
engine would go on generating into an unbounded queue to ``max_tokens``. An update that
arrives while the last one handed out has not been sent for ``stall_timeout`` seconds
(``--stream-send-timeout``; the reader is not waiting in ``next``) aborts the submission:
its KV blocks are freed and the queue stops growing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from spyre_serve.server.engine.core import Engine, SeqUpdate
from spyre_serve.server.engine.stats import ProjectedTimes
from spyre_serve.server.sched.sequence import GenerationParams, TokenLogprob

DISCONNECT_POLL_SECONDS = 0.05  # how often a waiting non-streaming request asks if its client left
log = logging.getLogger("spyre_serve.api")


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
    started: bool = False  # a streamed completion sent its first chunk (the echo goes in it)
    text_offset: int = 0  # characters of text sent so far (streaming logprobs offsets)
    embedding: object | None = None  # float32[H]: an embedding request's vector
    projected: ProjectedTimes | None = None  # its steps on a real card so far (the engine's)


class Submission:
    """One HTTP request's engine requests (one per prompt, ``n`` choices each); choice
    ``i * n + j`` is choice ``j`` of prompt ``i``. Made on the event loop; if the engine
    refuses a prompt, those added before it are aborted and the refusal raised."""

    def __init__(self, engine: Engine, request_id: str, prompts: list[list[int]], params: list[GenerationParams],
                 stall_timeout: float | None = None):
        self.engine = engine
        self.request_id = request_id
        self.n = len(params)
        self.choices = [Choice(ids) for ids in prompts for _ in params]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_finished = 0
        self.stall_timeout = stall_timeout
        self.reading = True               # the reader waits in next() (or has not started)
        self.handed_at = time.monotonic()  # when next() last returned an update
        self.stalled = False              # aborted because its reader stopped reading
        loop = asyncio.get_running_loop()
        self.sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        for i, ids in enumerate(prompts):
            def deliver(update: SeqUpdate, i=i) -> None:
                loop.call_soon_threadsafe(self._put, i, update)

            try:
                engine.add_request(self.sub_ids[i], ids, params, deliver)
            except BaseException:  # refused: the prompts added before it are taken back
                for sub in self.sub_ids[:i]:
                    engine.abort(sub)
                raise

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.choices)

    def _put(self, i: int, update: SeqUpdate) -> None:
        """An engine update, queued (event loop); a reader stalled past ``stall_timeout``
        aborts the submission."""
        self.queue.put_nowait((i, update))
        if (self.stall_timeout is not None and not self.reading and not self.stalled
                and time.monotonic() - self.handed_at > self.stall_timeout):
            self.stalled = True
            log.warning("request %s: its client has read nothing for %.0f s (--stream-send-timeout): "
                        "aborted", self.request_id, time.monotonic() - self.handed_at)
            self.abort()

    async def next(self) -> tuple[int, SeqUpdate]:
        """The next update as (choice index, update), folded into ``self.choices``."""
        self.reading = True
        try:
            i, u = await self.queue.get()
        finally:
            self.reading = False
            self.handed_at = time.monotonic()
        idx = i * self.n + u.index
        c = self.choices[idx]
        c.text += u.text
        c.token_ids += u.token_ids
        c.logprobs += u.logprobs
        if u.prompt_logprobs is not None:
            c.prompt_logprobs = u.prompt_logprobs
        if u.projected is not None:
            c.projected = u.projected
        if u.finish_reason is not None:
            c.finish_reason, c.stop_reason, c.error = u.finish_reason, u.stop_reason, u.error
            c.embedding = u.embedding
            self.num_finished += 1
        return idx, u

    def abort(self) -> None:
        for sub in self.sub_ids:
            self.engine.abort(sub)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    def usage(self, choice: int | None = None) -> dict:
        """The request's token counts so far, or one choice's (its prompt and its tokens); with
        the ``spyre`` block (``spyre_usage``) when the engine projects its steps."""
        if choice is not None:
            chosen = [self.choices[choice]]
            prompt = len(chosen[0].prompt_ids)
        else:
            chosen = self.choices
            prompt = sum(len(self.choices[i * self.n].prompt_ids) for i in range(len(self.sub_ids)))
        completion = sum(len(c.token_ids) for c in chosen)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        projected = [c.projected for c in chosen if c.projected is not None]
        if projected:
            usage["spyre"] = spyre_usage(projected)
        return usage


def spyre_usage(projected: list[ProjectedTimes]) -> dict:
    """What the choices' steps take on a real Spyre card (models/sizing/projection.py): the steps up to
    the first token (of the earliest choice), the mean of the steps after it (over every
    choice's), and all of the longest choice's steps."""
    later, steps = sum(p.later for p in projected), sum(p.later_steps for p in projected)
    return {"projected_ttft_seconds": min(p.ttft for p in projected),
            "projected_tpot_seconds": later / steps if steps else 0.0,
            "projected_seconds": max(p.ttft + p.later for p in projected)}


async def collect(sub: Submission, is_disconnected: Callable[[], Awaitable[bool]],
                  poll_seconds: float = DISCONNECT_POLL_SECONDS) -> None:
    """Wait for every choice; abort if the client goes away first (``sub.done`` stays false).

    ``is_disconnected`` is asked every ``poll_seconds`` even while updates keep coming."""
    getter: asyncio.Future | None = None
    next_check = time.monotonic() + poll_seconds
    try:
        while not sub.done:
            if getter is None:
                getter = asyncio.ensure_future(sub.next())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - time.monotonic()))
            if getter in done:
                getter.result()
                getter = None
            if time.monotonic() >= next_check:  # updates may arrive faster than the poll
                if await is_disconnected():
                    return
                next_check = time.monotonic() + poll_seconds
    finally:
        if getter is not None:
            getter.cancel()
        if not sub.done:
            sub.abort()
