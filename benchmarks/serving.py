"""Serving benchmark: spyre-serve against its peers, side by side in one run.

Two models:

- ``--model granite-tiny`` (default): spyre-serve against `transformers serve
  --continuous-batching` on the embedded checkpoint, text prompts (below).
- ``--model smollm2``: SmolLM2-135M-Instruct, a real trained model, on the same weights
  everywhere (benchmarks/peers/ sets the peers up in a cache directory): spyre-serve with fp32
  weights, bf16 weights and bf16 compute; both on the Q8_0 GGUF, the shipped Q4_1 GGUF and a
  Q4_K_M GGUF made by llama-quantize; llama.cpp's llama-server on the F32 GGUF and the same
  three; vLLM's CPU server in float32 and bfloat16. The same prompts are sent to
  every server as token ids, with ``ignore_eos``, and output tokens are counted from
  ``usage``. The machine's read bandwidth is measured in the run, for the batch-1 floor
  (weight bytes / bandwidth), and the report ends with the issue's ratios.

One run, same machine, same checkpoint (the embedded granite-tiny, written to
disk in Hugging Face format), same text prompts of about --prompt-tokens
tokens, streaming /v1/completions at temperature 0 with --output-tokens
max_tokens. transformers' server has no ``ignore_eos``, so both get the same
prompts and output length and tokens are counted as they arrive; the random
granite-tiny rarely emits its EOS. For each concurrency level the script
reports output tokens/s, TTFT and TPOT (p50, p99), and for spyre-serve the
device busy fraction over the level (card compute seconds / wall seconds,
from /metrics). Both servers run at once (an idle one waits on its socket); each
level is measured on one, then the other, for --rounds rounds, and each keeps
its best round, so load from elsewhere on a shared machine falls on both alike.

    python benchmarks/serving.py --rounds 2          # 1, 8, 32, 128 concurrent
    python benchmarks/serving.py --model smollm2 --concurrency 1 8 32 --rounds 2
    python benchmarks/serving.py --model smollm2 --servers spyre-fp32 llamacpp-f32
    python benchmarks/serving.py --concurrency 1 8 --output-tokens 32 --skip-transformers

Writes a Markdown table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spyre_serve.deploy.loadtest.stats import percentile  # noqa: E402  (an empty list gives 0.0)


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""
    gaps: list = field(default_factory=list)     # seconds between chunks with text (ITL)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(slots=True)
class Level:
    server: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    device_busy: float | None = None
    errors: list = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_prompt_maker(total: int, tokens: int):
    """make(n) -> n text prompts of about ``tokens`` tokens, each cut at its own offset of the
    shipped prose corpus (``total`` of them at most, spread over it), none given twice."""
    from spyre_serve.models import resolve_model
    from spyre_serve.models.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("granite-tiny"))
    text = (ROOT / "models" / "assets" / "corpus" / "prose.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    step = max(1, (len(ids) - tokens) // max(1, total))
    given = iter(range(total))

    def make(n: int) -> list[str]:
        return [tok.decode(ids[i * step: i * step + tokens]) for i in (next(given) for _ in range(n))]
    return make


def id_prompt_maker(vocab: int, tokens: int, seed: int = 0):
    """make(n) -> n prompts of ``tokens`` random token ids (below the special tokens' range of a
    BPE vocabulary: ids 1000 .. vocab - 1000), none given twice (distinct from the first id on,
    so no two share a cached prefix block)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    firsts: set[int] = set()

    def make(n: int) -> list[list[int]]:
        out = []
        while len(out) < n:
            p = rng.integers(1000, vocab - 1000, tokens).tolist()
            if p[0] not in firsts:
                firsts.add(p[0])
                out.append(p)
        return out
    return make


def prompts_needed(args) -> int:
    return 2 + sum(max(c, args.min_requests) for c in args.concurrency) * args.rounds


async def sse_events(reader: asyncio.StreamReader, chunked: bool):
    """The `data: ...` payloads of a text/event-stream body, as bytes."""
    buf = b""
    while True:
        if chunked:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                yield event[6:]


