"""What ends the engine when it cannot go on: a step that does not return, and the test hook.

``Watchdog`` is a thread that watches the engine wait for a step's results:
``with watchdog.watch("..."): handle.result()``; if that has not returned after ``timeout``
seconds (``--step-timeout``), ``on_stall`` is called once, from the watchdog's thread, with
the ``EngineStalled`` that says so (the engine then dies: in-flight requests fail, the server
exits 1 to be restarted). Launches are not watched: without ``--warmup`` the first launch of
a bucket compiles its program, which may take minutes; a launch itself never waits on the card.

``Fault`` is a test-only hook, read from the environment variable ``SPYRE_TEST_ENGINE_FAULT``
by the engine: ``die@N`` makes the launch of step N raise ``EngineFatal`` outside the step's
own error handling (the engine loop dies), ``hang@N`` makes reading step N back block
forever (the watchdog fires). Unset, or empty: no fault.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("spyre_serve.engine")

FAULT_ENV = "SPYRE_TEST_ENGINE_FAULT"


class EngineFatal(RuntimeError):
    """The engine cannot go on: its loop ends, every request fails, it reports dead."""


class EngineStalled(EngineFatal):
    """A step did not return within the watchdog time."""


class Watchdog:
    def __init__(self, timeout: float, on_stall: Callable[[EngineStalled], None]) -> None:
        if not timeout > 0:
            raise ValueError(f"the step timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.on_stall = on_stall
        self._since: float | None = None  # when the blocking call being watched began
        self._what = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spyre-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def watch(self, what: str):
        """Mark a blocking call (one thread at a time: the engine's)."""
        self._what = what
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _run(self) -> None:
        tick = min(1.0, self.timeout / 10)
        while not self._stop.wait(tick):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                exc = EngineStalled(f"{self._what} has not returned in {time.monotonic() - since:.1f} s "
                                    f"(the step timeout is {self.timeout:g} s, --step-timeout)")
                log.error("watchdog: %s", exc)
                self.on_stall(exc)
                return


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str   # "die" | "hang"
    step: int   # the launch it hits (1 = the first)

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get(FAULT_ENV, "").strip()
        if not text:
            return None
        kind, _, step = text.partition("@")
        if kind not in ("die", "hang") or not step.isdigit() or int(step) < 1:
            raise ValueError(f"{FAULT_ENV}={text!r}: want die@N or hang@N, N >= 1")
        log.warning("test fault armed: %s at step %s (%s)", kind, step, FAULT_ENV)
        return cls(kind, int(step))

    def at_launch(self, step: int) -> None:
        """Before launch number `step`: ``die`` raises there."""
        if self.kind == "die" and step == self.step:
            raise EngineFatal(f"injected fault at step {step} ({FAULT_ENV})")

    def at_read_back(self, step: int) -> None:
        """Before step number `step` is read back: ``hang`` blocks there, for good."""
        if self.kind == "hang" and step == self.step:
            log.warning("test fault: step %d hangs (%s)", step, FAULT_ENV)
            threading.Event().wait()
