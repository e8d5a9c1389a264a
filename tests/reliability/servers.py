"""Helpers of the reliability suite (its fixtures: conftest.py): a real server, a normal request to send
beside a bad one; a real server in its own process (``server_process``: RSS, signals, exit
codes) and ``wait_idle`` (nothing running, waiting, in the KV cache or kept by the runner).

``running_server(**settings)`` is the real stack (granite-tiny, ModelRunner, Engine, FastAPI
behind uvicorn on 127.0.0.1) with a short context, so that generations stay short; the
``server`` fixture is one of them per module. ``beside(server, bad)`` runs ``bad`` while a
normal greedy stream is running in the engine and returns what the stream said, for the isolation
checks: a normal request must give the text it gives alone, whatever its neighbours send.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.server.engine.test_e2e_concurrency import stream_text
from tests.server.servers import PROMPT, ServerThread, real_settings

# granite-tiny with a short context (and a KV cache to match): a runaway generation stops soon
SHORT = dict(max_model_len=256, num_kv_blocks=64)
NORMAL = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@contextmanager
def running_server(**settings):
    """A real server with ``SHORT`` and ``settings`` over tests/server's ``real_settings``."""
    from spyre_serve.server.launch.cli import build

    built = build(real_settings(**{**SHORT, **settings}), progress=False)
    try:
        with ServerThread(built.app) as server:
            server.built = built
            yield server
    finally:
        built.engine.shutdown()


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


# ---- a server in its own process (RSS, signals, exit codes) -------------------------------

REPO = Path(__file__).resolve().parents[2]
# the sizing of SHORT, as flags (and a small card: what this suite's servers share)
PROCESS_FLAGS = ["--model", "granite-tiny", "--max-model-len", "256", "--num-kv-blocks", "64",
                 "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "64",
                 "--device-memory", "1G", "--log-level", "warning"]


class ServerProcess:
    """``spyre-serve serve`` started by ``server_process``: its Popen, URL and log."""

    def __init__(self, proc, url: str, log_path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        """The resident set size now (VmRSS) of the server and its engine process."""
        total = 0
        for pid in (self.pid, *descendants(self.pid)):
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
            except FileNotFoundError:
                continue     # ended meanwhile
        return total

    @property
    def engine_pid(self) -> int:
        """The engine's process (serve's --engine-process; multiprocessing's resource tracker
        is a child too)."""
        kids = [k for k in descendants(self.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(kids) == 1, f"not one engine process under the server {self.pid}: {kids}"
        return kids[0]

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait(self, timeout: float) -> int:
        """The exit code, once the process has ended within ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit within {timeout} s:\n{self.log_tail()}") from None


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux's /proc/PID/task/*/children), children first."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except (FileNotFoundError, ValueError):
            continue
        for k in kids:
            out += [k, *descendants(k)]
    return out


@contextmanager
def server_process(*flags: str, env: dict | None = None, ready_timeout: float = 600, output: str | None = None):
    """``python -m server.launch.cli serve`` on 127.0.0.1 and a free port, with PROCESS_FLAGS, then
    ``flags`` (later ones win), and ``env`` added to the environment; yields once /health
    answers 200 (warm-up included), kills it afterwards if it still runs. Its stdout and stderr
    go to a log file read by ``log_tail``, or to ``output`` (``/dev/full``: a full disk)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(tempfile.mkstemp(prefix="spyre-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "spyre_serve.server.launch.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *PROCESS_FLAGS, *flags]
    with open(output or log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log_file,
                                stderr=subprocess.STDOUT)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up:\n{server.log_tail()}"
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log_path.unlink(missing_ok=True)


def wait_idle(http: httpx.Client, seconds: float = 120) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits, holds KV blocks or runner state; returns
    those four samples (an AssertionError with them if that takes over ``seconds``)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "spyre_runner_held_sequences")
    deadline = time.monotonic() + seconds
    while True:
        values = {n: metric(http, n) for n in names}
        if not any(values.values()):
            return values
        assert time.monotonic() < deadline, f"not idle after {seconds} s: {values}"
        time.sleep(0.1)
