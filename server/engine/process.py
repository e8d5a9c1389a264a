"""The engine in a process of its own (vLLM v1's engine core): the card, the scheduler and the
step loop, with no HTTP, JSON, tokenizing or templating beside them to take their GIL.

    API process(es)                          engine process (this module's ``main``)
    EngineProcessClient.add_request/abort  --->     EngineHost.serve (the main thread, waiting on every
      (batched by its sender thread)           API process's pipe): each message a batch of ("add",
                                               id, prompt, params bytes) and ("abort", id), handed
                                               to Engine.add_request/abort
    EngineProcessClient's receiver thread  <---     Outbox: the engine's SeqUpdates, collected as the
      (each update to its request's            loop answers, sent once per loop iteration as one
       on_update)                              ("batch", updates, counts, replies) per API process

Messages go over ``multiprocessing`` pipes (pickled). Per step one batch goes each way at
most, never a round trip per token. A request's parameters are pickled on their own, so that
a grammar this process cannot compile fails that request, not the batch it came in.

The engine process dies with its engine: ``on_death`` sends ("dead", why) after the updates
that answered every request, and the process exits 1 (the API process sees the message, or
the pipe's end if the process was killed, at once). It ends when its last API process has left
(asked it to: "shutdown", or its pipe closed: its parent is gone): the engine answers what is
running with an error, the last batch goes out, and the process exits 0. An API process that
leaves while others stay takes its requests with it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

log = logging.getLogger("spyre_serve.engine")

# ---- what crosses the pipe ------------------------------------------------------------------


def is_refusal(exc: BaseException) -> bool:
    """Whether a start failed on what it was given (a model, checkpoint or flag it cannot serve,
    a file it cannot read, a card too small for the model): said in one line, exit code 2, as a
    bad flag is. Anything else is a fault, shown with its traceback."""
    from spyre_serve.device.memory import DeviceError

    return isinstance(exc, ValueError | DeviceError | FileNotFoundError | NotADirectoryError | PermissionError)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API process needs of the engine and its model, sent once when it is ready."""

    model_name: str
    model_path: str
    config: object            # models.GraniteConfig
    stored_dtype: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    numerics: str
    pooling: tuple[str, bool] | None = None   # an embedding model's (type, normalize)


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """The engine's request counts as of a batch; ``received`` counts the requests and
    sequences this API process sent that the engine has taken, so that the API counts those it
    sent after as waiting too (its admission check)."""

    running: int = 0
    waiting_requests: int = 0
    waiting_seqs: int = 0
    received: tuple[int, int] = (0, 0)
    alive: bool = True


# ---- the engine process's side --------------------------------------------------------------


class Outbox:
    """The updates and replies for one API process, sent by their own thread: the engine's loop
    never waits on a pipe. ``flush`` (the engine, once per loop iteration) sends what is queued."""

    def __init__(self, conn: Connection, counts) -> None:
        self.conn = conn
        self.counts = counts              # () -> EngineCounts for this API process
        self._cond = threading.Condition()
        self._updates: list = []
        self._replies: list = []
        self._last: list = []             # a final message ("dead", why)
        self._flush = False
        self._closed = False
        self._sent_counts = None
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def update(self, request_id: str, update) -> None:
        with self._cond:
            self._updates.append((request_id, update))

    def reply(self, item) -> None:
        with self._cond:
            self._replies.append(item)
            self._flush = True
            self._cond.notify()

    def flush(self) -> None:
        """Send what is queued, or the counts alone when they changed (admission reads them)."""
        with self._cond:
            if not self._flush and (self._updates or self.counts() != self._sent_counts):
                self._flush = True
                self._cond.notify()

    def close(self, last=None, timeout: float = 5.0) -> None:
        """Send what is queued (and ``last``), then stop."""
        with self._cond:
            if last is not None:
                self._last.append(last)
            self._closed = self._flush = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._flush:
                    self._cond.wait()
                updates, self._updates = self._updates, []
                replies, self._replies = self._replies, []
                last, self._last = self._last, []
                self._flush, closed = False, self._closed
            try:
                counts = self._sent_counts = self.counts()
                self.conn.send(("batch", updates, counts, replies))
                for message in last:
                    self.conn.send(message)
                if closed and not last:
                    self.conn.send(("closed",))     # nothing more for this API process
            except (OSError, EOFError, BrokenPipeError):
                return          # the API process is gone: nobody to tell
            if closed:
                return


