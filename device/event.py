"""Event: a marker recorded on a stream; a flag, a condition and a timestamp.

`record(stream)` enqueues a command that stamps the time and sets the flag
when the stream reaches it. `synchronize()` blocks the host until then and
re-raises any failure of the commands before it on that stream;
`stream.wait_event(ev)` makes another stream wait for it (cross-stream order).
An event never recorded counts as complete, as in CUDA.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from device.memory import DeviceError

if TYPE_CHECKING:
    from device.stream import Stream


class Event:
    def __init__(self):
        self._cond = threading.Condition()
        self._next = 0  # generations handed out by record()
        self._recorded = 0  # generation of the latest record()
        self._fired = 0  # latest generation the stream reached
        self._stream: Stream | None = None
        self._seq = 0  # the record command's number on its stream
        self._time_ns: int | None = None

    def __repr__(self) -> str:
        return f"Event(recorded={self._recorded}, fired={self._fired})"

    def record(self, stream: Stream) -> Event:
        """Mark the point in `stream` after everything enqueued so far."""
        with self._cond:
            self._next += 1
            gen = self._next
        seq = stream._submit(self._fire, (gen,), False, "record_event")
        self._set_recorded(stream, seq, gen)
        return self

    def wait(self, stream: Stream) -> None:
        """Make `stream` wait for this event (device side; the host does not block)."""
        stream.wait_event(self)

    def query(self) -> bool:
        """True when the stream has reached the latest record (or it was never recorded)."""
        with self._cond:
            return self._fired >= self._recorded

    def synchronize(self) -> None:
        """Block the host until the event fires; re-raise failures of the commands it covers."""
        with self._cond:
            gen, stream, seq = self._recorded, self._stream, self._seq
        if stream is None:
            return
        if threading.current_thread() is stream._thread:
            raise DeviceError(f"event synchronize from inside stream '{stream.name}' (deadlock)")
        self._block_until(gen)
        stream._raise_failures(seq)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to `end`; both must have fired."""
        for name, ev in (("start", self), ("end", end)):
            with ev._cond:
                if ev._recorded == 0:
                    raise DeviceError(f"elapsed_time: {name} event was never recorded")
                if ev._fired < ev._recorded:
                    raise DeviceError(f"elapsed_time: {name} event has not completed yet (synchronize it first)")
        return (end._time_ns - self._time_ns) / 1e6

    # used by streams and launches -------------------------------------------
    def _generation(self) -> int:
        with self._cond:
            return self._recorded

    def _reserve(self) -> int:
        with self._cond:
            self._next += 1
            return self._next

    def _set_recorded(self, stream: Stream, seq: int, gen: int) -> None:
        with self._cond:
            if gen > self._recorded:
                self._recorded, self._stream, self._seq = gen, stream, seq

    def _fire(self, gen: int) -> None:
        stamp = time.perf_counter_ns()
        with self._cond:
            if gen > self._fired:
                self._fired = gen
                self._time_ns = stamp
            self._cond.notify_all()

    def _block_until(self, gen: int) -> None:
        with self._cond:
            while self._fired < gen:
                self._cond.wait()