async def one(host: str, port: int, path: str, body: dict, timeout: float) -> Result:
    """One streaming request over a plain asyncio connection. The load generator shares the
    2 cores with the server under test, so it is kept light: httpx spent ~3 s of CPU per
    32 x 128-token level, this ~0.15 s, and both servers are measured through it."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    usage_tokens = None
    last = None
    gaps = []
    payload = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return Result(False, error=f"HTTP {status}: {(await reader.read(200))!r}")
        async for data in sse_events(reader, b"transfer-encoding: chunked" in head.lower()):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                return Result(False, error=str(chunk["error"])[:200])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    tokens += 1
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()
    if ttft is None:
        return Result(False, error="no tokens")
    return Result(True, ttft=ttft, e2e=time.perf_counter() - t0,
                  tokens=tokens if usage_tokens is None else usage_tokens, gaps=gaps)


async def run_level(base: str, model: str, prompts: list, concurrency: int, output_tokens: int,
                    extra: dict, timeout: float) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    host, port = base.removeprefix("http://").rsplit(":", 1)

    async def limited(p) -> Result:
        async with sem:
            body = {"model": model, "prompt": p, "max_tokens": output_tokens, "temperature": 0.0,
                    "stream": True, **extra}
            return await one(host, int(port), "/v1/completions", body, timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*[limited(p) for p in prompts])
    return list(results), time.perf_counter() - t0


def summarize(server: str, concurrency: int, results: list[Result], duration: float,
              busy: float | None) -> Level:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.gaps]
    return Level(
        server=server, concurrency=concurrency, requests=len(results), failed=len(results) - len(ok),
        duration_s=round(duration, 2), output_tokens=tokens, output_tok_s=round(tokens / duration, 2),
        ttft_p50_ms=round(1000 * percentile([r.ttft for r in ok], 50), 1),
        ttft_p99_ms=round(1000 * percentile([r.ttft for r in ok], 99), 1),
        tpot_p50_ms=round(1000 * percentile(tpots, 50), 1), tpot_p99_ms=round(1000 * percentile(tpots, 99), 1),
        itl_p50_ms=round(1000 * percentile(gaps, 50), 1), itl_p99_ms=round(1000 * percentile(gaps, 99), 1),
        device_busy=None if busy is None else round(busy, 3),
        errors=sorted({r.error for r in results if not r.ok})[:3],
    )


def compute_seconds(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(r"^spyre_device_compute_seconds_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


def wait_ready(proc: subprocess.Popen, url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {seconds:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Server:
    """One server under test: how to start it, where it answers, what its requests add."""
    name: str
    cmd: list[str]
    ready_path: str
    port: int
    model: str
    extra: dict
    busy_metric: bool
    proc: subprocess.Popen | None = None
    log: object = None
    starter: object = None          # a peer: () -> benchmarks.peers.launch.PeerServer
    peer: object = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_server(srv: Server, env: dict, args, warmup: list) -> None:
    print(f"  starting {srv.name}", file=sys.stderr, flush=True)
    if srv.starter is not None:
        srv.peer = srv.starter()
        srv.port, srv.model = srv.peer.port, srv.peer.model
        srv.extra = {**srv.peer.request_extra, **srv.extra}
        asyncio.run(run_level(srv.base, srv.model, warmup, 2, 8, srv.extra, args.request_timeout))
        return
    srv.log = open(Path(args.log_dir) / f"{srv.name}.log", "w")  # noqa: SIM115 - closed in stop_server
    srv.proc = subprocess.Popen(srv.cmd, env=env, stdout=srv.log, stderr=subprocess.STDOUT)
    wait_ready(srv.proc, srv.base + srv.ready_path, args.start_timeout)
    # warm-up: short requests so first-call costs are not in the table
    asyncio.run(run_level(srv.base, srv.model, warmup, 2, 8, srv.extra, args.request_timeout))


def stop_server(srv: Server) -> None:
    if srv.peer is not None:
        srv.peer.stop()
    if srv.proc is not None:
        stop(srv.proc)
    if srv.log is not None:
        srv.log.close()


class PromptSets:
    """Prompts no earlier request sent: warm-up ones, then for every (level, round) a set of
    its own, the same set for every server of that round (each server has its own caches), so
    no prefix cache, ours or a peer's, holds a prompt it is measured on. `make(n)` gives n
    prompts never given before."""

    def __init__(self, make, args):
        self.warmup = make(2)
        self.sets = {(c, r): make(max(c, args.min_requests))
                     for c in args.concurrency for r in range(args.rounds)}

    def level(self, c: int, rnd: int) -> list:
        return self.sets[(c, rnd)]


def busy_fraction(seconds: float) -> float:
    """The share of the machine's CPU time (all cores) not idle over the next ``seconds``."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]          # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit: float = 0.15, most: float = 15.0) -> None:
    """Wait (at most ``most`` seconds) until the machine is quiet for half a second, so that a
    server measured after another does not share the cores with its wind-down (after a level
    of vLLM's CPU server the machine stayed busy 1-1.5 s; before this wait, the server measured
    right after it had the slowest c=8 TTFT in three rounds of three)."""
    t0 = time.monotonic()
    while (busy := busy_fraction(0.5)) > limit and time.monotonic() < t0 + most:
        pass
    if time.monotonic() - t0 > 1:
        print(f"  waited {time.monotonic() - t0:.1f} s for a quiet machine (last half second "
              f"{100 * busy:.0f}% busy)", file=sys.stderr, flush=True)


