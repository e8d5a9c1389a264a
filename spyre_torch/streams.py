"""torch.spyre.Stream and torch.spyre.Event on the cards' FIFO streams and events.

    s = torch.spyre.Stream()            # a stream of the current card's pool (device.Stream)
    s1 = torch.spyre.Stream(device=1)   # one of card 1's
    with torch.spyre.stream(s):         # ops on this host thread go to s
        y = x @ w
    torch.spyre.current_stream().wait_stream(s)
    start, end = torch.spyre.Event(enable_timing=True), torch.spyre.Event(enable_timing=True)
    start.record(); ...; end.record(); end.synchronize(); start.elapsed_time(end)   # ms

As with CUDA, ops are enqueued and return at once; a copy to the host waits for its stream.
Each card has its own default stream and pool; `stream(s)` makes s's card the current card too,
and an Event records on (and waits on) a stream of any card.
"""

from __future__ import annotations

import torch

from spyre_torch.runtime import index_of, made, runtime, swap_index

_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)


class Stream(torch.Stream):
    """A FIFO queue of the card. `Stream()` takes the next stream of the runtime's pool.

    A torch.Stream (stream id: 0 the card's default stream, 1.. the pool's), so that
    `tensor.record_stream(s)` reaches the card: the tensor's block then waits for `s` too
    before it is handed out again."""

    def __new__(cls, device=None, priority: int = 0, *, _stream=None, _index=None):
        rt = runtime(index_of(device) if _index is None else _index)
        stream = _stream if _stream is not None else rt.side_stream()
        obj = super().__new__(cls, stream_id=rt.stream_id(stream), device_index=rt.index,
                              device_type=_PRIVATEUSE1)
        obj._stream = stream
        return obj

    def __init__(self, device=None, priority: int = 0, *, _stream=None, _index=None):
        pass

    device = property(lambda self: torch.device("spyre", self.device_index))

    def query(self) -> bool:
        """True when everything enqueued on this stream has run."""
        return self._stream.query()

    def synchronize(self) -> None:
        """Wait for everything enqueued so far; re-raises a failed command's error."""
        self._stream.synchronize()

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for `event` (the host does not block)."""
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        """Later work on this stream waits for everything enqueued on `stream` so far."""
        self.wait_event(stream.record_event())

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other._stream is self._stream

    def __hash__(self) -> int:
        return hash(self._stream)

    def __repr__(self) -> str:
        return f"<torch.spyre.Stream {self._stream.name!r} device=spyre:{self.device_index}>"


class Event:
    """A marker in a stream; `elapsed_time` needs both events made with `enable_timing=True`."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        from spyre_serve.device import Event as DeviceEvent

        runtime()
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._event = DeviceEvent()

    def record(self, stream: Stream | None = None) -> None:
        """Mark the point after everything enqueued on `stream` (default: the current one)."""
        self._event.record((stream or current_stream())._stream)

    def wait(self, stream: Stream | None = None) -> None:
        """Later work on `stream` (default: the current one) waits for this event."""
        (stream or current_stream())._stream.wait_event(self._event)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to `end` (both recorded and completed)."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("spyre: both events must be created with enable_timing=True "
                               "to measure the time between them")
        return self._event.elapsed_time(end._event)

    def __repr__(self) -> str:
        return f"<torch.spyre.Event {self._event!r}>"


def current_stream(device=None) -> Stream:
    """The card's current stream on this host thread (the current card's by default)."""
    index = index_of(device)
    return Stream(_stream=runtime(index).current_stream(), _index=index)


def default_stream(device=None) -> Stream:
    index = index_of(device)
    return Stream(_stream=runtime(index).default_stream, _index=index)


def set_stream(stream: Stream) -> None:
    """Make `stream` the current stream of its card on this host thread, and its card the
    current card (as torch.cuda.set_stream)."""
    runtime(stream.device_index).set_current_stream(stream._stream)
    swap_index(stream.device_index)


class StreamContext:
    """`with torch.spyre.stream(s):` ops of this host thread go to `s` (its card the current
    card), then back."""

    def __init__(self, stream: Stream | None):
        self.stream = stream
        self._prev = None
        self._prev_index = None

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            rt = runtime(self.stream.device_index)
            self._prev = rt.current_stream()
            rt.set_current_stream(self.stream._stream)
            self._prev_index = swap_index(rt.index)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            runtime(self.stream.device_index).set_current_stream(self._prev)
            swap_index(self._prev_index)


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


def synchronize(device=None) -> None:
    """Wait for every stream of the card (the current one by default; re-raises a failed
    command's error). A card not made yet has nothing to wait for."""
    index = index_of(device)
    for rt in made():
        if rt.index == index:
            rt.synchronize()
