"""Stream: an ordered FIFO queue of commands run by one worker thread.

Enqueueing returns at once (it blocks only when `depth` commands are already
waiting behind the running one: backpressure). Commands run in the order enqueued. A command that
raises does not stop the stream: the exception is kept and re-raised on the
host, chained (`raise ... from original`), by the next `synchronize()` or
event wait that covers the command.

Compute commands hold the card's compute lock while they run (the card has
one set of cores); copies, event records and waits do not.
"""

from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spyre_serve.device.memory import DeviceError, DeviceTensor

if TYPE_CHECKING:
    from spyre_serve.device.card import Card
    from spyre_serve.device.event import Event

DEFAULT_DEPTH = 64


class DeviceCommandError(DeviceError):
    """A command failed on a stream; `__cause__` is the original exception, with its traceback."""

    def __init__(self, stream: str, seq: int, label: str, exc: BaseException, more: int):
        self.stream, self.seq, self.label, self.more = stream, seq, label, more
        extra = f" (and {more} later failed commands)" if more else ""
        super().__init__(f"command #{seq} '{label}' on stream '{stream}' failed: {exc!r}{extra}")


@dataclass(slots=True)
class _Failure:
    seq: int
    label: str
    exc: BaseException


_STOP = object()
_NEVER = sys.maxsize


class Stream:
    def __init__(self, card: Card, name: str = "stream", depth: int = DEFAULT_DEPTH):
        if depth < 1:
            raise DeviceError(f"stream depth must be at least 1, got {depth}")
        self.card = card
        self.name = name
        self.depth = depth
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # bounded by _submit (depth)
        self._submit_lock = threading.Lock()  # seq order == queue order across host threads
        self._done = threading.Condition()  # guards _completed and _failures
        self._submitted = 0
        self._completed = 0
        self._wake_at = _NEVER  # lowest seq a waiter is blocked on
        self._failures: list[_Failure] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, submitted={self._submitted}, completed={self._completed})"

    # enqueueing ---------------------------------------------------------------
    def enqueue(self, fn, *args, compute: bool = True, label: str | None = None) -> int:
        """Run `fn(*args)` on this stream after everything enqueued before; returns its number.

        `compute=True` (the default) holds the card's compute lock while `fn` runs.
        """
        return self._submit(fn, args, compute, label or getattr(fn, "__name__", "command"))

    def copy_h2d(self, dst: DeviceTensor, src: np.ndarray) -> int:
        """Copy host `src` into `dst`; `src` is snapshotted now, so it may be reused at once."""
        _check_same(dst, src, "copy_h2d")
        snapshot = np.array(src, dtype=dst.dtype, copy=True, order="C")
        return self._submit(_h2d, (self.card, dst, snapshot), False, "copy_h2d")

    def copy_d2h(self, dst: np.ndarray, src: DeviceTensor) -> int:
        """Fill host `dst` from `src` when the stream reaches this command."""
        _check_same(src, dst, "copy_d2h")
        if not dst.flags.writeable:
            raise DeviceError("copy_d2h: host destination is read-only")
        return self._submit(_d2h, (self.card, dst, src), False, "copy_d2h")

    def record_event(self, event: Event | None = None) -> Event:
        from spyre_serve.device.event import Event

        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later commands on this stream wait until `event` (as recorded now) has completed."""
        other, seq = event.stream, event.position
        if other is not None and other is not self:  # on its own stream, FIFO order already holds
            self._submit(other.wait_until, (seq,), False, "wait_event")

    # host side --------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every command enqueued so far; re-raise the first that failed."""
        with self._submit_lock:
            target = self._submitted
        self.wait_until(target)
        self.raise_failures(target)

    def query(self) -> bool:
        """True when every command enqueued so far has run."""
        with self._done:
            return self._completed >= self._submitted

    @property
    def position(self) -> int:
        """The number of the last command enqueued so far (0 before any): a point of this
        stream that `reached` can test later without enqueueing an event."""
        return self._submitted

    def on_worker(self) -> bool:
        """True on this stream's own worker thread (where waiting on the stream deadlocks)."""
        return threading.current_thread() is self._thread

    def reached(self, position: int) -> bool:
        """True once every command up to `position` has run."""
        return self._completed >= position

    def close(self) -> None:
        """Finish pending commands and stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put((0, _STOP, (), False, "stop"))
        self._thread.join()

    # what the card and events use of a stream (public, as torch.cuda's Stream and Event are
    # to each other): wait_until(position), raise_failures(upto), position, reached, on_worker
    def _submit(self, fn, args, compute: bool, label: str) -> int:
        if self._closed:
            raise DeviceError(f"stream '{self.name}' is closed")
        with self._submit_lock:
            if self._submitted - self._completed > self.depth:  # depth waiting + 1 running: wait
                self.wait_until(self._submitted - self.depth)
            self._submitted += 1
            seq = self._submitted
            self._queue.put((seq, fn, args, compute, label))
        return seq

    def wait_until(self, seq: int) -> None:
        """Block until command `seq` has run. The worker wakes waiters only when the
        lowest target is reached (`_wake_at`), so a waiter costs nothing per command."""
        if self._completed >= seq:
            return
        if threading.current_thread() is self._thread:
            raise DeviceError(f"a command on stream '{self.name}' waited on its own stream (deadlock)")
        with self._done:
            while True:
                if seq < self._wake_at:
                    self._wake_at = seq  # set before the check below: the worker reads it after
                if self._completed >= seq:  # updating _completed, so one of us sees the other
                    return
                self._done.wait()

    def raise_failures(self, upto: int) -> None:
        """Raise (and forget) the failures of commands numbered <= `upto`."""
        if not self._failures:
            return
        with self._done:
            if not self._failures or self._failures[0].seq > upto:
                return
            covered = [f for f in self._failures if f.seq <= upto]
            self._failures = [f for f in self._failures if f.seq > upto]
        first = covered[0]
        raise DeviceCommandError(self.name, first.seq, first.label, first.exc, len(covered) - 1) from first.exc

    def _work(self) -> None:
        lock = self.card.compute_lock
        while True:
            seq, fn, args, compute, label = self._queue.get()
            if fn is _STOP:
                return
            failure = None
            try:
                if compute:
                    with lock:
                        fn(*args)
                else:
                    fn(*args)
            except BaseException as exc:  # noqa: BLE001 - kept for the host, re-raised there
                failure = _Failure(seq, label, exc)
                self.card.counters.add("failed_commands")
            if failure is not None:
                with self._done:
                    self._failures.append(failure)  # visible before the command counts as done
            self._completed = seq
            if seq >= self._wake_at:
                with self._done:
                    self._wake_at = _NEVER  # woken waiters that still wait set it again
                    self._done.notify_all()


def _check_same(t: DeviceTensor, host: np.ndarray, what: str) -> None:
    if not isinstance(t, DeviceTensor):
        raise DeviceError(f"{what}: expected a DeviceTensor, got {type(t).__name__}")
    if host.size != t.size or np.dtype(host.dtype) != t.dtype:
        raise DeviceError(
            f"{what}: host array {host.shape} {host.dtype} does not match device tensor "
            f"{t.shape} {t.dtype} (need the same dtype and number of elements)"
        )


def _h2d(card: Card, dst: DeviceTensor, src: np.ndarray) -> None:
    dst.numpy().reshape(-1)[:] = src.reshape(-1)
    card.counters.add("h2d_bytes", src.nbytes)


def _d2h(card: Card, dst: np.ndarray, src: DeviceTensor) -> None:
    np.copyto(dst, src.numpy().reshape(dst.shape))
    card.counters.add("d2h_bytes", dst.nbytes)
