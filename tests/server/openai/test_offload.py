"""offload.py: blocking work on worker threads, the event loop free meanwhile, a time bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spyre_serve.server.openai.offload import Offload, PoolFull, TimedOut


def spin(seconds: float) -> int:
    """Pure Python work (as a template renders) for ``seconds``."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def forever() -> None:
    while True:
        pass


async def ticks_while(coro) -> tuple[object, float]:
    """``coro``'s outcome and the longest the event loop went without running a 5 ms ticker."""
    gaps, last, stop = [], time.monotonic(), False

    async def ticker():
        nonlocal last
        while not stop:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    try:
        outcome = await coro
    except Exception as exc:  # noqa: BLE001
        outcome = exc
    stop = True
    await task
    return outcome, max(gaps)


def test_the_work_runs_on_another_thread_and_gives_its_result():
    async def main():
        return await Offload(2, 5.0).run(lambda x: (x * 2, threading.current_thread().name), 21)

    value, thread = asyncio.run(main())
    assert value == 42 and thread == "spyre-offload"


def test_the_event_loop_keeps_running_while_the_work_runs():
    n, longest_gap = asyncio.run(ticks_while(Offload(2, 5.0).run(spin, 0.6)))
    assert n > 0 and longest_gap < 0.2


def test_work_over_the_time_bound_is_refused_and_its_thread_interrupted():
    async def main():
        offload = Offload(1, 0.3)
        t0 = time.monotonic()
        with pytest.raises(TimedOut):
            await offload.run(forever)
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        assert await offload.run(lambda: "next") == "next"  # the one slot came back: the thread ended
        return waited, time.monotonic() - t1

    waited, slot_back = asyncio.run(main())
    assert 0.3 <= waited < 1.0 and slot_back < 1.0
    for t in threading.enumerate():
        if t.name == "spyre-offload":
            t.join(1.0)
            assert not t.is_alive()


def test_an_exception_in_the_work_reaches_the_caller():
    async def main():
        await Offload(1, 5.0).run(int, "x")

    with pytest.raises(ValueError, match="invalid literal"):
        asyncio.run(main())


def test_no_more_than_the_workers_run_at_once():
    running, most = 0, 0
    lock = threading.Lock()

    def work():
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    async def main():
        offload = Offload(2, 5.0)
        await asyncio.gather(*(offload.run(work) for _ in range(6)))

    asyncio.run(main())
    assert most == 2


def test_a_request_that_finds_every_worker_busy_waits_its_bound_then_is_refused():
    """Two workers stuck in work longer than the wait: a third call is refused (PoolFull)
    after `wait` seconds without starting; the pool's stats say so; once a worker ends, calls
    run again and no slot was lost to the refusals."""
    release = threading.Event()

    async def main():
        offload = Offload(2, 10.0, wait=0.2)
        stuck = [asyncio.create_task(offload.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert offload.stats() == {"workers": 2, "busy": 2, "waiting": 0, "refused": 0}
        t0 = time.monotonic()
        with pytest.raises(PoolFull, match="all 2 workers busy for 0.2 s"):
            await offload.run(lambda: "never")
        assert 0.15 < time.monotonic() - t0 < 2
        waiter = asyncio.create_task(offload.run(lambda: "late"))
        await asyncio.sleep(0.05)
        assert offload.stats()["waiting"] == 1
        release.set()
        assert await waiter == "late"
        await asyncio.gather(*stuck)
        assert await asyncio.gather(*(offload.run(lambda: 1) for _ in range(4))) == [1] * 4
        assert offload.stats() == {"workers": 2, "busy": 0, "waiting": 0, "refused": 1}

    asyncio.run(main())


def test_a_caller_cancelled_while_waiting_for_a_worker_takes_no_slot():
    release = threading.Event()

    async def main():
        offload = Offload(1, 10.0, wait=5.0)
        first = asyncio.create_task(offload.run(release.wait))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(offload.run(lambda: "x"))
        await asyncio.sleep(0.05)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        release.set()
        await first
        assert await offload.run(lambda: "free") == "free" and offload.stats()["busy"] == 0

    asyncio.run(main())
