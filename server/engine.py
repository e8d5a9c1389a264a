"""The continuous-batching engine: one loop on its own thread.

Each iteration (vLLM v1's step, with one step of overlap):

    chunks = scheduler.schedule()            # step N+1, planned while N runs
    handle = runner.launch(work(chunks))     # returns at once
    out = inflight.handle.result()           # step N read back
    update(inflight, out)                    # stop checks, detokenize, push

A decode in N+1 of a sequence whose token from N is not read back yet is
launched with ``from_device``: the device reads the token N sampled. When N's
result says that sequence stopped, its token from N+1 is discarded when N+1 is
collected, and its blocks are freed then.

Requests come in and aborts go out through a locked inbox the loop drains
each iteration; results go back through each request's ``on_update``
callback (the API layer makes it an ``asyncio`` queue put via
``loop.call_soon_threadsafe``). An exception in a step fails the requests in
that step and the loop carries on; an exception anywhere else ends the loop,
fails every request, and ``alive`` turns false (``/health`` answers 503).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from models import SamplingParams, SeqWork
from models.tokenizer import IncrementalDetokenizer
from server.block_manager import BlockManager
from server.scheduler import ScheduledChunk, Scheduler
from server.sequence import GenerationParams, Sequence, TokenLogprob

log = logging.getLogger("spyre_serve.engine")


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the context or the cache)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SeqUpdate:
    """What one step added to one sequence, as handed to the API layer."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per new token when logprobs were asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, for echo + logprobs
    error: str | None = None


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    seqs: list[Sequence]
    on_update: Callable[[SeqUpdate], None]
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    num_finished: int = 0


class EngineObserver:
    """Metrics hooks; the default does nothing (server/metrics.py implements them)."""

    def on_scheduled(self, queue_seconds: float, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_finished(self, reason: str, e2e_seconds: float) -> None: ...


@dataclass(slots=True)
class _Step:
    chunks: list[ScheduledChunk]
    handle: object


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    failed_steps: int = 0
    busy_wall_seconds: float = 0.0  # wall time while the engine had work
    busy_device_seconds: float = 0.0  # device compute time in those periods
    tokens_discarded: int = 0  # sampled for sequences that had already stopped
    finished: dict = field(default_factory=dict)

    @property
    def device_busy_fraction(self) -> float:
        if self.busy_wall_seconds <= 0:
            return 0.0
        return min(1.0, self.busy_device_seconds / self.busy_wall_seconds)


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: the model config's ``eos_token_id`` (a list in
    ``models.config``; an int or None from other runners) plus the tokenizer's."""
    ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(t) for t in ids)


