"""Soak: spyre-serve under steady load for a long time, judged by what must not drift.

Starts its own server (``python -m server.launch.cli serve``, granite-tiny, 127.0.0.1, a free port)
and keeps --concurrency clients busy for --warmup-seconds and then, measured, --minutes (one
load throughout, so the measurement starts in a steady state): mixed prompt and output
lengths, streamed or not, and a --disconnect share of clients that hang up at a random point
(mid-stream, or giving up on a plain request); a few malformed requests go out every minute
(--malformed-per-minute: bad JSON, invalid UTF-8, deep nesting, wrong types, unknown fields,
huge values), each of which must be a 4xx. Reports requests completed, errors by status,
the server's RSS when the measurement starts and when it ends (both under the same load; and
once idle again), and per window of --window-minutes the p99 of TTFT, inter-token latency and
end-to-end latency.

Targets: no response with status >= 500 (nor a broken connection the client did not cause),
RSS growth <= 5%, the ITL and end-to-end p99 flat within 20% across the full windows (largest /
smallest <= 1.2), TTFT p99 without a trend (its windows' least-squares line changes it by at
most 5% over the run: TTFT p99 swings with how many long prompts arrive together, and the
spread measured here had no trend), and the server idle afterwards (nothing running or
waiting, KV cache and runner state empty).

    python benchmarks/soak.py                   # 30 minutes at c=64, windows of 5 minutes
    python benchmarks/soak.py --minutes 2       # a check that it works (windows of 30 s)

Prints the table and the verdict; writes JSON to --out. Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import free_port, stop, text_prompt_maker, wait_ready  # noqa: E402
from spyre_serve.deploy.loadtest.stats import percentile  # noqa: E402  (an empty list gives 0.0)

# Malformed requests: (what, raw body bytes or a JSON-able body, content type). Each must be a 4xx.
MALFORMED = [
    ("not JSON", b"{\"prompt\": \"x\", ", "application/json"),
    ("invalid UTF-8", b"{\"prompt\": \"\xff\xfe\xfa\"}", "application/json"),
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, "application/json"),
    ("a list, not an object", [1, 2, 3], None),
    ("max_tokens a string", {"prompt": "x", "max_tokens": "ten"}, None),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -5}, None),
    ("an unknown model", {"model": "no-such-model", "prompt": "x"}, None),
    ("temperature 1e300", {"prompt": "x", "temperature": 1e300}, None),
    ("stop token id 2^40", {"prompt": "x", "stop_token_ids": [2**40], "min_tokens": 1}, None),
    ("a prompt token outside the vocabulary", {"prompt": [10**9]}, None),
    ("max_tokens past the context", {"prompt": "x", "max_tokens": 10**9}, None),
]
TARGET_RSS_GROWTH = 0.05
TARGET_P99_SPREAD = 1.2
TARGET_TTFT_TREND = 0.05


@dataclass(slots=True)
class Record:
    start: float                  # s since the measured load began
    kind: str                     # "stream" | "plain" | "malformed"
    outcome: str                  # the status ("200", "400", ...), "left" (the client hung up) or "transport"
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


def rss_bytes(pid: int) -> int:
    """The server's resident bytes: its process and its children (the engine's process, and
    multiprocessing's resource tracker), as ``ps`` reports them."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid), "--ppid", str(pid)], capture_output=True, text=True)
    if not out.stdout.split():
        raise RuntimeError(f"no RSS for pid {pid}")
    return sum(int(v) for v in out.stdout.split()) << 10


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


IDLE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "spyre_runner_held_sequences")


