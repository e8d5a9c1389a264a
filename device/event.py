"""Event: a marker at a point of a stream, with the time the stream reached it.

`record(stream)` enqueues a command that stamps the time; the event is
complete once the stream has run past that command. `synchronize()` blocks
the host until then and re-raises any failure of the commands before it on
that stream; `stream.wait_event(ev)` makes another stream wait for it
(cross-stream order). An event never recorded counts as complete, as in CUDA.
Re-recording moves the marker; waits already enqueued keep the old one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from spyre_serve.device.memory import DeviceError

if TYPE_CHECKING:
    from spyre_serve.device.stream import Stream


class Event:
    __slots__ = ("_stream", "_seq", "_time_ns")

    def __init__(self):
        self._stream: Stream | None = None  # where the latest record() put the marker
        self._seq = 0  # the record command's number on that stream
        self._time_ns: int | None = None  # when the stream reached it

    def __repr__(self) -> str:
        where = f"{self._stream.name}#{self._seq}" if self._stream else "unrecorded"
        return f"Event({where}, {'done' if self.query() else 'pending'})"

    def record(self, stream: Stream) -> Event:
        """Mark the point in `stream` after everything enqueued so far."""
        self._time_ns = None
        return self.mark(stream, stream.enqueue(_stamp, self, compute=False, label="record_event"))

    def mark(self, stream: Stream, position: int) -> Event:
        """Mark command `position` of `stream`, which stamps this event when it runs (`stamp`):
        a program's launch is its own record."""
        self._stream, self._seq = stream, position
        return self

    def stamp(self) -> None:
        """Take the time the stream reached the marker (run by the marked command)."""
        self._time_ns = time.perf_counter_ns()

    @property
    def stream(self) -> Stream | None:
        """The stream of the latest record, None before any."""
        return self._stream

    @property
    def position(self) -> int:
        """The number of the marked command on that stream."""
        return self._seq

    def wait(self, stream: Stream) -> None:
        """Make `stream` wait for this event (device side; the host does not block)."""
        stream.wait_event(self)

    def query(self) -> bool:
        """True when the stream has passed the latest record (or it was never recorded)."""
        s = self._stream
        return s is None or s.reached(self._seq)

    def synchronize(self) -> None:
        """Block the host until the event completes; re-raise failures of the commands it covers."""
        stream, seq = self._stream, self._seq
        if stream is None:
            return
        if stream.on_worker():
            raise DeviceError(f"event synchronize from inside stream '{stream.name}' (deadlock)")
        stream.wait_until(seq)
        stream.raise_failures(seq)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to `end`; both must have completed."""
        for name, ev in (("start", self), ("end", end)):
            if ev._stream is None:
                raise DeviceError(f"elapsed_time: {name} event was never recorded")
            if not ev.query() or ev._time_ns is None:
                raise DeviceError(f"elapsed_time: {name} event has not completed yet (synchronize it first)")
        return (end._time_ns - self._time_ns) / 1e6


def _stamp(event: Event) -> None:
    event.stamp()