def measure_level(srv: Server, c: int, args, prompts: list) -> Level:
    before = compute_seconds(srv.base) if srv.busy_metric else None
    results, duration = asyncio.run(
        run_level(srv.base, srv.model, prompts, c, args.output_tokens, srv.extra, args.request_timeout))
    busy = (compute_seconds(srv.base) - before) / duration if srv.busy_metric else None
    return summarize(srv.name, c, results, duration, busy)


def bench_servers(servers: list[Server], env: dict, args, prompts: PromptSets,
                  before_stop=None) -> list[Level]:
    """Start every server, then measure each concurrency level on each server in turn, for
    --rounds rounds, keeping each (server, level)'s round of most output tokens/s: on a shared
    machine a burst of load from elsewhere then lands on both servers' rounds alike. An idle
    server takes no CPU from the one being measured (each waits on its socket).
    `before_stop(srv)` runs for each server still up before it is stopped."""
    best: dict[tuple[str, int], Level] = {}
    try:
        for srv in servers:
            start_server(srv, env, args, prompts.warmup)
        for c in args.concurrency:
            for rnd in range(args.rounds):
                for srv in servers:
                    wait_quiet()
                    level = measure_level(srv, c, args, prompts.level(c, rnd))
                    print(f"  {srv.name} c={c} round {rnd + 1}/{args.rounds}: {level.output_tok_s} tok/s, "
                          f"TTFT p50 {level.ttft_p50_ms} ms, TPOT p50 {level.tpot_p50_ms} ms, "
                          f"failed {level.failed}", file=sys.stderr, flush=True)
                    key = (srv.name, c)
                    if key not in best or (level.failed, -level.output_tok_s) < (best[key].failed,
                                                                                  -best[key].output_tok_s):
                        best[key] = level
    finally:
        for srv in servers:
            if before_stop is not None and srv.proc is not None and srv.proc.poll() is None:
                before_stop(srv)         # e.g. read its /metrics
            stop_server(srv)
    return [best[(srv.name, c)] for srv in servers for c in args.concurrency if (srv.name, c) in best]


def spyre_server(name: str, model: str, served: str, args, extra_flags: list[str]) -> Server:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "spyre-serve"), "serve", "--model", model,
           "--served-model-name", served, "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting", "100000", *extra_flags, *args.spyre_args.split()]
    return Server(name, cmd, "/health", port, served, {"ignore_eos": True}, busy_metric=True)


# --- SmolLM2-135M-Instruct against llama.cpp and vLLM -----------------------------------------

