"""The continuous-batching engine: one loop on its own thread.

Each iteration (vLLM v1's step, with one step of overlap):

    chunks = scheduler.schedule()            # step N+1, planned while N runs
    handle = runner.launch(work(chunks))     # returns at once
    out = inflight.handle.result()           # step N read back
    update(inflight, out)                    # stop checks, detokenize, push

A decode in N+1 of a sequence whose token from N is not read back yet is launched with
``from_device``: the device reads the token N sampled. When N's result says that sequence
stopped, its token from N+1 is discarded when N+1 is collected, and its blocks freed then.

Requests come in and aborts go out through a locked inbox (``server/engine/inbox.py``) the loop drains
each iteration; results go back through each request's ``on_update`` callback (the API layer
makes it an ``asyncio`` queue put via ``loop.call_soon_threadsafe``).

One client cannot hurt another. ``add_request`` refuses (``RequestRejected``, HTTP 400,
``server/sched/admission.py``) every value the step program could not hold; a step that still fails
fails only the sequences that caused it (``step_failures.py``; suspects run alone: ``_probe``).

The engine dies on an exception outside a step, a fatal one, or a step that does not return
within ``step_timeout`` (``server/engine/death.py``, ``server/engine/watchdog.py``): every request
is failed at once, later ``add_request`` calls raise ``EngineUnavailable`` (HTTP 503)
instead of queueing, ``alive`` turns false, and ``on_death`` is called once. A sequence
that ends or is preempted, once no step holds it, is dropped by ``runner.forget``.

One module each: a chunk's ``SeqWork`` (``server/engine/step_work.py``), stop checks (``stopping.py``),
results into ``SeqUpdate``s (``outputs.py``), counters and metric hooks (``engine_stats.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable

from spyre_serve.server.engine.death import EngineUnavailable, Lifeline
from spyre_serve.server.engine.inbox import Inbox
from spyre_serve.server.engine.open_requests import EngineRequest, OpenRequests
from spyre_serve.server.engine.output_processor import OutputProcessor
from spyre_serve.server.engine.outputs import SeqUpdate, store_prompt_logprobs
from spyre_serve.server.engine.seams import StepRunner, check_runner
from spyre_serve.server.engine.stats import (
    EngineObserver,
    EngineStats,
    device_seconds,
    projected_of,
)
from spyre_serve.server.engine.step_failures import MAX_FAILED_STEPS_IN_A_ROW, StepFailures
from spyre_serve.server.engine.step_work import ScheduledChunk, Step, holds_grammar_sample, seq_work
from spyre_serve.server.engine.stopping import eos_token_ids
from spyre_serve.server.engine.watchdog import EngineFatal, EngineStalled, Fault
from spyre_serve.server.lora.adapters import apply_update, lora_admits
from spyre_serve.server.sched.admission import RequestRejected, check_request
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import GenerationParams, Sequence
from spyre_serve.server.sched.spyre_compat import SpyreCompat
from spyre_serve.server.spec_decode.proposals import Speculator

log = logging.getLogger("spyre_serve.engine")

__all__ = ["MAX_FAILED_STEPS_IN_A_ROW", "Engine", "EngineFatal", "EngineObserver", "EngineRequest", "EngineStalled",
           "EngineStats", "EngineUnavailable", "RequestRejected", "SeqUpdate", "eos_token_ids"]


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        tokenizer,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        card=None,
        observer: EngineObserver | None = None,
        step_timeout: float | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        enable_prefix_caching: bool = True,
        max_prefill_with_decodes: int | None = None,
        max_scored_tokens_per_step: int | None = None,
        scheduling_policy: str = "fcfs",
        spyre_compat: SpyreCompat | None = None,
        structured_output_wait: bool = False,
        fault: Fault | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner = check_runner(runner)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(runner.config, tokenizer)
        self.vocab_size = runner.config.vocab_size
        self.block_size = runner.block_size
        self.num_kv_blocks = runner.num_kv_blocks
        self.max_model_len = runner.max_model_len
        self.numerics = runner.numerics       # what a step computes with (system_fingerprint)
        self.pooling = runner.pooling         # (type, normalize) of an embedding model, or None
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.card = card
        self.observer = observer or EngineObserver()
        self.blocks = BlockManager(self.num_kv_blocks, self.block_size,
                                   enable_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                                   on_release=lambda seq: (runner.forget(seq.seq_id),
                                                           speculator and speculator.forget(seq.seq_id)),
                                   max_prefill_with_decodes=max_prefill_with_decodes,
                                   max_scored_tokens_per_step=max_scored_tokens_per_step,
                                   policy=scheduling_policy, compat=spyre_compat, speculator=speculator,
                                   admits=lora_admits(runner))
        self.stats = EngineStats()
        # a grammar's mask needs its previous token: wait for it (True) or skip a step (False)
        self.structured_output_wait = structured_output_wait
        self._seq_ids = itertools.count()
        self._inbox = Inbox()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._life = Lifeline(step_timeout, self._fail_all, self._wake.set)
        self.on_death = on_death  # called once, from the thread that found the engine dead
        self._open = OpenRequests(self.scheduler, self.stats, lambda: self.observer,
                                  silenced=self._silenced)
        self._requests = self._open.by_id  # taken from the inbox, not answered in full
        self._outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len,
                                        lambda: self.observer, self._requests)
        self.accepting, self._failures = True, StepFailures()  # accepting: false while draining
        self.on_flush: Callable[[], None] | None = None  # after each iteration's updates (engine_process.py)
        self._fault = fault  # a test's injected fault (server/engine/watchdog.py), None when serving
        # published by the engine thread: (running, waiting) requests, waiting sequences
        self._counts, self._waiting_seqs = (0, 0), 0
        self._loras: tuple[list[str], list[str]] = ([], [])   # and the LoRA adapters of the running, the waiting

    # ---- public, any thread ---------------------------------------------------

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._life.dead
                and not self._inbox.closed)

    @property
    def error(self) -> BaseException | None:  # why the engine died (None while it lives, after a shutdown)
        return self._life.error

    @property
    def on_death(self) -> Callable[[BaseException], None] | None:
        return self._life.on_death

    @on_death.setter
    def on_death(self, callback: Callable[[BaseException], None] | None) -> None:
        self._life.on_death = callback

    @property
    def num_requests(self) -> int:
        """Requests added and not finished (including those still in the inbox)."""
        return len(self._requests) + self._inbox.num_requests()

    @property
    def num_waiting_requests(self) -> int:
        """Requests not admitted yet: in the inbox or with a sequence in the waiting queue."""
        return self._inbox.num_requests() + self._counts[1]

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences not admitted yet (a request of n choices and p prompts in the inbox counts
        n * p; the waiting queue's, preempted ones included): what a waiting limit counts."""
        return self._inbox.num_sequences() + self._waiting_seqs

    @property
    def num_running_requests(self) -> int:
        return self._counts[0]

    @property
    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters that running sequences use, and those that waiting ones do (names,
        sorted, each once): vLLM's ``vllm:lora_requests_info``."""
        return self._loras

    def _silenced(self) -> bool:
        """The engine died meanwhile and this is its loop: every request was answered."""
        return self._life.dead and threading.current_thread() is self._thread

    def _publish_counts(self) -> None:
        """Engine thread: request counts other threads read (they never touch the queues)."""
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        self._counts = (len(running), len(waiting))
        self._loras = (adapters_of(self.scheduler.running), adapters_of(self.scheduler.waiting))
        self._waiting_seqs = len(self.scheduler.waiting)
        self._flush()

    def _flush(self) -> None:
        """The updates of this iteration are all out: ``on_flush`` sends them on (a process's pipe)."""
        if self.on_flush is not None:
            self.on_flush()

    def check_request(self, num_prompt_tokens: int, max_tokens: int, params: list[GenerationParams] | None = None,
                      prompt_ids: list[int] | None = None) -> None:
        """Refuse up front what can never run: ``RequestRejected`` with the numbers (with ``params``,
        one per choice, and ``prompt_ids``: every value a step would carry, as ``add_request``)."""
        check_request(self, num_prompt_tokens, max_tokens, params, prompt_ids)

    def add_request(self, request_id: str, prompt_ids: list[int], params: list[GenerationParams],
                    on_update: Callable[[SeqUpdate], None]) -> None:
        """Queue a request with one ``GenerationParams`` per choice (``n`` of them).
        ``RequestRejected`` if it can never run; ``EngineUnavailable`` if the engine takes no
        more requests (dead, dying, shut down): never queued where nobody will answer it."""
        self.check_request(len(prompt_ids), max((p.max_tokens for p in params), default=0),
                           params, prompt_ids)
        now = time.monotonic()
        seqs = [Sequence(next(self._seq_ids), request_id, i, list(prompt_ids), p, now)
                for i, p in enumerate(params)]
        if not self._inbox.add(EngineRequest(request_id, seqs, on_update, now)):
            raise EngineUnavailable(self._life.unavailable_reason())
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone). Its blocks are freed within one step."""
        self._inbox.abort(request_id)
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started: one loop owns the scheduler and the runner")
        self._thread = threading.Thread(target=self._run, name="spyre-engine", daemon=True)
        self._thread.start()
        self._life.start()

    async def lora_update(self, op: str, name: str, path: str | None) -> tuple[int, str] | None:
        """Load or unload a LoRA adapter in this process's runner, off the event loop
        (server/lora/adapters.py ``apply_update``): None, or (HTTP status, why) when refused."""
        return await asyncio.to_thread(apply_update, self.runner, op, name, path)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._life.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop (engine thread only) ----------------------------------------

    def _run(self) -> None:
        inflight: Step | None = None
        try:
            while not self._stop and not self._life.dead:
                t0 = time.perf_counter()
                c0 = device_seconds(self.card)
                self._drain_inbox()
                if self._failures.suspects or self._failures.unverified:
                    if inflight is not None:          # drain: probes run on a quiet pipeline
                        self._collect_pair(inflight, None)
                        inflight = None
                    self._probe()
                    self._publish_counts()
                    continue
                if inflight is not None and self.structured_output_wait and holds_grammar_sample(inflight):
                    inflight = self._collect_pair(inflight, None)
                chunks = self.scheduler.schedule()
                step = self._launch(chunks)
                collected = inflight is not None
                if collected:
                    step = self._collect_pair(inflight, step)
                inflight = step
                self._publish_counts()
                if inflight is None:
                    # a read-back may have made ready sequences that wait for their token on
                    # the host (grammars): plan again at once, as after a failed launch
                    if collected:
                        self.stats.add_busy(t0, c0, self.card)
                    elif not chunks:                  # idle
                        self._wake.wait(0.05)
                        self._wake.clear()
                    continue
                self.stats.add_busy(t0, c0, self.card)
            if not self._life.dead:
                if inflight is not None:
                    self._collect(inflight)
                self._fail_all("the engine was shut down")
        except BaseException as exc:  # the loop must never die silently
            self._life.die(exc)
        self._counts, self._waiting_seqs, self._loras = (0, 0), 0, ([], [])

    def _drain_inbox(self) -> None:
        self._open.take(self._inbox.take(), self._outputs.start)

    def _launch(self, chunks: list[ScheduledChunk]) -> Step | None:
        if not chunks:
            return None
        now = time.monotonic()
        if self._fault is not None:  # outside the step's handling: fatal
            self._fault.at_launch(self.stats.steps + 1)
        try:
            work = [seq_work(c, self.eos_token_ids, self.vocab_size) for c in chunks]
            handle = self.runner.launch(work)
        except Exception as exc:
            log.warning("launch failed: %s: %s", type(exc).__name__, exc)
            self._step_failed(chunks, exc, ran=False)
            return None
        self.stats.steps += 1
        self.observer.on_step(sum(c.num_new for c in chunks))
        for c in chunks:
            req = self._requests.get(c.seq.request_id)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = now
                self.observer.on_scheduled(now - req.arrival, c.seq.num_prompt)
        return Step(chunks, handle, self.stats.steps, projected_of(handle, self.observer))

    def _collect_pair(self, step: Step, next_step: Step | None) -> Step | None:
        """Read back ``step``; when it failed, read back the step launched after it too
        (its results for ``step``'s sequences followed a failed step: discarded), so that
        nothing is in flight. Returns what is still in flight."""
        failed = self._collect(step)
        if failed is None:
            return next_step
        if next_step is not None:
            self._collect(next_step, poisoned=failed)
        return None

    def _collect(self, step: Step, poisoned: frozenset[int] = frozenset()) -> frozenset[int] | None:
        """Read back ``step`` and apply it: None, or when it failed the ids of its sequences.
        The chunks of ``poisoned`` sequences are dropped (the step before failed for them)."""
        try:
            with self._life.watch(f"step {step.number}"):
                if self._fault is not None:
                    self._fault.at_read_back(step.number)
                out = step.handle.result()
        except Exception as exc:
            log.warning("step failed: %s: %s", type(exc).__name__, exc)
            self._step_failed(step.chunks, exc, ran=True)
            return frozenset(c.seq.seq_id for c in step.chunks)
        if self._life.dead:  # the watchdog gave up on this step: its requests are answered
            return None
        self._failures.succeeded()
        row = {sid: i for i, sid in enumerate(out.seq_ids)}
        now = time.monotonic()
        touched: dict[str, set[int]] = {}
        num_new_tokens = 0
        for c in step.chunks:
            seq = c.seq
            if seq.seq_id in poisoned:
                self.scheduler.step_failed([c])
                continue
            rows = out.rows_of(row[seq.seq_id]) if c.sample else range(0)
            kept = self.scheduler.collected(c, int(out.token_ids[rows[0]]) if rows else None)
            if kept or not c.sample:          # its time on a real card (a discarded token's: not)
                self._outputs.on_step(seq, step.projected)
            if c.prompt_logprobs and seq.seq_id in out.prompt_logprobs:
                store_prompt_logprobs(c, out.prompt_logprobs[seq.seq_id])
            if c.sample:
                self.stats.count_proposals(len(c.draft), len(rows) - 1)
                if not kept:
                    self.stats.tokens_discarded += 1
                    continue
                stop, n = self._outputs.on_tokens(seq, out, rows, now, self.scheduler.kept_proposal)
                if stop is not None:
                    self._open.finish_seq(seq, *stop)
                num_new_tokens += n
            elif seq.params.pooling and seq.seq_id in row and not seq.is_finished:
                self._outputs.on_pooled(seq, out, row[seq.seq_id], now)
                self._open.finish_seq(seq, "stop")
            elif seq.params.max_tokens == 0 and c.start + c.num_new >= seq.num_prompt:
                if not seq.is_finished:
                    self._open.finish_seq(seq, "length")
            touched.setdefault(seq.request_id, set()).add(seq.index)
        if num_new_tokens:
            self.observer.on_tokens(num_new_tokens)
        for request_id, indices in touched.items():
            req = self._requests.get(request_id)
            if req is None:
                continue
            if req.num_finished == len(req.seqs):  # closed first: no count holds it once answered
                self._open.close(req)
            for seq in req.seqs:
                if seq.index in indices:
                    self._open.emit(req, seq)

    # ---- failures ---------------------------------------------------------------

    def _step_failed(self, chunks: list[ScheduledChunk], exc: BaseException, ran: bool) -> None:
        """A step raised, at its launch (``ran`` false: nothing of it ran) or when read back:
        the scheduler takes its chunks back, and the requests to blame fail."""
        self.stats.failed_steps += 1
        if ran:
            self.scheduler.step_failed(chunks)
        else:
            self.scheduler.undo_launch(chunks)
        blamed = self._failures.blame(chunks, exc, ran)
        for request_id, message in blamed.items():
            self._open.fail(request_id, message)
        if not blamed:                        # no request explains it: the card's, so far
            self._failures.count(exc)

    def _probe(self) -> None:
        """Nothing in flight: the canary of a failure blamed by elimination, or the next suspect
        alone from position 0 (a failure now is its own; success clears it)."""
        if self._failures.unverified:
            self._failures.check_card(self.runner, self.blocks, next(self._seq_ids))
            return
        seq = self._failures.suspects.popleft()
        if seq.is_finished:
            return
        self.scheduler.rewind(seq)
        step = self._launch(self.scheduler.schedule_solo(seq))
        if step is not None:
            self._collect(step)

    def _fail_all(self, message: str) -> None:
        """Answer every request with an error and take no new ones (the loop is over)."""
        queued = [item for kind, item in self._inbox.close() if kind == "add"]
        self._open.fail_all(message, queued)
        self._flush()


def adapters_of(seqs) -> list[str]:
    """The LoRA adapters ``seqs`` run with, each once, sorted."""
    return sorted({s.params.lora for s in seqs if s.params.lora is not None})
