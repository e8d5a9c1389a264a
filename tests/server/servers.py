"""Helpers of the server tests: a uvicorn server on a thread (`ServerThread`), the settings of
the shared real server (`real_settings`), its prompt, and an SSE reader."""

from __future__ import annotations

import asyncio
import socket
import threading
import time


class ServerThread:
    """A real uvicorn server for ``app`` on 127.0.0.1, a free port, in a background thread."""

    def __init__(self, app, config=None) -> None:
        """``config``: a uvicorn.Config of ``app`` to serve with (its host and port are
        ignored: the server takes this thread's socket)."""
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = config or uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def http_client(server, timeout: float = 600):
    """An httpx client of ``server`` (a ServerThread), for a fixture to yield from."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=timeout) as c:
        yield c


def real_settings(**overrides):
    """granite-tiny, sized so tests are quick on 2 cores: small buckets, lazy programs."""
    from spyre_serve.server.launch.cli import Settings

    base = dict(
        model="granite-tiny",
        max_num_seqs=32,
        max_num_batched_tokens=64,
        block_size=16,
        num_kv_blocks=256,
        max_model_len=1024,
        device_memory=1 << 30,
        warmup=False,
        max_n=4,
        max_waiting=256,
        offload_wait=30.0,  # CI's compile jobs may hold both cores: the 1 s bound has its own test
        engine_process=False,  # the engine in this process: tests read its parts (engine_process tests: True)
    )
    base.update(overrides)
    return Settings(**base)


PROMPT = "The quick brown fox jumps over the lazy dog. Then"
POOLING_CONTEXT = 64   # the pooling server's --max-num-batched-tokens: a pooled prompt is one step's


def sse_events(response) -> list:
    """The JSON payloads of an SSE response, then the literal '[DONE]'."""
    import json

    out = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
