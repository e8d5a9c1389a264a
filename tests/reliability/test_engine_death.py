"""A dead engine, on a real server in its own process: a fatal fault injected at a step
(SPYRE_TEST_ENGINE_FAULT, server/engine/watchdog.py) while requests are in flight, either raised
(die) or a step that never returns (hang, caught by --step-timeout). Every request in flight
is answered with an error, /health turns 503 meanwhile, and the process exits non-zero within
the watchdog time (so compose or Kubernetes restarts it), rather than living on as a zombie."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.reliability.servers import server_process

STEP_TIMEOUT = 3.0


async def stream(client: httpx.AsyncClient, i: int) -> dict:
    """A long stream: its last event before [DONE] (an error, once the engine dies)."""
    body = {"prompt": f"Stream {i} is about", "max_tokens": 200, "ignore_eos": True, "stream": True}
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, **json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
            elif line == "data: [DONE]":
                return {"done": True, **(last or {})}
    return {"done": False, **(last or {})}


async def post(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": f"Plain {i}", "max_tokens": 200,
                                                      "ignore_eos": True})


@pytest.mark.parametrize("fault", ["die@40", "hang@40"])
def test_a_dead_engine_answers_every_request_in_flight_and_exits_non_zero(fault):
    with server_process("--step-timeout", str(STEP_TIMEOUT),
                        env={"SPYRE_TEST_ENGINE_FAULT": fault}) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                t0 = time.monotonic()
                results = await asyncio.gather(*(stream(client, i) for i in range(8)),
                                               *(post(client, i) for i in range(4)))
                return results, time.monotonic() - t0

        (*streams, p0, p1, p2, p3), answered_in = asyncio.run(main())
        t_answered = time.monotonic()
        code = srv.wait(STEP_TIMEOUT + 30)
        exited_in = time.monotonic() - t_answered
    for s in streams:
        assert s["done"] and "error" in s, s          # an error event, then [DONE]
        assert s["error"]["code"] in (500, 503)
    for r in (p0, p1, p2, p3):
        assert r.status_code in (500, 503) and "error" in r.json(), r.text
    assert code != 0
    # answered once the fault hits (a hang: once the watchdog gives up), then gone promptly
    assert answered_in < 60 and exited_in < STEP_TIMEOUT + 20, (answered_in, exited_in)


def test_a_request_sent_while_the_engine_is_dead_is_refused_at_once():
    with server_process("--step-timeout", str(STEP_TIMEOUT), "--drain-timeout", "5",
                        env={"SPYRE_TEST_ENGINE_FAULT": "hang@20"}) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": "Hang", "max_tokens": 100, "ignore_eos": True})
            assert r.status_code == 500
            late = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:        # until the process is gone
                t0 = time.monotonic()
                try:
                    r = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 4}, timeout=5)
                except httpx.TransportError:
                    break
                late.append((r.status_code, time.monotonic() - t0))
            code = srv.wait(30)
    # on its kept-alive connection, a client is answered 503 at once until the process is gone
    assert late and all(status == 503 and seconds < 2 for status, seconds in late), late
    assert code != 0
