import threading
import time
import traceback

import numpy as np
import pytest

from spyre_serve.device import Card, DeviceCommandError, DeviceError


def _gate(stream):
    """Block `stream` until the returned threading.Event is set."""
    gate = threading.Event()
    stream.enqueue(gate.wait, compute=False)
    return gate


def test_commands_run_in_fifo_order(card):
    s = card.new_stream("s")
    seen = []
    for i in range(50):
        s.enqueue(seen.append, i)
    s.synchronize()
    assert seen == list(range(50))


def test_enqueue_returns_before_the_command_runs(card):
    s = card.new_stream("s")
    gate = _gate(s)
    ran = []
    s.enqueue(ran.append, 1)
    assert ran == [] and not s.query()
    gate.set()
    s.synchronize()
    assert ran == [1] and s.query()


def test_full_queue_blocks_enqueue_until_a_command_finishes():
    with Card(memory_bytes=1 << 16, stream_depth=2) as card:
        s = card.default_stream
        started, gate = threading.Event(), threading.Event()
        s.enqueue(lambda: (started.set(), gate.wait()), compute=False)
        assert started.wait(10)  # the worker holds the gate command: the queue is empty
        s.enqueue(int)
        s.enqueue(int)  # queue now full (depth 2)
        returned = threading.Event()
        t = threading.Thread(target=lambda: (s.enqueue(int), returned.set()))
        t.start()
        assert not returned.wait(0.2)  # blocked: backpressure
        gate.set()
        assert returned.wait(10)
        t.join()
        s.synchronize()


def _boom(x):
    raise ValueError(f"bad value {x}")


def test_failure_is_reraised_at_synchronize_chained_to_the_original(card):
    s = card.new_stream("s")
    s.enqueue(_boom, 7)
    with pytest.raises(DeviceCommandError, match="'_boom' on stream 's' failed") as info:
        s.synchronize()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "bad value 7"
    frames = [f.name for f in traceback.extract_tb(cause.__traceback__)]
    assert "_boom" in frames  # the original traceback survives


def test_stream_keeps_running_commands_after_a_failure(card):
    s = card.new_stream("s")
    ran = []
    s.enqueue(_boom, 1)
    s.enqueue(ran.append, "after")
    with pytest.raises(DeviceCommandError):
        s.synchronize()
    assert ran == ["after"]


def test_a_failure_is_reported_once(card):
    s = card.new_stream("s")
    s.enqueue(_boom, 1)
    with pytest.raises(DeviceCommandError):
        s.synchronize()
    s.synchronize()  # nothing new failed


def test_several_failures_raise_the_first_and_count_the_rest(card):
    s = card.new_stream("s")
    for i in range(3):
        s.enqueue(_boom, i)
    with pytest.raises(DeviceCommandError, match="and 2 later failed commands") as info:
        s.synchronize()
    assert str(info.value.__cause__) == "bad value 0"
    assert card.counters.snapshot()["failed_commands"] == 3


def test_card_synchronize_waits_for_every_stream_and_raises_their_failures(card):
    a, b = card.new_stream("a"), card.new_stream("b")
    done = []
    a.enqueue(time.sleep, 0.05)
    a.enqueue(done.append, "a")
    b.enqueue(_boom, 2)
    b.enqueue(done.append, "b")
    with pytest.raises(DeviceCommandError, match="stream 'b'"):
        card.synchronize()
    assert sorted(done) == ["a", "b"]


def test_synchronize_from_inside_the_stream_fails_instead_of_deadlocking(card):
    s = card.new_stream("s")
    s.enqueue(s.synchronize, compute=False)
    with pytest.raises(DeviceCommandError) as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, DeviceError) and "deadlock" in str(info.value.__cause__)


def test_copy_h2d_snapshots_the_host_array_at_enqueue(card):
    s = card.new_stream("s")
    t = card.empty((4,), np.float32)
    gate = _gate(s)
    host = np.array([1, 2, 3, 4], np.float32)
    s.copy_h2d(t, host)
    host[:] = -1  # reused at once by the caller
    gate.set()
    s.synchronize()
    np.testing.assert_array_equal(t.numpy(), [1, 2, 3, 4])


def test_copy_d2h_fills_the_host_array_when_the_stream_reaches_it(card):
    s = card.new_stream("s")
    t = card.empty((2, 3), np.int32)
    t.numpy()[:] = np.arange(6).reshape(2, 3)
    out = np.zeros((2, 3), np.int32)
    gate = _gate(s)
    s.copy_d2h(out, t)
    assert not out.any()
    gate.set()
    s.synchronize()
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))
    snap = card.counters.snapshot()
    assert snap["d2h_bytes"] == 24


def test_copy_with_mismatched_dtype_or_size_is_refused_at_enqueue(card):
    t = card.empty((4,), np.float32)
    with pytest.raises(DeviceError, match=r"host array \(4,\) float64 does not match"):
        card.default_stream.copy_h2d(t, np.zeros(4))
    with pytest.raises(DeviceError, match="does not match"):
        card.default_stream.copy_d2h(np.zeros(5, np.float32), t)


def test_compute_commands_of_two_streams_never_overlap(card):
    a, b = card.new_stream("a"), card.new_stream("b")
    active, overlaps, lock = [0], [0], threading.Lock()

    def work():
        with lock:
            active[0] += 1
            overlaps[0] += active[0] > 1
        time.sleep(0.002)
        with lock:
            active[0] -= 1

    for _ in range(20):
        a.enqueue(work)
        b.enqueue(work)
    card.synchronize()
    assert overlaps[0] == 0


def test_non_compute_commands_of_two_streams_do_run_at_once(card):
    a, b = card.new_stream("a"), card.new_stream("b")
    barrier = threading.Barrier(2, timeout=10)
    a.enqueue(barrier.wait, compute=False)  # passes only if both streams are in a command at once
    b.enqueue(barrier.wait, compute=False)
    card.synchronize()


def test_closed_stream_refuses_commands(card):
    s = card.new_stream("s")
    s.close()
    with pytest.raises(DeviceError, match="closed"):
        s.enqueue(int)


def test_concurrent_waiters_on_one_stream_are_all_woken(card):
    s = card.new_stream("s", depth=4)  # small depth: submitters also wait (backpressure)
    errors = []

    def client():
        try:
            for _ in range(300):
                s.enqueue(int, compute=False)
                s.record_event().synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a waiter was never woken"
    assert errors == []


def test_a_position_is_reached_once_the_commands_before_it_have_run(card):
    s = card.new_stream("s")
    gate = _gate(s)
    at = s.position
    assert at == 1 and not s.reached(at)
    s.enqueue(lambda: None)
    gate.set()
    s.synchronize()
    assert s.reached(at) and s.reached(s.position)
