"""The API process's side of the engine process (``server/engine/process.py``): ``EngineProcessClient``
answers what the API layer asks of an ``Engine`` (sizes, counts, ``check_request``,
``add_request``, ``abort``, ``alive``, ``shutdown``) from what the engine process sent;
``spawn_engine`` starts that process, ``wait_ready`` waits until it is ready, and ``build_api``
does both for ``cli.build``.

Two threads of its own: the sender takes the requests and aborts queued since it last sent and
sends them as one message (the event loop never writes to the pipe); the receiver takes each
batch of updates and hands every update to its request's ``on_update`` (the bridge makes that
an ``asyncio`` queue put). The engine process's death is seen at once, by its last message
("dead") or by the pipe's end: every open request gets an error update, ``alive`` turns false,
``on_death`` is called once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spyre_serve.server.engine.death import EngineUnavailable
from spyre_serve.server.engine.outputs import SeqUpdate, error_update
from spyre_serve.server.engine.process import EngineCounts, EngineInfo
from spyre_serve.server.sched.admission import check_request
from spyre_serve.server.sched.sequence import GenerationParams

log = logging.getLogger("spyre_serve.api")

METRICS_TIMEOUT = 2.0  # seconds /metrics waits for the engine process's part
LORA_TIMEOUT = 120.0  # seconds a runtime LoRA load waits for the engine process (reading the files)


@dataclass(slots=True)
class _Open:
    on_update: Callable[[SeqUpdate], None]
    n: int
    finished: set[int] = field(default_factory=set)


class EngineProcessClient:
    """An ``Engine`` in another process, seen from an API process (one pipe). ``process`` is the
    engine's ``multiprocessing.Process`` when this process started it, None when a sibling runs
    it (``--api-server-count``: the pipe alone says it is gone)."""

    def __init__(self, conn, process, info: EngineInfo) -> None:
        self.conn = conn
        self.process = process
        self.info = info
        self.max_model_len = info.max_model_len
        self.num_kv_blocks = info.num_kv_blocks
        self.block_size = info.block_size
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.numerics = info.numerics
        self.pooling = info.pooling
        self.accepting = True   # false while draining for shutdown
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()          # _open, _sent, the outgoing queue
        self._cond = threading.Condition(self._lock)
        self._outgoing: list[tuple] = []
        self._sent = [0, 0]   # requests and sequences sent
        self._counts = EngineCounts()
        self._dead = False
        self._stopping = False
        self._closed = False
        self._tokens = itertools.count()
        self._replies: dict[int, concurrent.futures.Future] = {}
        # messages each way and what they carried: batches, not a round trip per token
        self.traffic = {"messages_out": 0, "items_out": 0, "batches_in": 0, "updates_in": 0}
        self._threads = [threading.Thread(target=self._send_loop, name="engine-client-send", daemon=True),
                         threading.Thread(target=self._receive_loop, name="engine-client-receive", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- what the API layer reads --------------------------------------------------------

    @property
    def alive(self) -> bool:
        return (not self._dead and not self._closed and self._counts.alive
                and (self.process is None or self.process.is_alive()))

    @property
    def num_requests(self) -> int:
        """Requests added and not answered in full."""
        return len(self._open)

    @property
    def num_running_requests(self) -> int:
        return self._counts.running

    @property
    def num_waiting_requests(self) -> int:
        """The engine's waiting requests, and those sent since its last count: waiting too."""
        return self._counts.waiting_requests + max(0, self._sent[0] - self._counts.received[0])

    @property
    def num_waiting_sequences(self) -> int:
        return self._counts.waiting_seqs + max(0, self._sent[1] - self._counts.received[1])

    def check_request(self, num_prompt_tokens: int, max_tokens: int,
                      params: list[GenerationParams] | None = None, prompt_ids: list[int] | None = None) -> None:
        check_request(self, num_prompt_tokens, max_tokens, params, prompt_ids)

    # ---- requests out --------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: list[GenerationParams],
                    on_update: Callable[[SeqUpdate], None]) -> None:
        """As ``Engine.add_request``: checked here, sent with the next batch."""
        self.check_request(len(prompt_ids), max((p.max_tokens for p in params), default=0), params, prompt_ids)
        with self._cond:
            if not self.alive or self._stopping:
                raise EngineUnavailable(self._why_unavailable())
            self._open[request_id] = _Open(on_update, len(params))
            self._sent[0] += 1
            self._sent[1] += len(params)
            self._outgoing.append(("add", request_id, list(prompt_ids), params, len(params)))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._open.pop(request_id, None) is None:
                return
            self._outgoing.append(("abort", request_id))
            self._cond.notify()

    async def metrics_text(self) -> bytes:
        """The engine process's /metrics text; empty when it does not answer within METRICS_TIMEOUT."""
        if not self.alive:
            return b""
        try:
            return await self._ask(("metrics",), METRICS_TIMEOUT)
        except TimeoutError:
            return b""

    async def lora_update(self, op: str, name: str, path: str | None):
        """Load or unload a LoRA adapter in the engine process (server/lora/adapters.py ``apply_update``):
        None, or (HTTP status, why) when refused."""
        if not self.alive:
            return 503, "the engine is not running"
        return await self._ask(("lora", op, name, path), LORA_TIMEOUT)

    async def _ask(self, item: tuple, timeout: float):
        """Send ``item`` with a reply token (its second element) and wait for the reply's body."""
        token = next(self._tokens)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._replies[token] = future
            self._outgoing.append((item[0], token, *item[1:]))
            self._cond.notify()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        finally:
            self._replies.pop(token, None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop (it answers what is running with an error) and wait for
        it; then end every request still open here."""
        with self._cond:
            if self._closed:
                return
            self._stopping = True
            self._outgoing.append(("shutdown", timeout))
            self._cond.notify()
        if self.process is None:             # a sibling's: it answers, then says "closed"
            self._threads[1].join(timeout + 2.0)
        else:
            self.process.join(timeout + 2.0)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s: killed", timeout + 2.0)
                self.process.kill()
                self.process.join(5.0)
        for t in self._threads:
            t.join(2.0)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._fail_open("the engine was shut down")

    def _why_unavailable(self) -> str:
        if self._stopping or self._closed:
            return "the engine was shut down"
        return f"the engine process is not running ({self.error or 'stopped'})"

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._outgoing and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                items, self._outgoing = self._outgoing, []
            message = []
            self.traffic["messages_out"] += 1
            self.traffic["items_out"] += len(items)
            for item in items:  # a request's parameters pickled alone (engine_process.py)
                if item[0] == "add":
                    item = (*item[:3], pickle.dumps(item[3], protocol=pickle.HIGHEST_PROTOCOL), item[4])
                elif item[0] == "shutdown":
                    self._send(("in", message))
                    self._send(item)
                    return
                message.append(item)
            self._send(("in", message))

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError, ValueError):
            pass  # the receiver sees the pipe's end

    # ---- updates in ----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        why = None
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "dead":
                why = message[1]
                break
            if message[0] == "closed":
                break
            _, updates, counts, replies = message
            self.traffic["batches_in"] += 1
            self.traffic["updates_in"] += len(updates)
            for request_id, update in updates:
                self._deliver(request_id, update)
            self._counts = counts
            for _, token, body in replies:
                future = self._replies.get(token)
                if future is not None and not future.done():
                    future.set_result(body)
        if self._stopping:
            return
        if self.process is not None:
            self.process.join(1.0)
        code = "unknown" if self.process is None else self.process.exitcode
        self._die(why or f"the engine process exited (exit code {code})")

    def _deliver(self, request_id: str, update: SeqUpdate) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return   # aborted here: the engine's last words for it are not wanted
        if update.finish_reason is not None:
            entry.finished.add(update.index)
            if len(entry.finished) == entry.n:
                with self._lock:
                    self._open.pop(request_id, None)
        try:
            entry.on_update(update)
        except Exception:  # a closed event loop must not stop the receiver
            log.exception("delivering an update for %s failed", request_id)

    def _die(self, why: str) -> None:
        self.error = RuntimeError(why)
        self._dead = True
        log.critical("the engine process died: %s", why)
        self._fail_open(f"the engine died: {why}")
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self.on_death is not None:
            self.on_death(self.error)

    def _fail_open(self, message: str) -> None:
        with self._lock:
            entries, self._open = self._open, {}
        for entry in entries.values():
            for index in range(entry.n):
                if index not in entry.finished:
                    try:
                        entry.on_update(error_update(index, message))
                    except Exception:
                        log.exception("failing a request")


def spawn_engine(settings, api_processes: int = 1) -> tuple[list, object]:
    """Start the engine process for ``settings`` with a pipe for each of ``api_processes``:
    (the pipes' API ends, the process); ``wait_ready`` waits on a pipe."""
    from spyre_serve.server.engine import process as engine_process

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked Numba threads
    pairs = [ctx.Pipe(duplex=True) for _ in range(api_processes)]
    process = ctx.Process(target=engine_process.main, args=(settings, [c for _, c in pairs]), name="spyre-engine")
    process.start()
    for _, child in pairs:
        child.close()
    return [p for p, _ in pairs], process


class StartRefused(ValueError):
    """The engine process refused what it was given (``process.is_refusal``): the message alone. A
    ValueError, as what it refused was, so that ``is_refusal`` says so in the API process too."""


def wait_ready(conn, process=None, timeout: float = 3600.0) -> EngineProcessClient:
    """Wait until the engine process is ready (loaded, warmed up): its client. ``RuntimeError``
    with the engine process's reason when it could not start."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        if process is not None and not process.is_alive():
            raise RuntimeError(f"the engine process exited while starting (exit code {process.exitcode})")
        if time.monotonic() > deadline:
            if process is not None:
                process.kill()
            raise RuntimeError(f"the engine process was not ready within {timeout:.0f} s")
    try:
        message = conn.recv()
    except EOFError:
        raise RuntimeError("the engine process exited while starting") from None
    if message[0] != "ready":
        if message[2]:
            raise StartRefused(message[1])
        raise RuntimeError(f"the engine process could not start: {message[1]}")
    return EngineProcessClient(conn, process, message[1])


def build_api(settings, conn=None):
    """The API process's engine (a client of the engine process: started here, or a sibling's
    on ``conn``), model (its tokenizer, no weights) and metrics: the tokenizer loads while the
    engine process loads the weights."""
    from pathlib import Path

    from spyre_serve.models import LoadedModel, resolve_model, tokenizer_of
    from spyre_serve.server.metrics import ApiMetrics

    path = resolve_model(settings.model)      # an unknown model is refused here, before a process
    process = None
    if conn is None:
        (conn,), process = spawn_engine(settings)
    try:
        tokenizer = tokenizer_of(path)
        client = wait_ready(conn, process)
    except BaseException:
        if process is not None and process.is_alive():
            process.kill()
        raise
    info = client.info
    model = LoadedModel(info.model_name, Path(info.model_path), info.config, tokenizer, None, info.stored_dtype)
    return client, model, ApiMetrics(client, settings.served_name(model))
