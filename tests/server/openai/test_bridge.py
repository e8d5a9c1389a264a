"""bridge.py: engine updates from another thread folded into choices; collect and its abort."""

from __future__ import annotations

import asyncio
import threading

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.bridge import Submission, collect
from spyre_serve.server.sched.sequence import TokenLogprob
from tests.server.openai.fakes import RecordingEngine, update


def test_each_prompt_is_one_engine_request_with_every_choices_params():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "cmpl-1", [[1, 2], [3]], ["p0", "p1"])
        return engine, sub

    engine, sub = asyncio.run(main())
    assert list(engine.deliver) == ["cmpl-1-0", "cmpl-1-1"]
    assert [c.prompt_ids for c in sub.choices] == [[1, 2], [1, 2], [3], [3]]


def test_an_update_from_the_engine_thread_lands_in_its_choice():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1], [2]], ["a", "b"])
        lp = TokenLogprob(7, -0.1, [])
        u = SeqUpdate(index=1, text="hi", token_ids=[7, 8], logprobs=[lp, lp])
        thread = threading.Thread(target=engine.deliver["r-1"], args=(u,))
        thread.start()
        idx, got = await sub.next()
        thread.join()
        return sub, idx, got, u

    sub, idx, got, u = asyncio.run(main())
    assert idx == 3 and got is u  # prompt 1, choice 1 of n = 2
    c = sub.choices[3]
    assert (c.text, c.token_ids, len(c.logprobs)) == ("hi", [7, 8], 2)
    assert not sub.done


def test_updates_accumulate_and_the_finish_is_kept():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1]], ["a"])
        engine.deliver["r-0"](update(0, "ab", [1, 2]))
        engine.deliver["r-0"](SeqUpdate(index=0, text="c", token_ids=[3], logprobs=[], finish_reason="stop",
                                        stop_reason="."))
        await sub.next()
        await sub.next()
        return sub

    sub = asyncio.run(main())
    c = sub.choices[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("abc", [1, 2, 3], "stop", ".")
    assert sub.done and sub.error is None


def test_the_first_error_of_any_choice_is_the_submissions():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1]], ["a", "b"])
        engine.deliver["r-0"](update(1, "", [], finish="error", error="device fault"))
        await sub.next()
        return sub

    assert asyncio.run(main()).error == "device fault"


def test_usage_counts_each_prompt_once_and_every_choices_tokens():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1, 2, 3], [4]], ["a", "b"])
        for i, name in enumerate(["r-0", "r-0", "r-1", "r-1"]):
            engine.deliver[name](update(i % 2, "x", [9] * (i + 1), finish="length"))
        for _ in range(4):
            await sub.next()
        return sub

    assert asyncio.run(main()).usage() == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}


def test_abort_aborts_every_engine_request():
    async def main():
        engine = RecordingEngine()
        Submission(engine, "r", [[1], [2]], ["a"]).abort()
        return engine

    assert asyncio.run(main()).aborted == ["r-0", "r-1"]


def test_collect_returns_when_every_choice_is_done_without_aborting():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1]], ["a", "b"])
        engine.deliver["r-0"](update(0, "x", [1], finish="length"))
        engine.deliver["r-0"](update(1, "y", [2], finish="length"))

        async def never() -> bool:
            return False

        await collect(sub, never, poll_seconds=0.01)
        return engine, sub

    engine, sub = asyncio.run(main())
    assert sub.done and engine.aborted == []


def test_collect_aborts_when_the_client_goes_away_first():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1]], ["a"])
        asked = []

        async def gone() -> bool:
            asked.append(True)
            return True

        await collect(sub, gone, poll_seconds=0.01)
        return engine, sub, asked

    engine, sub, asked = asyncio.run(main())
    assert not sub.done and asked == [True] and engine.aborted == ["r-0"]


def test_collect_asks_about_the_client_while_updates_keep_coming():
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1]], ["a"])
        stop = threading.Event()

        def stream_forever():  # an update every millisecond, never a finish
            while not stop.wait(0.001):
                engine.deliver["r-0"](update(0, "x", [1]))

        thread = threading.Thread(target=stream_forever)
        thread.start()

        async def gone() -> bool:
            return True

        try:
            await asyncio.wait_for(collect(sub, gone, poll_seconds=0.02), timeout=5)
        finally:
            stop.set()
            thread.join()
        return engine

    assert asyncio.run(main()).aborted == ["r-0"]
