"""Blocking work of a request (rendering its chat template, tokenizing its prompts) off the
event loop, within a time bound.

On the event loop, a template that renders for seconds (a heavy but legal template, or a
light one fed a huge conversation) would freeze every stream and ``/health`` with it. So
the work runs on a thread of its own, at most ``workers`` at once, and the request waits
for it up to ``timeout`` seconds. Past that the request is refused (``APIError``) and the
thread is interrupted: ``PyThreadState_SetAsyncExc`` raises ``Interrupted`` in it at its
next Python instruction (a template renders as Python code, so it stops there; a call into
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

    def __init__(self, workers: int, timeout: float) -> None:
        self.workers = workers
        self.timeout = timeout
        self._slots = asyncio.Semaphore(workers)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a worker thread; its exception if it raised; ``TimedOut`` if it
        took longer than ``timeout`` (or the caller was cancelled), after interrupting it."""
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        worker = _Worker(lambda: fn(*args), loop, future, self._slots.release)
        try:
            worker.start()
        except BaseException:
            self._slots.release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            worker.interrupt()
            raise TimedOut(f"over {self.timeout:g} s") from None
        except asyncio.CancelledError:
            worker.interrupt()
            raise
