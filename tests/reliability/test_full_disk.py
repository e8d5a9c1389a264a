"""A full disk under the log (stdout and stderr on /dev/full: every write refused with ENOSPC),
on a real server in its own process with its engine process, logging at info (a line a request,
a warning for each ignored field): it starts, answers streams and plain requests beside a bad
one as it would with a log, says /health 200, and stops cleanly on SIGTERM. Before
server/launch/streams.py the engine process died at start, on its progress bar's write."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx

from tests.reliability.servers import server_process


async def stream(client: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
    body = {"prompt": f"Stream {i} is about", "max_tokens": 16, "ignore_eos": True, "stream": True,
            "an_unknown_field": i}                            # a warning line, refused by the disk
    async with client.stream("POST", "/v1/completions", json=body) as r:
        return r.status_code, [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]


async def post(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": f"Plain {i}", "max_tokens": 16, "ignore_eos": True})


def test_a_server_whose_log_is_on_a_full_disk_serves_and_stops_cleanly():
    with server_process("--log-level", "info", output="/dev/full") as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
                return await asyncio.gather(*(stream(client, i) for i in range(4)),
                                            *(post(client, i) for i in range(4)), bad,
                                            client.get("/health"))

        *streams, p0, p1, p2, p3, bad, health = asyncio.run(main())
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.wait(60)
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for r in (p0, p1, p2, p3):
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert health.status_code == 200
    assert code == 0