# name -> (kind, what): spyre-serve flags, a llama.cpp GGUF (paths() key), a vLLM dtype
SMOLLM2_SERVERS = {
    "spyre-fp32": ("spyre", []),
    "spyre-fp32-1proc": ("spyre", ["--no-engine-process"]),   # the engine in the API process
    "spyre-bf16w": ("spyre", ["--dtype", "bfloat16", "--compute-dtype", "float32"]),
    "spyre-bf16": ("spyre", ["--dtype", "bfloat16"]),
    "spyre-q8_0": ("spyre-gguf", "gguf_q8_0"),
    "spyre-q4_1": ("spyre-gguf", "gguf_q4_1"),
    "spyre-q4_k_m": ("spyre-gguf", "gguf_q4_k_m"),
    "llamacpp-f32": ("llamacpp", "gguf_f32"),
    "llamacpp-q8_0": ("llamacpp", "gguf_q8_0"),
    "llamacpp-q4_1": ("llamacpp", "gguf_q4_1"),
    "llamacpp-q4_k_m": ("llamacpp", "gguf_q4_k_m"),
    "vllm-f32": ("vllm", "float32"),
    "vllm-bf16": ("vllm", "bfloat16"),
}
# spyre-bf16 under other prefill budgets: --max-num-batched-tokens / --max-prefill-tokens-with-decodes
for _budget, _cap in ((2048, 128), (2048, 512), (2048, 2048), (1024, 256), (512, 128)):   # 512 / 128: the old defaults
    SMOLLM2_SERVERS[f"spyre-bf16-{_budget}-{_cap}"] = (
        "spyre", ["--dtype", "bfloat16", "--max-num-batched-tokens", str(_budget),
                  "--max-prefill-tokens-with-decodes", str(_cap)])


def smollm2_servers(names: list[str], args) -> list[Server]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from launch import start_llamacpp, start_vllm
    from smollm2 import paths

    p = paths(args.peers_cache)
    out = []
    for name in names:
        kind, what = SMOLLM2_SERVERS[name]
        if kind == "spyre":
            out.append(spyre_server(name, str(p["hf_f32"]), "smollm2", args, what))
            continue
        if kind == "spyre-gguf":            # the file at its width, int8 activations (auto)
            out.append(spyre_server(name, str(p[what]), "smollm2", args, []))
            continue
        starter = functools.partial(start_llamacpp, p[what], parallel=max(args.max_num_seqs, 32), threads=2,
                                    cache=args.peers_cache, log_dir=args.log_dir) if kind == "llamacpp" else \
            functools.partial(start_vllm, p["hf_f32"], what, cache=args.peers_cache, log_dir=args.log_dir)
        out.append(Server(name, [], "/health", 0, "", {}, busy_metric=False, starter=starter))
    for srv in out:
        srv.extra["stream_options"] = {"include_usage": True}    # tokens counted from usage
    return out


