"""Start the peer servers of the serving benchmarks as subprocesses, on 127.0.0.1 only.

    from benchmarks.peers.launch import start_llamacpp, start_vllm   # or with this folder on sys.path
    with start_llamacpp(paths()["gguf_f32"]) as srv:          # llama.cpp's llama-server
        ... POST f"{srv.base_url}/v1/completions" with srv.request_extra ...
    srv = start_vllm(paths()["hf_f32"], "bfloat16"); ...; srv.stop()

Each returns a PeerServer once the server answers its health check (a free port, its output
in srv.log_path), or raises with the tail of that log. Both take a completion prompt as token
ids and ``ignore_eos`` (srv.request_extra), as spyre-serve does. Prefix/prompt caching is off
by default in both (spyre-serve has none, and the benchmark repeats its prompts in rounds).
The binaries come from llamacpp.sh and vllm.sh in this folder, the models from smollm2.py.

As a script, a smoke run: each peer started alone, a few requests (sequential unless
--concurrency), output tok/s; not a benchmark (benchmarks/serving.py is):

    .venv/bin/python benchmarks/peers/launch.py [--cache DIR] [--requests 4] [--max-tokens 128]
        [--concurrency 1] [--peers llamacpp-f32 llamacpp-q4_1 vllm-f32 vllm-bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2 import paths  # noqa: E402

HOST = "127.0.0.1"   # peers listen on the loopback only
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")   # Debian libtcmalloc-minimal4


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class PeerServer:
    name: str
    cmd: list[str]
    port: int
    log_path: Path
    model: str                              # the "model" field requests send
    proc: subprocess.Popen | None = None
    request_extra: dict = field(default_factory=lambda: {"ignore_eos": True})

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group (vLLM runs an engine process beside its API
        server), SIGKILL if it is still there after `timeout`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:    # children left in the group (vLLM's engine core) after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _start(srv: PeerServer, env: dict, ready_path: str, timeout: float) -> PeerServer:
    with open(srv.log_path, "w") as log:
        log.write("$ " + " ".join(srv.cmd) + "\n")
        log.flush()
        srv.proc = subprocess.Popen(srv.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    url = srv.base_url + ready_path
    while True:
        if srv.proc.poll() is not None:
            code = srv.proc.returncode
            srv.stop()
            raise RuntimeError(f"{srv.name} exited with {code} before serving; "
                               f"log {srv.log_path}:\n{_log_tail(srv.log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return srv
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            srv.stop()
            raise TimeoutError(f"{srv.name} not serving {url} after {timeout:.0f} s; "
                               f"log {srv.log_path}:\n{_log_tail(srv.log_path)}")
        time.sleep(0.5)


def _log_path(log_dir: str | os.PathLike | None, name: str) -> Path:
    d = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "spyre-serve-peers"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.log"


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",   # never a hub
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    env.update(extra or {})
    return env


def _installed(given, cache, key: str, script: str) -> Path:
    path = Path(given) if given else paths(cache)[key]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run benchmarks/peers/{script} first")
    return path


def start_llamacpp(gguf_path: str | os.PathLike, parallel: int = 32, threads: int = 2,
                   ctx_per_slot: int = 512, prompt_cache: bool = False,
                   server: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
                   port: int | None = None, log_dir: str | os.PathLike | None = None,
                   extra_args: list[str] | tuple = (), timeout: float = 300.0) -> PeerServer:
    """llama.cpp's llama-server on `gguf_path`: `parallel` slots decoded together (continuous
    batching), each with `ctx_per_slot` tokens of context (-c parallel*ctx_per_slot: the default
    512 holds a 128-token prompt and 256 output tokens), `threads` threads for decode and
    prompt. The request's ``model`` is the GGUF's file stem."""
    server = _installed(server, cache, "llama_server", "llamacpp.sh")
    gguf = Path(gguf_path).resolve()
    name, port = f"llamacpp-{gguf.stem}", port or free_port()
    cmd = [str(server), "--model", str(gguf), "--alias", gguf.stem,
           "--host", HOST, "--port", str(port),
           "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
           "--threads", str(threads), "--threads-batch", str(threads),
           "--cont-batching", "--no-webui"]
    if not prompt_cache:
        cmd += ["--no-cache-prompt", "--cache-ram", "0"]
    cmd += [str(a) for a in extra_args]
    srv = PeerServer(name, cmd, port, _log_path(log_dir, name), gguf.stem)
    try:
        return _start(srv, _env(), "/health", timeout)
    except RuntimeError as e:
        # Seen on a Sapphire Rapids VM (AMX): ggml's AMX backend segfaults in
        # ggml_backend_amx_mul_mat at the first decode of a Q4_1 or Q8_0 file (the F32 file has
        # no AMX path). --no-repack turns off ggml's extra buffer types (AMX, repacked
        # layouts): the same server on its AVX-512/VNNI kernels. Said in the log and on stderr.
        if "exited with -11" not in str(e) or "--no-repack" in cmd:
            raise
        print(f"  {name}: segfaulted at start ({srv.log_path}); again with --no-repack",
              file=sys.stderr)
        retry = PeerServer(name, [*cmd, "--no-repack"], free_port(),
                           srv.log_path.with_name(f"{name}-no-repack.log"), gguf.stem)
        retry.cmd[retry.cmd.index("--port") + 1] = str(retry.port)
        return _start(retry, _env(), "/health", timeout)


def start_vllm(hf_dir: str | os.PathLike, dtype: str = "float32", threads_bind: str = "0-1",
               kv_cache_gib: int = 4, max_model_len: int = 2048, prefix_caching: bool = False,
               python: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
               port: int | None = None, log_dir: str | os.PathLike | None = None,
               extra_args: list[str] | tuple = (), extra_env: dict | None = None,
               preload: bool = True, timeout: float = 900.0) -> PeerServer:
    """vLLM's CPU server (`vllm serve`) on the Hugging Face checkpoint `hf_dir` in `dtype`
    (float32 or bfloat16), its OpenMP threads bound to the cores `threads_bind`, with
    `kv_cache_gib` GiB of KV cache (VLLM_CPU_KVCACHE_SPACE), and (`preload`) tcmalloc and the
    venv's Intel OpenMP in LD_PRELOAD as vLLM's CPU install guide asks. Other scheduler settings
    are vLLM's defaults. The request's ``model`` is the directory's name. Each start
    compiles the model with torch.compile (~3 min of a 4-4.5 min start here; its cache,
    <cache>/vllm-cache, did not shorten a second start).

    Started as ``python -m vllm.entrypoints.openai.api_server --model DIR``, the module entry
    point that `vllm serve` runs for one API server (run_server): the `vllm` command of
    vllm-cpu 0.32.0 dies at start with PackageNotFoundError, as it asks for the version of a
    distribution named "vllm" and this one is named "vllm-cpu"."""
    python = _installed(python, cache, "vllm_python", "vllm.sh")
    hf = Path(hf_dir).resolve()
    name, port = f"vllm-{hf.name}-{dtype}", port or free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
           "--served-model-name", hf.name, "--dtype", dtype,
           "--host", HOST, "--port", str(port), "--max-model-len", str(max_model_len),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--disable-uvicorn-access-log"]
    cmd += [str(a) for a in extra_args]
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           # torch.compile's cache beside the venv, not in ~/.cache
           "VLLM_CACHE_ROOT": str(Path(python).parent.parent.parent / "vllm-cache")}
    if preload:
        libs = [str(x) for x in (TCMALLOC, Path(python).parent.parent / "lib" / "libiomp5.so")
                if Path(x).is_file()]
        env["LD_PRELOAD"] = ":".join(libs + [os.environ.get("LD_PRELOAD", "")]).strip(":")
    env = _env({**env, **(extra_env or {})})
    srv = PeerServer(name, cmd, port, _log_path(log_dir, name), hf.name)
    return _start(srv, env, "/health", timeout)


# --- smoke run ---------------------------------------------------------------------------

def smoke_prompts(hf_dir: Path, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` token ids, cut from the project's prose corpus."""
    from tokenizers import Tokenizer

    text = (Path(__file__).resolve().parents[2] / "models" / "assets" / "corpus" / "prose.txt").read_text()
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text).ids
    step = max(1, (len(ids) - tokens) // max(1, n))
    return [ids[i * step: i * step + tokens] for i in range(n)]


def stream_completion(srv: PeerServer, prompt: list[int], max_tokens: int,
                      timeout: float = 600.0) -> dict:
    """One streaming /v1/completions request: TTFT, end-to-end time, output chunks with text,
    and the usage the server reports."""
    body = {"model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **srv.request_extra}
    req = urllib.request.Request(srv.base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, chunks, usage, text = None, 0, None, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    chunks += 1
                    text.append(ch["text"])
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return {"ttft": ttft or e2e, "e2e": e2e, "chunks": chunks, "usage": usage or {},
            "text": "".join(text)}


def smoke(srv: PeerServer, prompts: list[list[int]], max_tokens: int, concurrency: int = 1) -> dict:
    """The prompts as requests, `concurrency` at a time; output tokens/s over the whole run and
    TPOT per request. Checks that the server took the token ids and honoured ignore_eos."""
    from concurrent.futures import ThreadPoolExecutor

    stream_completion(srv, prompts[0], 8)                      # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: (p, stream_completion(srv, p, max_tokens)), prompts))
    wall = time.perf_counter() - t0
    runs = []
    for p, r in done:
        u = r["usage"]
        if u.get("prompt_tokens") not in (None, len(p)):
            raise RuntimeError(f"{srv.name}: prompt_tokens {u['prompt_tokens']} != {len(p)} token ids")
        n = u.get("completion_tokens", r["chunks"])
        if n != max_tokens:
            raise RuntimeError(f"{srv.name}: {n} output tokens, not {max_tokens}: ignore_eos ignored?")
        r["tokens"] = n
        r["tpot"] = (r["e2e"] - r["ttft"]) / max(1, n - 1)
        runs.append(r)
    tokens = sum(r["tokens"] for r in runs)
    tpots = sorted(r["tpot"] for r in runs)
    return {"server": srv.name, "requests": len(runs), "concurrency": concurrency,
            "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 2),
            "tpot_ms_median": round(1000 * tpots[len(tpots) // 2], 2),
            "ttft_ms_median": round(1000 * sorted(r["ttft"] for r in runs)[len(runs) // 2], 1),
            "chunks_with_text": [r["chunks"] for r in runs],
            "first_text": runs[0]["text"][:80]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Smoke run of the peer servers (one at a time).")
    ap.add_argument("--cache", help="the peers' cache directory (as for smollm2.py)")
    ap.add_argument("--peers", nargs="+",
                    default=["llamacpp-f32", "llamacpp-q4_1", "vllm-f32", "vllm-bf16"],
                    choices=["llamacpp-f32", "llamacpp-q4_1", "vllm-f32", "vllm-bf16"])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--log-dir")
    args = ap.parse_args(argv)
    p = paths(args.cache)
    prompts = smoke_prompts(p["hf_f32"], args.requests, args.prompt_tokens)
    starters = {
        "llamacpp-f32": lambda: start_llamacpp(p["gguf_f32"], cache=args.cache, log_dir=args.log_dir),
        "llamacpp-q4_1": lambda: start_llamacpp(p["gguf_q4_1"], cache=args.cache, log_dir=args.log_dir),
        "vllm-f32": lambda: start_vllm(p["hf_f32"], "float32", cache=args.cache, log_dir=args.log_dir),
        "vllm-bf16": lambda: start_vllm(p["hf_f32"], "bfloat16", cache=args.cache, log_dir=args.log_dir),
    }
    for name in args.peers:
        t0 = time.perf_counter()
        with starters[name]() as srv:
            started = time.perf_counter() - t0
            result = smoke(srv, prompts, args.max_tokens, args.concurrency)
            result.update(peer=name, start_s=round(started, 1), log=str(srv.log_path))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
