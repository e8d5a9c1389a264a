"""Prefix caching: TTFT of chats sharing a long system prompt, with the cache and without.

Two spyre-serve servers on granite-tiny, one flag apart (``--no-enable-prefix-caching``), run
one after the other (the machine's cores go to the one measured). Each gets the same
--requests streaming /v1/completions at --concurrency, temperature 0, --output-tokens tokens
with ``ignore_eos``; each prompt is token ids: one shared system prompt of --system-tokens
tokens, then a user turn of --user-tokens tokens of its own (both cut from the shipped prose
corpus). A server is warmed up first on another prompt (nothing of the system prompt is
cached before the measurement: its first requests miss). Reports TTFT p50/p99, TPOT p50,
the tokens the server says it found in its prefix cache (``vllm:prefix_cache_hits_total``
over ``vllm:prefix_cache_queries_total``), and the ratio of the TTFT p50s.

Target (issue 12): TTFT p50 with caching <= 1/4 of without, at 1,024 + 64 tokens and c=8.

    python benchmarks/prefix_cache.py                 # 48 requests a server
    python benchmarks/prefix_cache.py --quick         # 16 requests, 16 output tokens

Writes a Markdown table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import free_port, one, stop, wait_ready  # noqa: E402

from spyre_serve.deploy.loadtest.stats import percentile  # noqa: E402

TARGET_RATIO = 0.25


@dataclass(slots=True)
class Run:
    server: str
    requests: int
    failed: int
    duration_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    cache_queries: float
    cache_hits: float


def prompts(n: int, system_tokens: int, user_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The shared system prompt and ``n`` prompts (system + a user turn of their own), as ids."""
    from spyre_serve.models import resolve_model
    from spyre_serve.models.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("granite-tiny"))
    ids = tok.encode((ROOT / "models" / "assets" / "corpus" / "prose.txt").read_text(), add_special_tokens=False)
    need = system_tokens + n * user_tokens + 32
    if len(ids) < need:
        raise SystemExit(f"the corpus has {len(ids)} tokens, {need} needed")
    system = ids[:system_tokens]
    users = [ids[system_tokens + 32 + i * user_tokens : system_tokens + 32 + (i + 1) * user_tokens]
             for i in range(n)]
    return system, [system + u for u in users]


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


async def load(base: str, bodies: list[dict], concurrency: int, timeout: float):
    sem = asyncio.Semaphore(concurrency)
    host, port = base.removeprefix("http://").rsplit(":", 1)

    async def limited(body):
        async with sem:
            return await one(host, int(port), "/v1/completions", body, timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(b) for b in bodies))
    return list(results), time.perf_counter() - t0


def measure(name: str, flags: list[str], batch: list[list[int]], warm: list[int], args) -> Run:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "spyre_serve.server.launch.cli", "serve", "--model", "granite-tiny",
           "--port", str(port), "--max-num-seqs", str(max(8, args.concurrency)), "--log-level", "warning", *flags]
    body = {"model": "granite-tiny", "max_tokens": args.output_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    log_path = Path(args.log_dir) / f"prefix-cache-{name}.log"
    print(f"  starting {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, base + "/health", args.start_timeout)
            asyncio.run(load(base, [{**body, "prompt": warm, "max_tokens": 4}] * 2, 2, args.request_timeout))
            q0, h0 = metric(base, "vllm:prefix_cache_queries_total"), metric(base, "vllm:prefix_cache_hits_total")
            results, duration = asyncio.run(load(base, [{**body, "prompt": p} for p in batch], args.concurrency,
                                                 args.request_timeout))
            q1, h1 = metric(base, "vllm:prefix_cache_queries_total"), metric(base, "vllm:prefix_cache_hits_total")
        finally:
            stop(proc)
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    run = Run(server=name, requests=len(results), failed=len(results) - len(ok), duration_s=round(duration, 2),
              ttft_p50_ms=round(1000 * percentile([r.ttft for r in ok], 50), 1),
              ttft_p99_ms=round(1000 * percentile([r.ttft for r in ok], 99), 1),
              tpot_p50_ms=round(1000 * percentile(tpots, 50), 1),
              cache_queries=q1 - q0, cache_hits=h1 - h0)
    print(f"  {name}: TTFT p50 {run.ttft_p50_ms} ms, p99 {run.ttft_p99_ms} ms, failed {run.failed}",
          file=sys.stderr, flush=True)
    if run.failed:
        print(f"  errors: {sorted({r.error for r in results if not r.ok})[:3]}", file=sys.stderr)
    return run


def report(runs: list[Run], args) -> tuple[str, float | None]:
    lines = [f"Prefix caching, granite-tiny: {args.requests} requests at c={args.concurrency}, a shared "
             f"{args.system_tokens}-token system prompt + {args.user_tokens}-token user turns, "
             f"{args.output_tokens} output tokens", "",
             "| server | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | prefix cache hits / queries (tokens) |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        share = f"{r.cache_hits:.0f} / {r.cache_queries:.0f}" if r.cache_queries == r.cache_queries else "n/a"
        lines.append(f"| {r.server} | {r.requests - r.failed}/{r.requests} | {r.ttft_p50_ms} | {r.ttft_p99_ms} | "
                     f"{r.tpot_p50_ms} | {share} |")
    by = {r.server: r for r in runs}
    ratio = None
    if by["caching"].ttft_p50_ms and by["no-caching"].ttft_p50_ms:
        ratio = by["caching"].ttft_p50_ms / by["no-caching"].ttft_p50_ms
        met = "met" if ratio <= TARGET_RATIO and not any(r.failed for r in runs) else "not met"
        lines += ["", f"TTFT p50 with caching / without: {ratio:.3f} (target <= {TARGET_RATIO}: {met})"]
    return "\n".join(lines), ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="16 requests, 16 output tokens")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens = 16, 16
    system, batch = prompts(args.requests, args.system_tokens, args.user_tokens)
    warm = system[::-1][:64]                      # nothing of the system prompt's first block
    runs = [measure("no-caching", ["--no-enable-prefix-caching"], batch, warm, args),
            measure("caching", [], batch, warm, args)]
    text, ratio = report(runs, args)
    print(text)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": [asdict(r) for r in runs],
                                          "ttft_p50_ratio": ratio}, indent=2) + "\n")
    return 0 if ratio is not None and ratio <= TARGET_RATIO and not any(r.failed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
