"""Shared fixtures of the reliability suite: a real server, and a normal request to send
beside a bad one.

``running_server(**settings)`` is the real stack (granite-tiny, ModelRunner, Engine, FastAPI
behind uvicorn on 127.0.0.1) with a short context, so that generations stay short; the
``server`` fixture is one of them per module. ``beside(server, bad)`` runs ``bad`` while a
normal greedy stream is running in the engine and returns what the stream said, for the isolation
checks: a normal request must give the text it gives alone, whatever its neighbours send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager

import httpx
import pytest

from tests.server.conftest import PROMPT, ServerThread, real_settings
from tests.server.test_e2e_concurrency import stream_text

# granite-tiny with a short context (and a KV cache to match): a runaway generation stops soon
SHORT = dict(max_model_len=256, num_kv_blocks=64)
NORMAL = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@contextmanager
def running_server(**settings):
    """A real server with ``SHORT`` and ``settings`` over tests/server's ``real_settings``."""
    from server.cli import build

    built = build(real_settings(**{**SHORT, **settings}), progress=False)
    try:
        with ServerThread(built.app) as server:
            server.built = built
            yield server
    finally:
        built.engine.shutdown()


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def solo(http) -> str:
    """NORMAL's greedy text when it runs alone."""
    r = http.post("/v1/completions", json=NORMAL)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def beside(server, bad: Callable[[httpx.AsyncClient], Awaitable]) -> tuple[str, object]:
    """NORMAL streamed; once the engine runs it, ``bad(client)`` is awaited. Returns the
    stream's whole text and what ``bad`` returned."""
    engine = server.built.engine

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            normal = asyncio.create_task(stream_text(client, NORMAL["prompt"], NORMAL["max_tokens"]))
            deadline = time.monotonic() + 300  # the first request may compile its step programs
            while not engine.num_running_requests and not normal.done():
                assert time.monotonic() < deadline, "the normal request never ran"
                await asyncio.sleep(0.005)
            outcome = await bad(client)
            text, _ = await normal
            return text, outcome

    return asyncio.run(main())


def metric(http: httpx.Client, name: str) -> float:
    """The value of one Prometheus sample (its name with labels, as /metrics writes it, or the
    first sample of a metric named ``name``)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} is not in /metrics")