class EngineHost:
    """The engine and the pipes of its API processes, in the engine process."""

    def __init__(self, engine, metrics, conns: list[Connection]) -> None:
        self.engine = engine
        self.metrics = metrics
        self.conns = conns
        self.received = [(0, 0)] * len(conns)  # requests and sequences taken from each API process
        # request id -> (its API process, choices not finished): whose requests go when one leaves
        self.owners: dict[str, tuple[int, int]] = {}
        self.outboxes = [Outbox(c, lambda i=i: self._counts(i)) for i, c in enumerate(conns)]
        self.died = threading.Event()
        engine.on_flush = self.flush
        engine.on_death = self._on_death
        if engine.error is not None:           # died before it was told whom to tell
            self._on_death(engine.error)

    def _counts(self, i: int) -> EngineCounts:
        e = self.engine
        return EngineCounts(e.num_running_requests, e.num_waiting_requests, e.num_waiting_sequences,
                            self.received[i], e.alive)

    def flush(self) -> None:
        for box in self.outboxes:
            box.flush()

    def _on_death(self, exc: BaseException) -> None:
        log.critical("engine died (%s: %s): the engine process exits 1", type(exc).__name__, exc)
        self.died.set()

    def serve(self) -> int:
        """Take messages until every API process has left (its "shutdown", or its pipe's end) or
        the engine dies: the process's exit code. An API process that leaves while others stay
        takes its requests with it (aborted here; it answers them itself)."""
        open_conns = list(self.conns)
        while open_conns and not self.died.is_set():
            for conn in wait(open_conns, timeout=0.1):
                i = self.conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = ("shutdown", 10.0)      # that API process is gone
                if message[0] != "shutdown":
                    self._take(i, message[1])
                    continue
                open_conns.remove(conn)
                if not open_conns:
                    return self._stop(float(message[1]))
                self._leave(i)
        if self.died.is_set():
            why = self.engine.error
            text = f"{type(why).__name__}: {why}" if why is not None else "the engine died"
            for box in self.outboxes:
                box.close(("dead", text))
            return 1
        return self._stop(10.0)

    def _leave(self, i: int) -> None:
        """API process ``i`` is gone or going: its requests are aborted, its outbox closed."""
        for request_id, (owner, _) in list(self.owners.items()):
            if owner == i:
                self.engine.abort(request_id)
                self.owners.pop(request_id, None)
        self.outboxes[i].close()

    def _stop(self, timeout: float) -> int:
        self.engine.shutdown(timeout)
        for box in self.outboxes:
            box.close()
        return 0

    def _take(self, i: int, items: list) -> None:
        for item in items:
            kind = item[0]
            if kind == "add":
                self._add(i, *item[1:])
            elif kind == "abort":
                self.engine.abort(item[1])
                self.owners.pop(item[1], None)
            elif kind == "metrics":
                body, _ = self.metrics.render()
                self.outboxes[i].reply(("metrics", item[1], body))
            elif kind == "lora":                 # (lora, token, op, name, path): server/lora/adapters.py
                threading.Thread(target=self._lora_update, args=(self.outboxes[i], item), name="engine-lora",
                                 daemon=True).start()      # reading the files holds no request back

    def _lora_update(self, box: Outbox, item: tuple) -> None:
        """Apply a LoRA load or unload (the arena takes it under its lock) and reply: None, or
        (status, why); an unexpected failure is a 500 naming it, never a reply left unsent (the
        API process logs that text under the request id and shows the client only the id)."""
        from spyre_serve.server.lora.adapters import apply_update

        try:
            refused = apply_update(self.engine.runner, *item[2:])
        except Exception as exc:       # noqa: BLE001 (the API process waits for this reply)
            log.exception("LoRA %s of %s failed", item[2], item[3])
            refused = (500, f"LoRA {item[2]} of {item[3]!r} failed: {type(exc).__name__}: {exc}")
        box.reply(("lora", item[1], refused))

    def _add(self, i: int, request_id: str, prompt_ids: list[int], params_bytes: bytes, n: int) -> None:
        from spyre_serve.server.engine.outputs import error_update

        box = self.outboxes[i]
        reqs, seqs = self.received[i]
        self.received[i] = (reqs + 1, seqs + n)
        owners = self.owners
        owners[request_id] = (i, n)

        def on_update(update, rid=request_id) -> None:
            box.update(rid, update)
            if update.finish_reason is not None:     # the last of its choices: no owner any more
                owner, left = owners.get(rid, (i, 1))
                if left <= 1:
                    owners.pop(rid, None)
                else:
                    owners[rid] = (owner, left - 1)

        try:
            params = pickle.loads(params_bytes)
            self.engine.add_request(request_id, prompt_ids, params, on_update)
        except Exception as exc:  # refused here (dying, or a grammar that would not compile)
            message = str(exc) or type(exc).__name__
            owners.pop(request_id, None)
            for index in range(n):
                box.update(request_id, error_update(index, message))
            box.flush()


