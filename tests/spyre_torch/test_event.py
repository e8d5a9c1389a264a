"""torch.spyre.Event: markers on the card's streams that time work and order streams."""

from __future__ import annotations

import time

import pytest
import torch

from tests.spyre_torch.processes import gate


def test_events_time_work_on_a_stream():
    a = torch.randn(384, 384).to("spyre")
    (a @ a).cpu()  # the GEMM compiled and warm
    start, end = torch.spyre.Event(enable_timing=True), torch.spyre.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(20):
        b = a @ a
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) * 1000
    ms = start.elapsed_time(end)
    assert 0 < ms <= wall
    assert b.shape == (384, 384)


def test_elapsed_time_needs_events_made_for_timing():
    start, end = torch.spyre.Event(), torch.spyre.Event()
    start.record()
    end.record()
    end.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        start.elapsed_time(end)


def test_query_is_false_until_the_stream_reaches_the_event():
    s = torch.spyre.Stream()
    opened = gate(s)
    ev = s.record_event(torch.spyre.Event())
    assert not ev.query()
    opened.set()
    ev.synchronize()
    assert ev.query()


def test_an_event_never_recorded_counts_as_complete():
    assert torch.spyre.Event().query()


def test_event_wait_makes_another_stream_wait():
    s1, s2 = torch.spyre.Stream(), torch.spyre.Stream()
    x = torch.zeros(4, device="spyre")
    torch.spyre.synchronize()
    opened = gate(s1)
    with torch.spyre.stream(s1):
        x.add_(1)
        ev = torch.spyre.Event()
        ev.record()
    ev.wait(s2)
    with torch.spyre.stream(s2):
        y = x * 10
    assert not s2.query()
    opened.set()
    s2.synchronize()
    assert y.cpu().tolist() == [10.0] * 4


def test_elapsed_time_before_the_end_is_reached_is_refused():
    s = torch.spyre.Stream()
    start, end = torch.spyre.Event(enable_timing=True), torch.spyre.Event(enable_timing=True)
    start.record(s)
    opened = gate(s)
    end.record(s)
    with pytest.raises(RuntimeError, match="not completed"):
        start.elapsed_time(end)
    opened.set()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
