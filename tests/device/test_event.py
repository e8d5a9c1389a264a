import threading
import time

import pytest

from spyre_serve.device import DeviceCommandError, DeviceError, Event


def _gate(stream):
    gate = threading.Event()
    stream.enqueue(gate.wait, compute=False)
    return gate


def _boom():
    raise RuntimeError("kernel fault")


def test_unrecorded_event_counts_as_complete():
    ev = Event()
    assert ev.query()
    ev.synchronize()


def test_query_is_false_until_the_stream_reaches_the_record(card):
    s = card.new_stream("s")
    gate = _gate(s)
    ev = s.record_event()
    assert not ev.query()
    gate.set()
    ev.synchronize()
    assert ev.query()


def test_wait_event_orders_work_across_streams(card):
    a, b = card.new_stream("a"), card.new_stream("b")
    order = []
    gate = _gate(a)
    a.enqueue(order.append, "a")
    ev = a.record_event()
    b.wait_event(ev)
    b.enqueue(order.append, "b")
    time.sleep(0.05)
    assert order == []  # b is held by the event, a by the gate
    gate.set()
    b.synchronize()
    assert order == ["a", "b"]


def test_event_wait_method_is_the_same_as_stream_wait_event(card):
    a, b = card.new_stream("a"), card.new_stream("b")
    order = []
    gate = _gate(a)
    a.enqueue(order.append, 1)
    ev = Event().record(a)
    ev.wait(b)
    b.enqueue(order.append, 2)
    gate.set()
    b.synchronize()
    assert order == [1, 2]


def test_synchronize_reraises_a_failure_recorded_before_the_event(card):
    s = card.new_stream("s")
    s.enqueue(_boom)
    ev = s.record_event()
    with pytest.raises(DeviceCommandError, match="kernel fault") as info:
        ev.synchronize()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_synchronize_ignores_failures_after_the_event(card):
    s = card.new_stream("s")
    gate = _gate(s)
    ev = s.record_event()
    s.enqueue(_boom)
    gate.set()
    ev.synchronize()  # covers only the gate
    with pytest.raises(DeviceCommandError):
        s.synchronize()


def test_elapsed_time_is_the_time_between_the_two_records(card):
    s = card.new_stream("s")
    start = s.record_event()
    s.enqueue(time.sleep, 0.05, compute=False)
    end = s.record_event()
    end.synchronize()
    assert start.elapsed_time(end) >= 50.0  # milliseconds; sleep is a lower bound


def test_elapsed_time_needs_both_events_recorded_and_done(card):
    s = card.new_stream("s")
    with pytest.raises(DeviceError, match="never recorded"):
        Event().elapsed_time(s.record_event())
    gate = _gate(s)
    start, end = s.record_event(), s.record_event()
    with pytest.raises(DeviceError, match="not completed"):
        start.elapsed_time(end)
    gate.set()
    end.synchronize()


def test_rerecording_covers_the_new_point(card):
    s = card.new_stream("s")
    ev = s.record_event()
    ev.synchronize()
    gate = _gate(s)
    ev.record(s)
    assert not ev.query()
    gate.set()
    ev.synchronize()
    assert ev.query()