def smollm2_ratios(levels: list[Level], bw_gbs: float, weight_bytes: int,
                   gguf_bytes: dict[str, int]) -> list[str]:
    """The issue's targets, as ratios of this run's figures."""
    at = {(v.server, v.concurrency): v for v in levels if not v.failed}
    lines = []

    def tps(name, c):
        v = at.get((name, c))
        return v.output_tok_s if v else None

    for c in sorted({v.concurrency for v in levels}):
        ours = tps("spyre-fp32", c)
        peers = [x for x in (tps("llamacpp-f32", c), tps("vllm-f32", c)) if x]
        if ours and peers:
            lines.append(f"- fp32 c={c}: spyre-serve {ours:.1f} tok/s = {ours / max(peers):.2f}x the better "
                         f"of llama.cpp F32 and vLLM float32 ({max(peers):.1f}; target >= 1.3x)")
        bf, vb = tps("spyre-bf16", c), tps("vllm-bf16", c)
        if bf and vb:
            lines.append(f"- bf16 compute c={c}: {bf:.1f} tok/s = {bf / vb:.2f}x vLLM bfloat16 ({vb:.1f}; "
                         "target >= 1.3x at c=8, 32)")
        v32 = at.get(("spyre-fp32", c))
        if c >= 8 and v32 and v32.tpot_p50_ms:
            lines.append(f"- fp32 c={c}: ITL p99 {v32.itl_p99_ms} ms = {v32.itl_p99_ms / v32.tpot_p50_ms:.2f}x "
                         "TPOT p50 (target <= 3x at c=32)")
    for name, width in (("spyre-fp32", 4), ("spyre-bf16w", 2), ("spyre-bf16", 2)):
        v = at.get((name, 1))
        if v and bw_gbs:
            floor_ms = weight_bytes * width / 4 / (bw_gbs * 1e9) * 1e3
            lines.append(f"- {name} c=1: TPOT p50 {v.tpot_p50_ms} ms = {v.tpot_p50_ms / floor_ms:.2f}x the "
                         f"bandwidth floor ({floor_ms:.1f} ms: weights / {bw_gbs:.1f} GB/s; target <= 1.2x)")
    for ours_name, peer_name, what in (("spyre-q8_0", "llamacpp-q8_0", "gguf_q8_0"),
                                       ("spyre-q4_1", "llamacpp-q4_1", "gguf_q4_1"),
                                       ("spyre-q4_k_m", "llamacpp-q4_k_m", "gguf_q4_k_m")):
        for c in sorted({v.concurrency for v in levels}):
            ours, peer = tps(ours_name, c), tps(peer_name, c)
            if ours and peer:
                lines.append(f"- {ours_name} c={c}: {ours:.1f} tok/s = {ours / peer:.2f}x llama.cpp on the "
                             f"same file ({peer:.1f}; target >= 1.3x)")
        for c in sorted({v.concurrency for v in levels}):
            ours, bf = tps(ours_name, c), tps("spyre-bf16", c)
            if ours and bf:
                lines.append(f"- {ours_name} c={c}: {ours / bf:.2f}x our bf16 ({bf:.1f}; target >= 1x)")
        v = at.get((ours_name, 1))
        if v and bw_gbs and gguf_bytes.get(what):
            floor_ms = gguf_bytes[what] / (bw_gbs * 1e9) * 1e3
            lines.append(f"- {ours_name} c=1: TPOT p50 {v.tpot_p50_ms} ms = {v.tpot_p50_ms / floor_ms:.2f}x the "
                         f"bandwidth floor ({floor_ms:.1f} ms: the file's {gguf_bytes[what] / 1e6:.0f} MB / "
                         f"{bw_gbs:.1f} GB/s; target <= 1.2x)")
    q4, w16 = tps("llamacpp-q4_1", 1), tps("spyre-bf16w", 1)
    if q4 and w16:
        lines.append(f"- bf16 weights c=1: {w16:.1f} tok/s = {w16 / q4:.2f}x llama.cpp Q4_1 ({q4:.1f}; target >= 1x)")
    return lines


