"""Run one load point: send prompts at a rate, at most ``concurrency`` in flight.

Bounded in both directions: every prompt is sent at most once, each request
is cut off after ``request_timeout`` seconds, and the whole point after
``max_duration`` seconds (requests still running are cancelled and count as
failed; prompts not yet sent are reported as not sent).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from .arrivals import arrival_gaps
from .client import request_body, send
from .datasets import Prompt
from .stats import RequestResult


@dataclass(slots=True)
class Target:
    base_url: str
    endpoint: str           # "/v1/completions" or "/v1/chat/completions"
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout: float = 300.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class PointResult:
    results: list[RequestResult]
    duration_s: float
    not_sent: int


def new_client(target: Target, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(headers=target.headers(), limits=limits,
                             timeout=httpx.Timeout(target.request_timeout))


async def _one(client, target: Target, p: Prompt, t0: float) -> RequestResult:
    body = request_body(p, target.model, target.chat, target.temperature, target.ignore_eos)
    st = time.perf_counter()
    try:
        return await asyncio.wait_for(
            send(client, target.url, body, target.chat, p.prompt_len, t0, target.request_timeout),
            target.request_timeout)
    except TimeoutError:
        return RequestResult(success=False, start=st - t0,
                             error=f"timed out after {target.request_timeout:g} s")
    except Exception as e:     # an answer the client did not expect fails that request only
        return RequestResult(success=False, start=st - t0, error=f"{type(e).__name__}: {e}")


async def run_point(target: Target, prompts: list[Prompt], concurrency: int,
                    rate: float = float("inf"), burstiness: float = 1.0, seed: int = 0,
                    max_duration: float = 600.0, progress=None) -> PointResult:
    """Send every prompt once; ``progress`` (a tqdm bar or None) ticks per answer."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gaps = arrival_gaps(len(prompts), rate, burstiness, seed)
    sem = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    sent = 0

    async def limited(client, p: Prompt, t0: float) -> None:
        nonlocal sent
        async with sem:
            sent += 1
            r = await _one(client, target, p, t0)
        results.append(r)
        if progress is not None:
            progress.update(1)

    async def dispatch(client, t0: float) -> None:
        for p, gap in zip(prompts, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(client, p, t0)))
        await asyncio.gather(*tasks)

    async with new_client(target, concurrency) as client:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(dispatch(client, t0), max_duration)
        except TimeoutError:
            # wait_for cancelled the dispatcher; cancel the requests it started
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            msg = f"cancelled: --max-duration {max_duration:g} s reached"
            results.extend(RequestResult(success=False, error=msg)
                           for _ in range(sent - len(results)))
        duration = time.perf_counter() - t0
    return PointResult(results=results, duration_s=duration, not_sent=len(prompts) - sent)


async def warm_up(target: Target, prompts: list[Prompt], concurrency: int) -> PointResult:
    """Send ``prompts`` before measuring (at once, ``concurrency`` at a time)."""
    return await run_point(target, prompts, max(1, concurrency),
                           max_duration=max(target.request_timeout, 1.0) * max(1, len(prompts)))