def main(settings, conns: list[Connection]) -> None:
    """The engine process: load the model onto a card, warm up, start the engine, tell every API
    process ``EngineInfo`` ("ready"), then serve them. A failure before that is sent as
    ("failed", text) and the process exits 1."""
    from spyre_serve.server.launch.cli import keep_torch_out

    keep_torch_out()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the API process drains, then stops this one
        signal.signal(sig, signal.SIG_IGN)
    from spyre_serve.device.process import configure

    configure()
    # tqdm's default lock holds a multiprocessing semaphore, which _exit's os._exit leaves for
    # the resource tracker to report as leaked when the server stops; this process's progress
    # bars are drawn by its threads alone
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    from spyre_serve.server.launch import streams

    streams.install()     # a full disk under the log drops log lines, never the engine
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        from spyre_serve.server.launch.cli import load_engine

        loaded = load_engine(settings, progress=True)
    except BaseException as exc:  # noqa: BLE001 - told to the API process, which exits with it
        refused = is_refusal(exc)
        text = str(exc) if refused else f"{type(exc).__name__}: {exc}"
        # a refusal is the API process's one line to say; a fault is logged here with its traceback
        (log.debug if refused else log.error)("the engine process could not start: %s\n%s", text,
                                              traceback.format_exc())
        for conn in conns:
            try:
                conn.send(("failed", text, refused))
            except OSError:
                pass
        _exit(1)
    engine, model, runner = loaded.engine, loaded.model, loaded.runner
    info = EngineInfo(model.name, str(model.path), model.config, model.stored_dtype, engine.max_model_len,
                      engine.num_kv_blocks, engine.block_size, engine.vocab_size,
                      tuple(engine.eos_token_ids), engine.numerics, engine.pooling)
    from spyre_serve.server.structured_output.grammars import Grammars, serve_grammars

    serve_grammars(Grammars(model.tokenizer, engine.vocab_size, engine.eos_token_ids))
    host = EngineHost(engine, loaded.metrics, conns)
    for conn in conns:
        conn.send(("ready", info))
    code = host.serve()
    if code == 0:
        runner.close()
        loaded.card.close()
    _exit(code)


def _exit(code: int) -> None:
    """Exit without waiting for threads (a dead engine may leave one stuck in a kernel)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