def wait_idle(url: str, seconds: float) -> dict[str, float]:
    """The IDLE samples once they are all 0, or as they are after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        values = {n: metric(text, n) for n in IDLE}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


class Load:
    """The clients: each loops, one request at a time, until the deadline. Records start at
    ``t0`` (the measurement): requests sent before it are the warm-up's."""

    def __init__(self, url: str, args, prompts: list[str], t0: float, pid: int) -> None:
        self.url, self.args, self.prompts, self.t0, self.pid = url, args, prompts, t0, pid
        self.records: list[Record] = []
        self.rss: list[tuple[float, int]] = []   # (s since t0, bytes), every 10 s and at both ends

    async def run(self, seed: int) -> None:
        limits = httpx.Limits(max_connections=self.args.concurrency + 8,
                              max_keepalive_connections=self.args.concurrency + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as client:
            deadline = self.t0 + 60 * self.args.minutes
            tasks = [self.client(client, random.Random(seed * 1000 + i), deadline)
                     for i in range(self.args.concurrency)]
            tasks.append(self.malformed(client, random.Random(seed), deadline))
            tasks.append(self.sample_rss(deadline))
            await asyncio.gather(*tasks)
        self.records = [r for r in self.records if r.start >= 0]

    async def sample_rss(self, deadline: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 - time.monotonic()))
        while True:
            self.rss.append((time.monotonic() - self.t0, rss_bytes(self.pid)))
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(10.0, left))

    async def client(self, client: httpx.AsyncClient, rng: random.Random, deadline: float) -> None:
        lo, hi = self.args.output_tokens
        while time.monotonic() < deadline:
            body = {"prompt": rng.choice(self.prompts), "max_tokens": rng.randint(lo, hi),
                    "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": True}
            leave = rng.random() < self.args.disconnect
            if rng.random() < 0.7:
                await self.stream(client, body, rng.randint(1, 16) if leave else None)
            else:
                await self.plain(client, body, rng.uniform(0.05, 2.0) if leave else None)

    async def stream(self, client: httpx.AsyncClient, body: dict, leave_after: int | None) -> None:
        rec = Record(time.monotonic() - self.t0, "stream", "transport")
        sent = time.perf_counter()
        last = None
        try:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                rec.outcome = str(r.status_code)
                if r.status_code != 200:
                    await r.aread()
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.outcome = str(chunk["error"].get("code", 500))
                        return
                    now = time.perf_counter()
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        rec.tokens += 1
                        if last is None:
                            rec.ttft = now - sent
                        else:
                            rec.itl.append(now - last)
                        last = now
                        if leave_after is not None and rec.tokens >= leave_after:
                            rec.outcome = "left"
                            return           # leaving the block closes the connection
            rec.e2e = time.perf_counter() - sent
        except httpx.HTTPError:
            rec.outcome = "transport"
        finally:
            self.records.append(rec)

    async def plain(self, client: httpx.AsyncClient, body: dict, give_up_after: float | None) -> None:
        rec = Record(time.monotonic() - self.t0, "plain", "transport")
        sent = time.perf_counter()
        try:
            timeout = httpx.Timeout(600, read=give_up_after) if give_up_after else httpx.Timeout(600)
            r = await client.post("/v1/completions", json=body, timeout=timeout)
            rec.outcome = str(r.status_code)
            rec.e2e = time.perf_counter() - sent
            if r.status_code == 200:
                rec.tokens = r.json()["usage"]["completion_tokens"]
        except httpx.ReadTimeout:
            rec.outcome = "left" if give_up_after else "transport"
        except httpx.HTTPError:
            rec.outcome = "transport"
        finally:
            self.records.append(rec)

    async def malformed(self, client: httpx.AsyncClient, rng: random.Random, deadline: float) -> None:
        gap = 60.0 / max(self.args.malformed_per_minute, 1e-9)
        while True:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * gap)
            if time.monotonic() >= deadline:
                return
            what, body, ctype = rng.choice(MALFORMED)
            rec = Record(time.monotonic() - self.t0, "malformed", "transport")
            try:
                if isinstance(body, bytes):
                    r = await client.post("/v1/completions", content=body, headers={"Content-Type": ctype})
                else:
                    r = await client.post("/v1/completions", json=body)
                rec.outcome = str(r.status_code)
                if r.status_code < 400 or r.status_code >= 500:
                    print(f"  malformed request ({what}) answered {r.status_code}: {r.text[:200]}",
                          flush=True)
            except httpx.HTTPError as exc:
                print(f"  malformed request ({what}): {type(exc).__name__}: {exc}", flush=True)
            self.records.append(rec)


def windows(records: list[Record], seconds: float, width: float) -> list[dict]:
    """Per window of ``width`` seconds (by request start): counts and p99s."""
    out = []
    n = max(1, round(seconds / width))
    for w in range(n):
        rs = [r for r in records if w * width <= r.start < (w + 1) * width]
        ok = [r for r in rs if r.outcome == "200" and r.kind != "malformed"]
        streams = [r for r in ok if r.kind == "stream" and r.tokens]
        out.append({
            "window": w, "from_s": w * width, "to_s": (w + 1) * width, "requests": len(rs),
            "completed": len(ok), "left": sum(r.outcome == "left" for r in rs),
            "statuses": dict(Counter(r.outcome for r in rs)),
            "ttft_p99_ms": 1000 * percentile([r.ttft for r in streams], 99),
            "itl_p99_ms": 1000 * percentile([x for r in streams for x in r.itl], 99),
            "e2e_p99_ms": 1000 * percentile([r.e2e for r in ok], 99),
        })
    return out


def trend(values: list[float]) -> float:
    """How much the least-squares line through ``values`` (one per window) changes over them,
    relative to their mean: slope x (windows - 1) / mean; 0 for fewer than two."""
    if len(values) < 2 or not any(values):
        return 0.0
    n = len(values)
    mx, my = (n - 1) / 2, sum(values) / n
    slope = sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))
    return slope * (n - 1) / my


