"""Blocking work of a request (rendering its chat template, tokenizing its prompts) off the
event loop, within a time bound.

On the event loop, a template that renders for seconds (a heavy but legal template, or a
light one fed a huge conversation) would freeze every stream and ``/health`` with it. So
the work runs on a thread of its own, at most ``workers`` at once, and the request waits
for it up to ``timeout`` seconds. A request that finds every worker busy waits for one at
most ``wait`` seconds, then is refused (``PoolFull``: 503 + Retry-After), so a flood of slow
renders cannot queue every chat, completion and tokenize request without bound; ``stats``
(workers, busy, waiting, refused) is what /health and /metrics show. Past ``timeout`` the
request is refused (``TimedOut``) and the thread is interrupted: ``PyThreadState_SetAsyncExc`` raises ``Interrupted`` in
it at its next Python instruction (a template renders as Python code, so it stops there; a call into
Rust or C finishes first, and is bounded by the body's size). The thread's slot is given
back when the thread ends, not when the request gives up, so stuck threads cannot pile up
beyond ``workers``.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Interrupted(BaseException):
    """Raised inside a worker thread whose caller stopped waiting. A BaseException, so that
    the ``except Exception`` of the code it interrupts (transformers, Jinja) lets it through."""


class TimedOut(Exception):
    """The work took longer than the time bound (the thread has been told to stop)."""


class PoolFull(Exception):
    """Every worker stayed busy for the whole wait: the work was not started."""


class _Worker(threading.Thread):
    """One call of ``fn`` on its own thread, settling ``future`` on ``loop`` when it ends."""

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop, future: asyncio.Future,
                 on_end: Callable[[], None]) -> None:
        super().__init__(name="spyre-offload", daemon=True)
        self.fn, self.loop, self.future, self.on_end = fn, loop, future, on_end
        self.lock = threading.Lock()
        self.running = True  # still inside fn: an interrupt may be sent
        self.abandoned = False  # the caller stopped waiting: the outcome goes nowhere

    def run(self) -> None:
        result, error = None, None
        try:
            try:
                result = self.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request as it is
                error = exc
            finally:
                with self.lock:
                    self.running = False
        except Interrupted as exc:  # sent just as fn returned: raised in the finally above
            error = exc
        try:
            self.loop.call_soon_threadsafe(self._settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _settle(self, result, error) -> None:
        self.on_end()
        if self.abandoned or self.future.done():
            self.future.cancel()
            return
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)

    def interrupt(self) -> None:
        """Raise ``Interrupted`` in the thread if it is still inside ``fn``."""
        with self.lock:
            self.abandoned = True
            if self.running and self.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident),
                                                           ctypes.py_object(Interrupted))


class Offload:
    """Runs blocking calls on threads, ``workers`` at most at once, each within ``timeout``
    seconds. Made on (or before) the event loop it serves."""

    def __init__(self, workers: int, timeout: float, wait: float = 1.0) -> None:
        self.workers = workers
        self.timeout = timeout
        self.wait = wait
        self._slots = asyncio.Semaphore(workers)
        self.busy = 0        # workers running (a stuck one counts until its thread ends)
        self.waiting = 0     # requests waiting for a worker
        self.refused = 0     # requests refused with every worker busy (PoolFull)

    def stats(self) -> dict[str, int]:
        return {"workers": self.workers, "busy": self.busy, "waiting": self.waiting, "refused": self.refused}

    def _release(self) -> None:
        self.busy -= 1
        self._slots.release()

    async def _acquire(self) -> bool:
        """A worker's slot within ``wait`` seconds (True), else none taken (False). A slot
        that arrives as the wait ends, or as the caller is cancelled, is kept or given back:
        never lost (``asyncio.wait_for`` on Python 3.11 can drop a result at its timeout)."""
        task = asyncio.ensure_future(self._slots.acquire())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.wait)
        except asyncio.CancelledError:
            task.cancel()
            if task.done() and not task.cancelled():
                self._slots.release()
            raise
        if done:
            return True
        task.cancel()
        try:
            return await task          # acquired just before the cancel took effect
        except asyncio.CancelledError:
            return False

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a worker thread; its exception if it raised; ``PoolFull`` if no
        worker was free within ``wait`` seconds; ``TimedOut`` if it took longer than
        ``timeout`` (or the caller was cancelled), after interrupting it."""
        self.waiting += 1
        try:
            acquired = await self._acquire()
        finally:
            self.waiting -= 1
        if not acquired:
            self.refused += 1
            raise PoolFull(f"all {self.workers} workers busy for {self.wait:g} s")
        self.busy += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        worker = _Worker(lambda: fn(*args), loop, future, self._release)
        try:
            worker.start()
        except BaseException:
            self._release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            worker.interrupt()
            raise TimedOut(f"over {self.timeout:g} s") from None
        except asyncio.CancelledError:
            worker.interrupt()
            raise
