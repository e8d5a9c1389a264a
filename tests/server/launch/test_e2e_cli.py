"""The spyre-serve command: help, environment configuration, start-up log, SIGTERM drain, and
a serving process without torch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from spyre_serve.server.launch.cli import Settings, parse_args
from tests import background

BIN = Path(sys.executable).parent / "spyre-serve"
ROOT = Path(__file__).resolve().parents[3]
# the dev venv's editable install may predate the packages' __init__.py files (it then maps
# them as namespace packages); putting the checkout first on the path makes the script use it
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
FLAGS = ["--model", "--host", "--port", "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens",
         "--block-size", "--device-memory", "--api-key", "--max-waiting", "--num-kv-blocks", "--max-model-len",
         "--drain-timeout", "--max-n", "--max-body-bytes", "--warmup"]


def test_help_documents_every_flag_and_its_environment_variable():
    top = subprocess.run([BIN, "--help"], capture_output=True, text=True, check=True, env=ENV).stdout
    assert "serve" in top
    out = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, check=True, env=ENV).stdout
    for flag in FLAGS:
        assert flag in out, flag
        assert "SPYRE_SERVE_" + flag[2:].replace("-", "_").upper() in out, flag


def test_flags_come_from_the_environment_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("SPYRE_SERVE_PORT", "9123")
    monkeypatch.setenv("SPYRE_SERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SPYRE_SERVE_DEVICE_MEMORY", "2G")
    monkeypatch.setenv("SPYRE_SERVE_API_KEY", "k")
    monkeypatch.setenv("SPYRE_SERVE_WARMUP", "false")
    s = parse_args(["serve", "--max-num-seqs", "9"])
    assert (s.port, s.max_num_seqs, s.device_memory, s.api_key, s.warmup) == (9123, 9, 2 << 30, "k", False)
    assert Settings().model == "granite-tiny"


def test_a_bad_size_is_refused_with_the_value(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--device-memory", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["--model", "/no/such/model"], "model '/no/such/model' is neither a model name"),
    # refused in the engine process, after it started: the API process says it, once
    (["--model", "granite-tiny", "--block-size", "7"], "block size and head dim in multiples of 16, got 7"),
    (["--model", "granite-tiny", "--block-size", "7", "--no-engine-process"], "multiples of 16, got 7"),
    (["--model", "granite-tiny", "--device-memory", "1M"], "device out of memory"),
    # several API processes: the supervisor, or the first API process, says it once
    (["--model", "/no/such/model", "--api-server-count", "2"], "is neither a model name"),
    (["--model", "granite-tiny", "--block-size", "7", "--api-server-count", "2"], "multiples of 16, got 7"),
])
def test_a_model_or_flag_that_cannot_be_served_is_one_line_and_exit_code_2(args, said):
    r = subprocess.run([BIN, "serve", "--port", str(free_port()), *args], capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "spyre-serve serve: error:" in line]
    assert len(lines) == 1 and said in lines[0], r.stderr[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMALL = {"SPYRE_SERVE_MAX_NUM_SEQS": "2", "SPYRE_SERVE_MAX_NUM_BATCHED_TOKENS": "4", "SPYRE_SERVE_BLOCK_SIZE": "16",
         "SPYRE_SERVE_NUM_KV_BLOCKS": "16", "SPYRE_SERVE_MAX_MODEL_LEN": "256", "SPYRE_SERVE_DEVICE_MEMORY": "512M"}


@contextmanager
def started(env: dict):
    """`spyre-serve serve` with ``env`` on a free port, once /health answers 200: yields (the
    process, its output lines as they come, its URL); killed afterwards if it still runs."""
    port = free_port()
    proc = subprocess.Popen([BIN, "serve"], env={**ENV, **SMALL, **env, "SPYRE_SERVE_PORT": str(port)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            while True:
                assert proc.poll() is None, "".join(log)
                assert time.monotonic() < deadline, "server did not start"
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
        yield proc, log, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_api_key_and_the_keys_clients_send_never_reach_the_log():
    """issue 38: with the key from the environment and --log-level debug, requests with a wrong key,
    the right one, and a 500-free error of the request's own: neither key is in the output."""
    key, wrong = "sekrit-key-4242-abcd", "wrong-key-9999-wxyz"
    with started({"SPYRE_SERVE_API_KEY": key, "SPYRE_SERVE_LOG_LEVEL": "debug"}) as (proc, log, url):
        with httpx.Client(base_url=url, timeout=600) as c:
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
            ok = {"Authorization": f"Bearer {key}"}
            assert c.post("/v1/completions", headers=ok, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            assert c.post("/v1/completions", headers=ok, json={"prompt": "hi", "max_tokens": 2,
                                                                 "made_up": 1}).status_code == 200
            assert c.post("/v1/completions", headers=ok, json={"prompt": "hi", "n": 10 ** 6}).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    text = "".join(log)
    assert "made_up" in text and "DEBUG" in text        # the log was written, at debug level
    assert key not in text and wrong not in text


def test_sigterm_refuses_new_requests_finishes_running_ones_and_exits_0():
    with started({"SPYRE_SERVE_DRAIN_TIMEOUT": "300"}) as (proc, log, url):
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, timeout=600) as c:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert "libtorch" not in maps and "/torch/" not in maps   # serving runs without torch
            events: list = []
            body = {"prompt": "Hello there", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = (line for line in r.iter_lines() if line)
                events.append(next(lines))
                proc.send_signal(signal.SIGTERM)
                while c.get("/health").status_code == 200:
                    time.sleep(0.05)
                refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                events.extend(lines)
            # the stream's connection, open since before the signal, is idle in the pool now that
            # the engine has drained: the server still answers on it (a proxy's keep-alive pool
            # would send there), and closes it after that answer
            again = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert again.status_code == 503 and again.headers["connection"] == "close"
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(120) == 0
    text = "".join(log)
    assert "model granite-tiny" in text
    assert "memory plan" in text and "weights" in text and "KV cache 16 blocks" not in text
    assert "16 blocks of 16 tokens" in text and "scratch" in text
    assert "compiling and preparing 5 step programs" in text and "5/5" in text  # the progress bar
    assert f"http://127.0.0.1:{port}" in text
    # the engine process leaves no semaphore for multiprocessing's resource tracker to report
    assert "leaked" not in text and "resource_tracker" not in text, text[-2000:]


def test_a_stream_still_running_at_the_drains_end_is_cut_with_an_error_event_within_the_budget():
    """--drain-timeout is the whole budget from SIGTERM to exit: a stream that would run on
    is cut 2 s before its end with an OpenAI error event and [DONE], and the process exits 0
    within the budget (so Kubernetes' grace period covers preStop + the drain)."""
    with started({"SPYRE_SERVE_DRAIN_TIMEOUT": "4", "SPYRE_SERVE_MAX_MODEL_LEN": "4096",
                  "SPYRE_SERVE_NUM_KV_BLOCKS": "300"}) as (proc, log, url):
        with httpx.Client(base_url=url, timeout=600) as c:
            body = {"prompt": "Hello there", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = (line for line in r.iter_lines() if line)
                first = next(lines)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                events = [first, *lines]
        assert proc.wait(60) == 0 and time.monotonic() - t0 < 4 + 3
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert set(last) == {"error"} and last["error"]["code"] == 500 and "request id" in last["error"]["message"]
        assert len(events) < 4000
    assert "drain timeout: 1 requests still running are cut off" in "".join(log)


def test_warmup_takes_the_sizing_flags_only():
    from spyre_serve.server.launch.cli import parse_command

    command, s = parse_command(["warmup", "--model", "granite-tiny", "--max-num-seqs", "3",
                                "--device-memory", "1G"])
    assert (command, s.model, s.max_num_seqs, s.device_memory) == ("warmup", "granite-tiny", 3, 1 << 30)
    assert parse_command(["serve"])[0] == "serve"
    out = subprocess.run([BIN, "warmup", "--help"], capture_output=True, text=True, check=True, env=ENV).stdout
    for flag in ("--model", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-kv-blocks",
                 "--max-model-len", "--device-memory"):
        assert flag in out and "SPYRE_SERVE_" + flag[2:].replace("-", "_").upper() in out, flag
    r = subprocess.run([BIN, "warmup", "--port", "1"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "--port" in r.stderr


@background.job("warmup-cold-cache")
def _warmup_twice(scratch: str) -> background.Job:
    """``spyre-serve warmup`` into an empty cache, then again into the cache it filled."""
    env = {**ENV, "NUMBA_CACHE_DIR": str(Path(scratch) / "numba"), "SPYRE_SERVE_MAX_NUM_SEQS": "2"}
    cmd = [str(BIN), "warmup", "--model", "granite-tiny", "--max-num-batched-tokens", "4",
           "--block-size", "16", "--num-kv-blocks", "8", "--device-memory", "256M"]
    return background.Job([cmd, cmd], env=env, seconds=185)


@pytest.mark.background("warmup-cold-cache")
def test_warmup_compiles_every_step_program_into_the_cache_and_exits_0():
    r, again = background.result("warmup-cold-cache")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "model granite-tiny" in out
    assert "memory plan on a 256.0 MiB card" in out and "8 blocks of 16 tokens" in out and "scratch" in out
    for t, s in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]:    # every bucket, from the env's 2 seqs
        assert f"step_t{t}_s{s}: tokens {t}, sequences {s}" in out, out
    assert "5 step programs prepared" in out and "compiled and written to the cache" in out
    assert "5/5" in r.stderr                                  # the progress bar
    cache = background.scratch("warmup-cold-cache") / "numba"
    assert list(cache.rglob("*step_entry*.nbc")), "nothing compiled into NUMBA_CACHE_DIR"
    assert again.returncode == 0, again.stderr[-3000:]
    assert "loaded from the cache (compiles 0" in again.stdout