def main_smollm2(args, argv) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from smollm2 import paths

    from benchmarks.limits import bandwidth
    from spyre_serve.device.isa import current as kernel_isa

    hf = paths(args.peers_cache)["hf_f32"]
    weight_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    prompts = PromptSets(id_prompt_maker(vocab, args.prompt_tokens), args)
    bw = bandwidth(512 << 20)["machine_gbs"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    servers = smollm2_servers(args.servers or list(SMOLLM2_SERVERS), args)
    levels = bench_servers(servers, env, args, prompts)
    bw = max(bw, bandwidth(512 << 20)["machine_gbs"])
    command = "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    files = paths(args.peers_cache)
    gguf_bytes = {k: files[k].stat().st_size for k in ("gguf_q8_0", "gguf_q4_1", "gguf_q4_k_m")
                  if files[k].exists()}
    lines = smollm2_ratios(levels, bw, weight_bytes, gguf_bytes)
    report = {"command": command.strip(), "checkpoint": str(hf), "kernel_isa": kernel_isa().describe(),
              "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "cpu_count": os.cpu_count(), "rounds": args.rounds,
              "bandwidth_gbs": round(bw, 1), "weight_bytes_fp32": weight_bytes,
              "levels": [asdict(v) for v in levels], "ratios": lines}
    return publish(args.out, report, f"SmolLM2-135M-Instruct, prompts of {args.prompt_tokens} token ids, "
                   f"{args.output_tokens} output tokens (ignore_eos), read bandwidth {bw:.1f} GB/s, "
                   f"kernels {kernel_isa().describe()}", levels, lines)


def table(levels: list[Level]) -> str:
    rows = ["| server | concurrency | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
            "| TPOT p99 ms | ITL p99 ms | device busy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in levels:
        busy = "" if v.device_busy is None else f"{100 * v.device_busy:.0f}%"
        rows.append(f"| {v.server} | {v.concurrency} | {v.requests - v.failed}/{v.requests} | {v.output_tok_s} "
                    f"| {v.ttft_p50_ms} | {v.ttft_p99_ms} | {v.tpot_p50_ms} | {v.tpot_p99_ms} "
                    f"| {v.itl_p99_ms} | {busy} |")
    return "\n".join(rows)


def ratios(levels: list[Level]) -> str:
    ours = {v.concurrency: v for v in levels if v.server == "spyre-serve"}
    theirs = {v.concurrency: v for v in levels if v.server == "transformers"}
    lines = []
    for c in sorted(set(ours) & set(theirs)):
        a, b = ours[c], theirs[c]
        tput = a.output_tok_s / b.output_tok_s if b.output_tok_s else float("inf")
        ttft = a.ttft_p99_ms / b.ttft_p99_ms if b.ttft_p99_ms else float("nan")
        lines.append(f"- concurrency {c}: output tokens/s {tput:.2f}x transformers'; TTFT p99 {ttft:.2f}x theirs")
    return "\n".join(lines)


def publish(out: str, report: dict, setting: str, levels: list, lines: list[str]) -> int:
    """Write ``report`` as JSON to ``out``; print its command, the cores and ``setting``, the
    levels' table and the ratio lines. 0 (a main's exit status)."""
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"`{report['command']}` on {os.cpu_count()} cores, {setting}\n")
    print(table(levels))
    print("\n" + "\n".join(lines))
    return 0


def server_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The flags every serving benchmark shares: extra spyre-serve flags, the peers' cache,
    timeouts, where logs and the JSON result (``out`` under benchmarks/results) go."""
    ap.add_argument("--spyre-args", default="",
                    help="extra spyre-serve flags, e.g. '--max-prefill-tokens-with-decodes 128'")
    ap.add_argument("--peers-cache", default=None, help="benchmarks/peers cache directory")
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--log-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=4, help="requests per level at least (else = concurrency)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="spyre-serve --max-num-seqs")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds per level (servers alternate within a round); each keeps its best")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--granite", choices=["granite-tiny", "granite-8b-layers"], default="granite-tiny",
                    help="the Granite profile served (--model granite-tiny)")
    ap.add_argument("--tensor-parallel", type=int, nargs="+", default=[1],
                    help="spyre-serve's --tensor-parallel-size, a server for each (e.g. 1 2)")
    ap.add_argument("--skip-spyre", action="store_true")
    ap.add_argument("--model", choices=["granite-tiny", "smollm2"], default="granite-tiny",
                    help="granite-tiny: against transformers serve; smollm2: against llama.cpp and vLLM")
    ap.add_argument("--servers", nargs="+", choices=list(SMOLLM2_SERVERS), default=None,
                    help="with --model smollm2: which servers (default: all)")
    server_args(ap, "serving.json")
    args = ap.parse_args(argv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    if args.model == "smollm2":
        return main_smollm2(args, argv)
    from spyre_serve.device.isa import current as current_isa
    from spyre_serve.models import resolve_model

    checkpoint = str(resolve_model(args.granite))
    prompts = PromptSets(text_prompt_maker(prompts_needed(args), args.prompt_tokens), args)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    servers = []
    if not args.skip_spyre:
        for tp in args.tensor_parallel:   # each degree a server of its own: TP 1 is "spyre-serve"
            servers.append(spyre_server("spyre-serve" if tp == 1 else f"spyre-serve-tp{tp}", checkpoint,
                                        args.granite, args, ["--tensor-parallel-size", str(tp)]))
    if not args.skip_transformers:
        port = free_port()
        cmd = [str(bin_dir / "transformers"), "serve", "--continuous-batching", "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port), checkpoint]
        servers.append(Server("transformers", cmd, "/v1/models", port, checkpoint, {}, busy_metric=False))
    levels = bench_servers(servers, env, args, prompts)

    command = "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {
        "command": command.strip(),
        "checkpoint": checkpoint,
        "kernel_isa": current_isa().describe(),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "levels": [asdict(v) for v in levels],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"`{report['command']}` on {os.cpu_count()} cores, kernels {report['kernel_isa']}, {args.granite}, "
          f"prompts of ~{args.prompt_tokens} "
          f"tokens, {args.output_tokens} output tokens\n")
    print(table(levels))
    r = ratios(levels)
    if r:
        print("\n" + r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
