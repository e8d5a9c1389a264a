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
``loop.call_soon_threadsafe``).

One client cannot hurt another. ``add_request`` refuses (``RequestRejected``, HTTP 400)
every value the step program could not hold; and a step that still fails fails only the
sequences that caused it: the runner names the work items it refuses (``SeqWorkError``)
and only their requests fail, the others are planned again; a step that fails without
naming one fails its request if it holds only one, else each of its sequences becomes a
suspect, recomputed from position 0 in a step of its own (``_probe``) after the pipeline
is drained, so only a sequence that fails alone is failed. A run of
``MAX_FAILED_STEPS_IN_A_ROW`` failed steps is the card's fault, not a client's: fatal.

The engine dies on an exception outside a step, a fatal one, or a step that does not return
within ``step_timeout`` (``server/watchdog.py``): every request is failed at once, later
``add_request`` calls raise ``EngineUnavailable`` (HTTP 503) instead of queueing, ``alive``
turns false, and ``on_death`` is called once (the CLI exits 1 so the replica is restarted).
When a sequence ends or is preempted and no step holds it, ``runner.forget`` drops what the
runner kept for it (the scheduler's ``on_release``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from models import SamplingParams, SeqWork
from models.step_io import INT32_MAX, MAX_LOGPROBS, ParamError, SeqWorkError
from models.tokenizer import IncrementalDetokenizer
from server.block_manager import BlockManager
from server.scheduler import ScheduledChunk, Scheduler
from server.sequence import GenerationParams, Sequence, TokenLogprob
from server.watchdog import EngineFatal, EngineStalled, Fault, Watchdog

log = logging.getLogger("spyre_serve.engine")

MAX_FAILED_STEPS_IN_A_ROW = 8  # then the card, not a request, is at fault: the engine dies

__all__ = ["Engine", "EngineFatal", "EngineStalled", "EngineUnavailable", "RequestRejected"]


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the context or the cache, or
    a value the step cannot hold): HTTP 400, ``param`` naming the field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineUnavailable(RuntimeError):
    """The engine takes no more requests: it died, is dying or was shut down (HTTP 503)."""

    status = 503


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
    number: int  # launches so far, this one included


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
        step_timeout: float | None = None,
        on_death: Callable[[BaseException], None] | None = None,
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
        forget = getattr(runner, "forget", None)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                                   token_buckets=getattr(runner, "t_buckets", None),
                                   on_release=(lambda seq: forget(seq.seq_id)) if forget else None)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._requests: dict[str, EngineRequest] = {}
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the loop died
        self.on_death = on_death  # called once, from the thread that found the engine dead
        self.accepting = True  # false while draining for shutdown
        self._closed = False  # no request is taken any more (set under _lock)
        self._dead = False  # the engine died (set once, under _death_lock)
        self._death_lock = threading.Lock()
        self._fail_lock = threading.Lock()  # _fail_all: the loop's thread or the watchdog's
        self._suspects: deque[Sequence] = deque()  # of a failed step, each to run alone
        self._failed_in_a_row = 0
        self._fault = Fault.from_env()
        self._watchdog = Watchdog(step_timeout, self._die) if step_timeout else None
        self._counts = (0, 0)  # (running, waiting) requests, published by the engine thread
        self._waiting_seqs = 0  # sequences in the waiting queue, published by the engine thread

    # ---- public, any thread ---------------------------------------------------

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._dead
                and not self._closed)

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

    def check_request(self, num_prompt_tokens: int, max_tokens: int,
                      params: list[GenerationParams] | None = None,
                      prompt_ids: list[int] | None = None) -> None:
        """Refuse up front what can never run: raise ``RequestRejected`` with the numbers.
        With ``params`` (one per choice) and ``prompt_ids``, every value a step would carry
        is checked too (what ``add_request`` checks)."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise RequestRejected(f"max_tokens must be an integer >= 0, got {max_tokens!r}", "max_tokens")
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
        if prompt_ids is not None:
            self._check_prompt_ids(prompt_ids)
        if params is not None:
            self._check_params(params)

    def _check_prompt_ids(self, ids: list[int]) -> None:
        """Token ids the embedding can read: 0..V-1 (the step's tokens are int32)."""
        high = INT32_MAX if self.vocab_size is None else self.vocab_size - 1
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t <= high)), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary (0..{high})", "prompt")

    def _check_params(self, params: list[GenerationParams]) -> None:
        """Each choice's values against what a step holds: the sampling parameters
        (``SamplingParams.check``: int32 top_k, int64 seed, float32-finite reals), logprobs,
        min_tokens within max_tokens, stop token ids that are int32 ids."""
        if not params:
            raise RequestRejected("a request needs at least one choice (n >= 1)", "n")
        for p in params:
            try:
                p.sampling.check()
            except ParamError as exc:
                raise RequestRejected(str(exc), exc.field) from None
            if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= MAX_LOGPROBS):
                raise RequestRejected(f"logprobs must be in 0..{MAX_LOGPROBS}, got {p.logprobs!r}", "logprobs")
            if not (isinstance(p.min_tokens, int) and 0 <= p.min_tokens <= p.max_tokens):
                raise RequestRejected(f"min_tokens must be in 0..max_tokens ({p.max_tokens}), got "
                                      f"{p.min_tokens!r}", "min_tokens")
            bad = next((t for t in p.stop_token_ids if not (isinstance(t, int) and 0 <= t <= INT32_MAX)), None)
            if bad is not None:
                raise RequestRejected(f"stop_token_ids: {bad!r} is not a token id (0..{INT32_MAX})",
                                      "stop_token_ids")

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: list[GenerationParams],
        on_update: Callable[[SeqUpdate], None],
    ) -> None:
        """Queue a request with one ``GenerationParams`` per choice (``n`` of them).
        ``RequestRejected`` if it can never run; ``EngineUnavailable`` if the engine takes no
        more requests (dead, dying, shut down): never queued where nobody will answer it."""
        self.check_request(len(prompt_ids), max((p.max_tokens for p in params), default=0),
                           params, prompt_ids)
        now = time.monotonic()
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(prompt_ids), p, now)
            for i, p in enumerate(params)
        ]
        req = EngineRequest(request_id, seqs, on_update, now)
        with self._lock:
            if self._closed:
                raise EngineUnavailable(self._unavailable_reason())
            self._inbox.append(("add", req))
        self._wake.set()

    def _unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine is not running: {type(self.error).__name__}: {self.error}"
        return "the engine is not running: it was shut down"

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
        if self._watchdog is not None:
            self._watchdog.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop (engine thread only) ----------------------------------------

    def _run(self) -> None:
        inflight: _Step | None = None
        try:
            while not self._stop and not self._dead:
                t0 = time.perf_counter()
                c0 = self._device_seconds()
                self._drain_inbox()
                if self._suspects:
                    if inflight is not None:          # drain: suspects run on a quiet pipeline
                        self._collect_pair(inflight, None)
                        inflight = None
                    self._probe()
                    self._publish_counts()
                    continue
                chunks = self.scheduler.schedule()
                step = self._launch(chunks)
                if inflight is not None:
                    step = self._collect_pair(inflight, step)
                inflight = step
                self._publish_counts()
                if inflight is None:
                    if not chunks:                    # idle (a failed launch replans at once)
                        self._wake.wait(0.05)
                        self._wake.clear()
                    continue
                self.stats.busy_wall_seconds += time.perf_counter() - t0
                self.stats.busy_device_seconds += self._device_seconds() - c0
            if not self._dead:
                if inflight is not None:
                    self._collect(inflight)
                self._fail_all("the engine was shut down")
        except BaseException as exc:  # the loop must never die silently
            self._die(exc)
        self._counts = (0, 0)
        self._waiting_seqs = 0

    def _die(self, exc: BaseException) -> None:
        """The engine cannot go on (any thread: the loop's, or the watchdog's): fail every
        request, refuse new ones, then tell ``on_death``. Once."""
        with self._death_lock:
            if self._dead:
                return
            self._dead = True
        self.error = exc
        log.error("engine died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self._fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        if self._watchdog is not None:
            self._watchdog.stop()
        self._wake.set()
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except Exception:
                log.exception("on_death failed")

    def _watch(self, what: str):
        """Mark a wait for a step's results, for the watchdog."""
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.watch(what)

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
        if self._fault is not None:  # test hook; outside the step's handling: fatal
            self._fault.at_launch(self.stats.steps + 1)
        try:
            work = [self._work(c) for c in chunks]
            handle = self.runner.launch(work)
        except Exception as exc:
            log.warning("launch failed: %s: %s", type(exc).__name__, exc)
            self._step_failed(chunks, exc, ran=False)
            return None
        self.stats.steps += 1
        for c in chunks:
            req = self._requests.get(c.seq.request_id)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = now
                self.observer.on_scheduled(now - req.arrival, c.seq.num_prompt)
        return _Step(chunks, handle, self.stats.steps)

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

    def _collect_pair(self, step: _Step, next_step: _Step | None) -> _Step | None:
        """Read back ``step``; when it failed, read back the step launched after it too
        (its results for ``step``'s sequences followed a failed step: discarded), so that
        nothing is in flight. Returns what is still in flight."""
        failed = self._collect(step)
        if failed is None:
            return next_step
        if next_step is not None:
            self._collect(next_step, poisoned=failed)
        return None

    def _collect(self, step: _Step, poisoned: frozenset[int] = frozenset()) -> frozenset[int] | None:
        """Read back ``step`` and apply it: None, or when it failed the ids of its sequences.
        The chunks of ``poisoned`` sequences are dropped (the step before failed for them)."""
        try:
            with self._watch(f"step {step.number}"):
                if self._fault is not None:
                    self._fault.at_read_back(step.number)
                out = step.handle.result()
        except Exception as exc:
            log.warning("step failed: %s: %s", type(exc).__name__, exc)
            self._step_failed(step.chunks, exc, ran=True)
            return frozenset(c.seq.seq_id for c in step.chunks)
        if self._dead:  # the watchdog gave up on this step: its requests are answered
            return None
        self._failed_in_a_row = 0
        row = {sid: i for i, sid in enumerate(out.seq_ids)}
        now = time.monotonic()
        touched: dict[str, set[int]] = {}
        num_new_tokens = 0
        for c in step.chunks:
            seq = c.seq
            if seq.seq_id in poisoned:
                self.scheduler.step_failed([c])
                continue
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

    def _emit(self, req: EngineRequest, seq: Sequence, force: bool = False) -> None:
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
        self._send(req, update, force)

    def _send(self, req: EngineRequest, update: SeqUpdate, force: bool = False) -> None:
        if not force and self._dead and threading.current_thread() is self._thread:
            return  # the engine died meanwhile: every request was answered by _fail_all
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

    def _step_failed(self, chunks: list[ScheduledChunk], exc: BaseException, ran: bool) -> None:
        """A step raised, at its launch (``ran`` false: nothing of it ran) or when read back.
        Fail only the sequences that caused it: those the runner names; else the request, if
        the step holds only one; else every sequence of it is a suspect, to run alone."""
        self.stats.failed_steps += 1
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineFatal(f"{self._failed_in_a_row} steps failed in a row, the last with "
                              f"{type(exc).__name__}: {exc}") from exc
        if ran:
            self.scheduler.step_failed(chunks)
        else:
            self.scheduler.undo_launch(chunks)
        in_step = {c.seq.seq_id for c in chunks}
        reasons = exc.reasons if isinstance(exc, SeqWorkError) else {}
        named = {i: r for i, r in reasons.items() if i in in_step}
        if named and not ran:
            # the runner refused these items and launched nothing: the others are planned
            # again from where they were
            for c in chunks:
                if c.seq.seq_id in named:
                    self._fail_request(c.seq.request_id, f"the step refused the request: {named[c.seq.seq_id]}")
            return
        message = f"the step failed: {type(exc).__name__}: {exc}"
        requests = {c.seq.request_id for c in chunks}
        if len(requests) == 1:
            self._fail_request(requests.pop(), message)
            return
        log.warning("a step of %d requests failed (%s); each runs alone until the one at fault "
                    "fails alone", len(requests), message)
        queued = {s.seq_id for s in self._suspects}
        for c in chunks:
            if not c.seq.is_finished and c.seq.seq_id not in queued:
                self._suspects.append(c.seq)
                queued.add(c.seq.seq_id)

    def _fail_request(self, request_id: str, message: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._finish_request(req, "error", notify=True, error=message)

    def _probe(self) -> None:
        """Run the next suspect alone, recomputed from position 0 (nothing is in flight): a
        failure now is its own (``_step_failed`` fails a one-request step); success clears it."""
        seq = self._suspects.popleft()
        if seq.is_finished:
            return
        self.scheduler.rewind(seq)
        step = self._launch(self.scheduler.schedule_solo(seq))
        if step is not None:
            self._collect(step)

    def _fail_all(self, message: str) -> None:
        """Answer every request with an error and take no new ones (the loop is over)."""
        with self._lock:
            self._closed = True
            inbox, self._inbox = self._inbox, []
        with self._fail_lock:
            for kind, item in inbox:
                if kind == "add":
                    self._requests[item.request_id] = item
            for req in list(self._requests.values()):
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.abandon(seq, "error")
                        seq.error = message
                        req.num_finished += 1
                        self._emit_final(req, seq)
                self._requests.pop(req.request_id, None)

    def _emit_final(self, req: EngineRequest, seq: Sequence) -> None:
        """``_emit`` from whichever thread fails everything (the engine may be stuck)."""
        try:
            self._emit(req, seq, force=True)
        except Exception:
            log.exception("failing %s", req.request_id)
