"""How the engine dies: once, from whichever thread finds it cannot go on (the loop's, on an
exception outside a step or an ``EngineFatal``; the watchdog's, when a step does not return
within ``step_timeout``, ``server/engine/watchdog.py``). Every request is failed at once, later
requests are refused with ``EngineUnavailable`` (HTTP 503), and ``on_death`` is called once
(the CLI exits 1 so the replica is restarted)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from spyre_serve.server.engine.watchdog import Watchdog

log = logging.getLogger("spyre_serve.engine")


class EngineUnavailable(RuntimeError):
    """The engine takes no more requests: it died, is dying or was shut down (HTTP 503)."""

    status = 503


class Lifeline:
    """Whether the engine died and why, its watchdog, and its death. ``fail_all(message)``
    answers every request with an error; ``wake()`` wakes the loop so that it ends."""

    def __init__(self, step_timeout: float | None, fail_all: Callable[[str], None],
                 wake: Callable[[], None]) -> None:
        self.dead = False  # set once, under _lock
        self.error: BaseException | None = None  # why the engine died
        self.on_death: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()
        self._fail_all = fail_all
        self._wake = wake
        self._watchdog = Watchdog(step_timeout, self.die) if step_timeout else None

    def start(self) -> None:
        if self._watchdog is not None:
            self._watchdog.start()

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def watch(self, what: str):
        """Mark a wait for a step's results, for the watchdog."""
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.watch(what)

    def die(self, exc: BaseException) -> None:
        """The engine cannot go on (any thread): fail every request, refuse new ones, then
        tell ``on_death``. Once."""
        with self._lock:
            if self.dead:
                return
            self.dead = True
        self.error = exc
        log.error("engine died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self._fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        self.stop()
        self._wake()
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except Exception:
                log.exception("on_death failed")

    def unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine is not running: {type(self.error).__name__}: {self.error}"
        return "the engine is not running: it was shut down"
