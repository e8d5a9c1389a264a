"""The denial-of-service benchmark: what a flood of the costliest requests a client may send
does to everyone else's streams, on one granite-tiny server.

    .venv/bin/python benchmarks/flood.py [--calm 30] [--flood 60] [--clients 4] [--streams 8]
        [--holes all|NAME,...] [--each] [--out JSON]

Two phases in one run, the same server: calm (``--streams`` normal streams, each a new
prompt of ~64 tokens and 64 generated tokens, one after another) and flood (the same streams
while ``--clients`` flood clients, in a process of their own, send the holes of issue 19 at
their worst size, each hole in turn):

    schema      a chat whose JSON schema is just under --max-schema-bytes (checked and
                compiled on a worker thread)
    errors      a 1 MB completion body of 250,000 empty objects (one error, fail-fast)
    tools       a chat with --max-tools functions, just under --max-tools-bytes
    scored      a completion scoring --max-scored-prompt-tokens prompt tokens (echo, logprobs 5)
    render      a chat of ~900 KB of messages (rendered and tokenized on a worker thread)
    unread      a stream of 600 tokens its client never reads (aborted after
                --stream-send-timeout)

``--each`` floods with one hole at a time instead (a phase per hole, after the one calm phase,
on the same server): a figure per hole. Before the calm phase one request of each hole is sent
alone (``prime``). Measured per phase: the streams' inter-token latency (p50, p99: the gaps
between a stream's chunks), ``/health``'s answer time (polled every 0.2 s: max), the server's
resident memory (max; the API process's and the engine's), the cores each process used (the
API's, the engine's, the flood clients', the streams' client), and what the flood clients got
(status counts per hole). ``--server-flags --no-engine-process`` measures the engine in the
API's process. ``--peer vllm`` runs the same phases against vLLM's CPU server on the same
granite-tiny checkpoint (float32, prefix caching on as ours; ``benchmarks/peers/vllm.sh`` installs
it): what the same flood does to a peer on the same 2 cores. The targets (issue 19): ITL
p99 under flood <= 1.5x calm, /health within 1 s throughout, memory within 10% of calm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import free_port, stop, text_prompt_maker, wait_ready  # noqa: E402

HOLES = ("schema", "errors", "tools", "scored", "render", "unread")
SCHEMA_BYTES, TOOLS, TOOLS_BYTES, SCORED = 16384, 128, 131072, 8192   # the servers' defaults


VARIANTS = 64   # different schemas and tool lists a flood client cycles through (none cached)


def _schema(max_bytes: int, variant: int = 0) -> dict:
    """An object schema of string properties, as large as fits in ``max_bytes``; each variant
    names its properties differently (a new grammar to check and compile)."""
    props, n = {}, 0
    while len(json.dumps({"type": "object", "properties": props})) < max_bytes - 64:
        props[f"v{variant}_field_{n}"] = {"type": "string", "maxLength": 8}
        n += 1
    return {"type": "object", "properties": props}


def payloads() -> dict[str, tuple[str, list[bytes], bool]]:
    """hole -> (path, its bodies (variants, sent in turn), stream and never read)."""
    chat = [{"role": "user", "content": "Describe the harbour."}]
    fn = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 600, "parameters": fn}}
             for i in range(TOOLS)]
    while len(json.dumps(tools)) > TOOLS_BYTES:
        tools[-1]["function"]["description"] = tools[-1]["function"]["description"][:-50]
    words = ("the quiet harbour holds seven boats and one old mill " * 6000)
    big_chat = [{"role": "user", "content": words[:300_000]} for _ in range(3)]
    schemas = [{"messages": chat, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": _schema(SCHEMA_BYTES, v)}}}
        for v in range(VARIANTS)]
    tool_lists = [{"messages": chat, "max_tokens": 8, "tools": [
        {**t, "function": {**t["function"], "name": f"v{v}_{t['function']['name']}"}} for t in tools]}
        for v in range(VARIANTS)]
    bodies = {
        "schema": ("/v1/chat/completions", schemas),
        "tools": ("/v1/chat/completions", tool_lists),
        "scored": ("/v1/completions", [{"prompt": [[(i * 7) % 7000 + 500 for i in range(j, j + 2048)]
                                                   for j in range(SCORED // 2048)],
                                        "max_tokens": 1, "echo": True, "logprobs": 5}]),
        "render": ("/v1/chat/completions", [{"messages": big_chat, "max_tokens": 1}]),
        "errors": ("/v1/completions", [{"prompt": [{}] * 250_000}]),
        "unread": ("/v1/completions", [{"prompt": "Tell me a long story.", "max_tokens": 600,
                                        "ignore_eos": True, "stream": True, "n": 2, "logprobs": 5}]),
    }
    return {k: (p, [json.dumps(b).encode() for b in bs], k == "unread") for k, (p, bs) in bodies.items()}


def _send(port: int, path: str, body: bytes, unread: bool) -> str:
    """One request on a raw connection; its status line's code (an unread stream: "sent")."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n" % (path.encode(), len(body)) + body)
        if unread:
            time.sleep(5)                        # holds the stream unread, then leaves
            return "unread"
        head = s.recv(64)
        while True:                              # read the answer to its end, as a client does
            if not s.recv(1 << 16):
                break
        return head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "none"