class Engine:
    def __init__(
        self,
        runner,
        tokenizer,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        card=None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        config = getattr(runner, "config", None)
        self.eos_token_ids = eos_token_ids(config, tokenizer)
        self.vocab_size = getattr(config, "vocab_size", None)
        self.block_size = runner.block_size
        self.num_kv_blocks = runner.num_kv_blocks
        self.max_model_len = runner.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.card = card
        self.observer = observer or EngineObserver()
        self.blocks = BlockManager(self.num_kv_blocks, self.block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                                   token_buckets=getattr(runner, "t_buckets", None))
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._requests: dict[str, EngineRequest] = {}
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the loop died
        self.accepting = True  # false while draining for shutdown
        self._counts = (0, 0)  # (running, waiting) requests, published by the engine thread
        self._waiting_seqs = 0  # sequences in the waiting queue, published by the engine thread

    # ---- public, any thread ---------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests added and not finished (including those still in the inbox)."""
        with self._lock:
            return len(self._requests) + sum(1 for kind, _ in self._inbox if kind == "add")

    @property
    def num_waiting_requests(self) -> int:
        """Requests not admitted yet: in the inbox or with a sequence in the waiting queue."""
        with self._lock:
            queued = sum(1 for kind, _ in self._inbox if kind == "add")
        return queued + self._counts[1]

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences not admitted yet: every choice of every request in the inbox, plus the
        sequences in the waiting queue (preempted ones included). What a limit on waiting
        work counts: a request with n choices and p prompts waits as n * p sequences."""
        with self._lock:
            queued = sum(len(item.seqs) for kind, item in self._inbox if kind == "add")
        return queued + self._waiting_seqs

    @property
    def num_running_requests(self) -> int:
        return self._counts[0]

    def _publish_counts(self) -> None:
        """Engine thread: request counts other threads read (they never touch the queues)."""
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        self._counts = (len(running), len(waiting))
        self._waiting_seqs = len(self.scheduler.waiting)

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse up front what can never run: raise ``RequestRejected`` with the numbers."""
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty: give at least one token", "prompt")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens" if max_tokens else "prompt",
            )
        capacity = self.num_kv_blocks * self.block_size
        if total > capacity:
            raise RequestRejected(
                f"The KV cache holds {capacity} tokens ({self.num_kv_blocks} blocks of "
                f"{self.block_size}). However, you requested {total} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion).",
                "max_tokens" if max_tokens else "prompt",
            )

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: list[GenerationParams],
        on_update: Callable[[SeqUpdate], None],
    ) -> None:
        """Queue a request with one ``GenerationParams`` per choice (``n`` of them)."""
        self.check_request(len(prompt_ids), params[0].max_tokens)
        now = time.monotonic()
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(prompt_ids), p, now)
            for i, p in enumerate(params)
        ]
        req = EngineRequest(request_id, seqs, on_update, now)
        with self._lock:
            self._inbox.append(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone). Its blocks are freed within one step."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started: one loop owns the scheduler and the runner")
        self._thread = threading.Thread(target=self._run, name="spyre-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop (engine thread only) ----------------------------------------

    def _run(self) -> None:
        inflight: _Step | None = None
        try:
            while not self._stop:
                t0 = time.perf_counter()
                c0 = self._device_seconds()
                self._drain_inbox()
                step = self._launch(self.scheduler.schedule())
                if inflight is not None:
                    self._collect(inflight)
                inflight = step
                self._publish_counts()
                if inflight is None:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.stats.busy_wall_seconds += time.perf_counter() - t0
                self.stats.busy_device_seconds += self._device_seconds() - c0
            if inflight is not None:
                self._collect(inflight)
            self._fail_all("the engine was shut down")
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            log.exception("engine loop died")
            self._fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        self._counts = (0, 0)
        self._waiting_seqs = 0

    def _device_seconds(self) -> float:
        if self.card is None:
            return 0.0
        return float(self.card.counters["compute_seconds"])

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                req: EngineRequest = item
                self._requests[req.request_id] = req
                for seq in req.seqs:
                    seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
                    self.scheduler.add(seq)
            else:
                req = self._requests.get(item)
                if req is not None:
                    self._finish_request(req, "abort", notify=False)

    def _launch(self, chunks: list[ScheduledChunk]) -> _Step | None:
        if not chunks:
            return None
        now = time.monotonic()
        try:
            work = [self._work(c) for c in chunks]
            handle = self.runner.launch(work)
        except Exception as exc:
            log.exception("launch failed")
            self._fail_step(chunks, exc)
            return None
        self.stats.steps += 1
        for c in chunks:
            req = self._requests.get(c.seq.request_id)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = now
                self.observer.on_scheduled(now - req.arrival, c.seq.num_prompt)
        return _Step(chunks, handle)

    def _banned_tokens(self, p: GenerationParams) -> list[int]:
        """Tokens that would stop the sequence (every EOS id unless ignore_eos, and
        stop_token_ids): vLLM's min_tokens keeps them from being sampled, not just from
        stopping. Ids outside the vocabulary are never sampled anyway and are left out."""
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids.extend(self.eos_token_ids)
        if self.vocab_size is not None:
            ids = [t for t in ids if 0 <= t < self.vocab_size]
        return sorted(set(ids))

    def _work(self, c: ScheduledChunk) -> SeqWork:
        seq = c.seq
        p = seq.params
        if c.from_device:
            token_ids = [-1]
        else:
            token_ids = seq.token_ids[c.start : c.start + c.num_new]
        sampling: SamplingParams = p.sampling
        return SeqWork(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            start_pos=c.start,
            block_table=list(seq.block_table),
            sample=c.sample,
            sampling=sampling,
            num_generated=c.num_generated,
            from_device=c.from_device,
            prompt_logprobs=c.prompt_logprobs,
            # the card keeps the penalty state from the tokens it computes; positions below
            # num_prompt are the prompt's (vLLM: repetition counts them, presence and
            # frequency only the output), so the host sends no token history
            num_prompt=seq.num_prompt if sampling.uses_penalties else None,
            # the token sampled here is output token number num_generated (from 0)
            banned_token_ids=(self._banned_tokens(p) or None)
            if c.sample and c.num_generated < p.min_tokens else None,
        )

    def _collect(self, step: _Step) -> None:
        try:
            out = step.handle.result()
        except Exception as exc:
            log.exception("step failed")
            self._fail_step(step.chunks, exc)
            return
        row = {sid: i for i, sid in enumerate(out.seq_ids)}
        now = time.monotonic()
        touched: dict[str, set[int]] = {}
        num_new_tokens = 0
        for c in step.chunks:
            seq = c.seq
            i = row[seq.seq_id] if c.sample else None
            kept = self.scheduler.collected(c, None if i is None else int(out.token_ids[i]))
            if c.prompt_logprobs and seq.seq_id in out.prompt_logprobs:
                self._store_prompt_logprobs(c, out.prompt_logprobs[seq.seq_id])
            if c.sample:
                if not kept:
                    self.stats.tokens_discarded += 1
                    continue
                self._on_token(seq, out, i, now)
                num_new_tokens += 1
            elif seq.params.max_tokens == 0 and c.start + c.num_new >= seq.num_prompt:
                if not seq.is_finished:
                    self._finish_seq(seq, "length")
            touched.setdefault(seq.request_id, set()).add(seq.index)
        if num_new_tokens:
            self.observer.on_tokens(num_new_tokens)
        for request_id, indices in touched.items():
            req = self._requests.get(request_id)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.index in indices:
                    self._emit(req, seq)
            if req.num_finished == len(req.seqs):
                self._close(req)

    def _store_prompt_logprobs(self, c: ScheduledChunk, triple) -> None:
        lps, top_ids, top_lps = triple
        n = len(lps)
        # entry k scores the token at position first + k: token_ids[1:] of the chunk,
        # plus the previous chunk's last (position start) when the runner returns one more
        first = c.start + 1 if n <= c.num_new - 1 else c.start
        seq = c.seq
        for k in range(n):
            pos = first + k
            if 0 < pos < seq.num_prompt:
                top = [(int(top_ids[k, j]), float(top_lps[k, j])) for j in range(top_ids.shape[1])]
                seq.prompt_logprobs[pos] = TokenLogprob(seq.token_ids[pos], float(lps[k]), top)

    def _on_token(self, seq: Sequence, out, i: int, now: float) -> None:
        """The scheduler has added the token of ``out``'s row ``i`` to ``seq``: time it,
        keep its logprobs, detokenize it and check the stop conditions."""
        p = seq.params
        token = seq.token_ids[-1]
        req = self._requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.first_token is None:
                req.first_token = now
                self.observer.on_first_token(now - req.arrival)
        elif seq.last_token_time is not None:
            self.observer.on_token_gap(now - seq.last_token_time)
        seq.last_token_time = now
        if p.logprobs is not None:
            k = min(p.logprobs, out.top_ids.shape[1]) if out.top_ids.ndim == 2 else 0
            top = [(int(out.top_ids[i, j]), float(out.top_logprobs[i, j])) for j in range(k)]
            seq.output_logprobs.append(TokenLogprob(token, float(out.logprobs[i]), top))
        # stop checks, in vLLM's order
        allow_stop = seq.num_generated >= p.min_tokens
        if allow_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish_seq(seq, "stop")
            return
        if allow_stop and token in p.stop_token_ids:
            self._finish_seq(seq, "stop", stop_reason=token)
            return
        stop = seq.append_text(seq.detok.add(token))
        if stop is not None:
            self._finish_seq(seq, "stop", stop_reason=stop)
            return
        if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.append_text(seq.detok.flush())  # an incomplete last character, as decode() shows it
            self._finish_seq(seq, "length")

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, reason)
        req = self._requests.get(seq.request_id)
        if req is not None:
            req.num_finished += 1

    def _emit(self, req: EngineRequest, seq: Sequence) -> None:
        new_ids = seq.output_ids[seq.num_tokens_sent :]
        new_lps = seq.output_logprobs[seq.num_tokens_sent :] if seq.params.logprobs is not None else []
        text = seq.take_text()
        prompt_lps = None
        if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
            if seq.is_finished or all(lp is not None for lp in seq.prompt_logprobs[1:]):
                prompt_lps = list(seq.prompt_logprobs)
                seq.prompt_logprobs_sent = True
        if not (new_ids or text or seq.is_finished or prompt_lps is not None):
            return
        seq.num_tokens_sent = seq.num_generated
        update = SeqUpdate(
            index=seq.index,
            text=text,
            token_ids=new_ids,
            logprobs=new_lps,
            finish_reason=seq.finish_reason if seq.is_finished else None,
            stop_reason=seq.stop_reason if seq.is_finished else None,
            prompt_logprobs=prompt_lps,
            error=seq.error,
        )
        self._send(req, update)

    def _send(self, req: EngineRequest, update: SeqUpdate) -> None:
        try:
            req.on_update(update)
        except Exception:  # a closed event loop must not take the engine down
            log.exception("delivering an update for %s failed", req.request_id)

    def _close(self, req: EngineRequest) -> None:
        self._requests.pop(req.request_id, None)
        reason = req.seqs[0].finish_reason or "abort"
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self.observer.on_finished(reason, time.monotonic() - req.arrival)

    def _finish_request(self, req: EngineRequest, reason: str, notify: bool, error: str | None = None) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                seq.error = error
                self._finish_seq(seq, reason)
                if notify:
                    self._emit(req, seq)
        self._close(req)

    def _fail_step(self, chunks: list[ScheduledChunk], exc: BaseException) -> None:
        self.stats.failed_steps += 1
        message = f"the step failed: {type(exc).__name__}: {exc}"
        self.scheduler.step_failed(chunks)
        for request_id in {c.seq.request_id for c in chunks}:
            req = self._requests.get(request_id)
            if req is not None:
                self._finish_request(req, "error", notify=True, error=message)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                self._requests[item.request_id] = item
        for req in list(self._requests.values()):
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.abandon(seq, "error")
                    seq.error = message
                    req.num_finished += 1
                    self._emit(req, seq)
            self._requests.pop(req.request_id, None)