def spread(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return max(values) / min(values) if values else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="measured load (default 30)")
    ap.add_argument("--window-minutes", type=float, default=None,
                    help="p99 window (default 5, or a quarter of --minutes when that is under 20)")
    ap.add_argument("--warmup-seconds", type=float, default=60.0, help="load before measuring")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.10, help="share of requests whose client hangs up")
    ap.add_argument("--malformed-per-minute", type=float, default=4.0)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 384), metavar=("MIN", "MAX"))
    ap.add_argument("--output-tokens", type=int, nargs=2, default=(8, 192), metavar=("MIN", "MAX"))
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for spyre-serve serve")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    ap.add_argument("--log", default="/tmp/spyre-serve-soak.log", help="the server's log")
    args = ap.parse_args(argv)
    width = 60 * (args.window_minutes or (5.0 if args.minutes >= 20 else args.minutes / 4))
    seconds = 60 * args.minutes

    rng = random.Random(0)
    lo, hi = args.prompt_tokens
    prompts = [p for n in (rng.randint(lo, hi) for _ in range(8)) for p in text_prompt_maker(8, n)(8)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "spyre_serve.server.launch.cli", "serve", "--model", "granite-tiny",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.server_arg]
    print(f"starting {' '.join(cmd[1:])} (log: {args.log})", flush=True)
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url + "/health", args.start_timeout)
        print(f"{args.warmup_seconds:.0f} s of warm-up, then {args.minutes:g} min measured, at "
              f"c={args.concurrency}, {args.disconnect:.0%} hanging up, {args.malformed_per_minute:g} "
              f"malformed/min", flush=True)
        load = Load(url, args, prompts, time.monotonic() + args.warmup_seconds, proc.pid)
        asyncio.run(load.run(seed=2))
        wall = time.monotonic() - load.t0
        idle = wait_idle(url, 120)
        rss_idle = rss_bytes(proc.pid)
        alive = proc.poll() is None
    finally:
        stop(proc)

    recs = load.records
    statuses = Counter(r.outcome for r in recs)
    errors = {k: v for k, v in statuses.items() if k == "transport" or (k.isdigit() and int(k) >= 500)}
    malformed = Counter(r.outcome for r in recs if r.kind == "malformed")
    wins = windows(recs, seconds, width)
    full = [w for w in wins if w["to_s"] <= seconds + 1e-6 and w["requests"]]
    rss_start, rss_end = load.rss[0][1], load.rss[-1][1]
    growth = rss_end / rss_start - 1
    spreads = {k: spread([w[k] for w in full]) for k in ("ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms")}
    ttft_trend = trend([w["ttft_p99_ms"] for w in full])
    verdict = {
        "no 5xx or broken connection": not errors,
        "malformed requests all 4xx": all(k.isdigit() and 400 <= int(k) < 500 for k in malformed),
        f"RSS growth <= {TARGET_RSS_GROWTH:.0%}": growth <= TARGET_RSS_GROWTH,
        f"ITL and E2E p99 flat within {TARGET_P99_SPREAD - 1:.0%}": all(
            spreads[k] <= TARGET_P99_SPREAD for k in ("itl_p99_ms", "e2e_p99_ms")),
        f"TTFT p99 trend within +-{TARGET_TTFT_TREND:.0%}": abs(ttft_trend) <= TARGET_TTFT_TREND,
        "idle afterwards": not any(idle.values()),
        "server alive": alive,
    }

    print(f"\n{len(recs)} requests in {wall:.0f} s: {sum(r.outcome == '200' and r.kind != 'malformed' for r in recs)} "
          f"completed, {statuses.get('left', 0)} hung up by their client, {sum(malformed.values())} malformed "
          f"({dict(malformed)}); statuses {dict(statuses)}")
    print(f"errors (>= 500 or broken): {errors or 'none'}")
    print(f"RSS: {rss_start / 2**20:.1f} MiB when measuring began, {rss_end / 2**20:.1f} MiB when it ended "
          f"({growth:+.2%}), {rss_idle / 2**20:.1f} MiB idle afterwards")
    print(f"idle afterwards: {idle}\n")
    print("| window | requests | completed | hung up | TTFT p99 ms | ITL p99 ms | E2E p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for w in wins:
        print(f"| {w['from_s'] / 60:.1f}-{w['to_s'] / 60:.1f} min | {w['requests']} | {w['completed']} | "
              f"{w['left']} | {w['ttft_p99_ms']:.0f} | {w['itl_p99_ms']:.1f} | {w['e2e_p99_ms']:.0f} |")
    print("\np99 spread (largest / smallest window): " +
          ", ".join(f"{k.removesuffix('_p99_ms')} {v:.2f}" for k, v in spreads.items()))
    print(f"TTFT p99 trend over the run: {ttft_trend:+.1%}")
    for what, ok in verdict.items():
        print(f"  {'met' if ok else 'NOT MET'}: {what}")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "wall_seconds": wall, "requests": len(recs), "statuses": dict(statuses),
        "errors": errors, "malformed": dict(malformed), "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
        "rss_growth": growth, "rss_idle_bytes": rss_idle, "rss_samples": load.rss, "idle_after": idle, "windows": wins,
        "p99_spread": spreads, "ttft_p99_trend": ttft_trend, "verdict": verdict,
    }, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    print(f"\nwritten {args.out}")
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