def flood(port: int, clients: int, seconds: float, holes: list[str], out) -> None:
    """The flood clients (their own process): each sends the holes in turn for ``seconds``."""
    bodies = payloads()
    counts: Counter = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            hole = holes[i % len(holes)]
            path, variants, unread = bodies[hole]
            i += 1
            try:
                status = _send(port, path, variants[(i // len(holes)) % len(variants)], unread)
            except OSError as exc:
                status = type(exc).__name__
            with lock:
                counts[f"{hole} {status}"] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t = os.times()
    out.put((dict(counts), t.user + t.system))


def prime(port: int, holes: list[str]) -> None:
    """One request of each hole (an unread stream read to its end), before the calm phase: what
    a server that has served them once holds (llguidance's token trie, the allocator's arenas)
    is in the calm figure; what a flood adds is not."""
    bodies = payloads()
    for hole in holes:
        path, variants, _ = bodies[hole]
        _send(port, path, variants[0], False)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def streams(base: str, n: int, seconds: float, prompts) -> list[float]:
    """``n`` streams of new prompts back to back for ``seconds``: every gap between chunks."""
    gaps: list[float] = []
    end = time.monotonic() + seconds

    async def one(c: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            body = {"prompt": prompts(1)[0], "max_tokens": 64, "ignore_eos": True, "stream": True}
            last = None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        await asyncio.gather(*(one(c) for _ in range(n)))
    return gaps


def tree_rss(pid: int) -> dict[str, int]:
    """Resident bytes of the server's processes, as ``ps`` reports them: ``api`` (``pid``),
    ``engine`` (its children: the engine's process and multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=,rss=", "-p", str(pid), "--ppid", str(pid)], capture_output=True,
                         text=True)
    rss = {"api": 0, "engine": 0}
    for line in out.stdout.splitlines():
        p, kb = map(int, line.split())
        rss["api" if p == pid else "engine"] += kb << 10
    return rss


def watch(base: str, pid: int, stop_at: list, health: list, rss: list) -> None:
    """/health's answer times and the server's resident memory, every 0.2 s."""
    with httpx.Client(base_url=base, timeout=30) as c:
        while not stop_at:
            t0 = time.monotonic()
            ok = c.get("/health").status_code == 200
            health.append((time.monotonic() - t0) if ok else float("inf"))
            rss.append(tree_rss(pid))
            time.sleep(0.2)


def phase(base: str, pid: int, args, prompts, holes: list[str] | None) -> dict:
    stop_at, health, rss = [], [], []
    watcher = threading.Thread(target=watch, args=(base, pid, stop_at, health, rss), daemon=True)
    watcher.start()
    results, flood_cpu = None, 0.0
    engine_pids = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                                                  text=True).stdout.split()]
    cpu0 = {"api": cpu_seconds([pid]), "engine": cpu_seconds(engine_pids), "streams": cpu_seconds([os.getpid()])}
    t0 = time.monotonic()
    if holes:
        q = multiprocessing.get_context("spawn").Queue()
        port = int(base.rsplit(":", 1)[1])
        proc = multiprocessing.get_context("spawn").Process(target=flood, args=(port, args.clients, args.flood,
                                                                              holes, q))
        proc.start()
    seconds = args.flood if holes else args.calm
    gaps = asyncio.run(streams(base, args.streams, seconds, prompts))
    if holes:
        results, flood_cpu = q.get(timeout=300)
        proc.join(60)
    stop_at.append(True)
    watcher.join(10)
    wall = time.monotonic() - t0
    cpu1 = {"api": cpu_seconds([pid]), "engine": cpu_seconds(engine_pids), "streams": cpu_seconds([os.getpid()])}
    cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0}
    cores["flood_clients"] = flood_cpu / wall
    g = np.array(gaps) * 1e3
    return {"cores": cores, "seconds": seconds, "gaps": len(g), "itl_p50_ms": float(np.percentile(g, 50)),
            "itl_p99_ms": float(np.percentile(g, 99)), "health_max_s": float(max(health)),
            "health_polls": len(health), "rss_max_mb": max(sum(r.values()) for r in rss) / 2**20,
            "rss_api_max_mb": max(r["api"] for r in rss) / 2**20,
            "rss_engine_max_mb": max(r["engine"] for r in rss) / 2**20, "flood": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calm", type=float, default=30)
    ap.add_argument("--flood", type=float, default=60)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--holes", default="all")
    ap.add_argument("--each", action="store_true", help="one flood phase per hole")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "flood.json"))
    ap.add_argument("--server-flags", default="", help="more flags for spyre-serve serve, e.g. "
                    "--no-engine-process (the engine in the API's process)")
    ap.add_argument("--peer", choices=["spyre-serve", "vllm"], default="spyre-serve",
                    help="the server flooded: ours, or vLLM's CPU server on the same checkpoint")
    args = ap.parse_args(argv)
    holes = list(HOLES) if args.holes == "all" else args.holes.split(",")
    if args.peer == "vllm":
        from peers.launch import start_vllm

        from spyre_serve.models import resolve_model

        peer = start_vllm(resolve_model("granite-tiny"), dtype="float32", prefix_caching=True)
        server, base, port = peer.proc, peer.base_url, peer.port
        stopping = peer.stop
    else:
        port = free_port()
        env = {**os.environ, "SPYRE_SERVE_LOG_LEVEL": "warning"}
        server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "spyre-serve"), "serve", "--port", str(port),
                                   *args.server_flags.split()],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        stopping = lambda: stop(server)  # noqa: E731
    try:
        if args.peer != "vllm":
            wait_ready(server, base + "/health", 900)
        prompts = text_prompt_maker(100_000, 64)
        prime(port, holes)
        calm = phase(base, server.pid, args, prompts, None)
        floods = {h: phase(base, server.pid, args, prompts, [h]) for h in holes} if args.each else \
            {"all": phase(base, server.pid, args, prompts, holes)}
    finally:
        stopping()
    from spyre_serve.device.isa import current

    report = {"date": time.strftime("%Y-%m-%d"), "isa": current().level, "peer": args.peer, "holes": holes,
              "clients": args.clients,
              "streams": args.streams, "server_flags": args.server_flags, "calm": calm, "floods": floods,
              "itl_p99_ratio": {h: f["itl_p99_ms"] / calm["itl_p99_ms"] for h, f in floods.items()},
              "rss_ratio": {h: f["rss_max_mb"] / calm["rss_max_mb"] for h, f in floods.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
