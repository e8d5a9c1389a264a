"""The engine in a process of its own (``--engine-process``, serve's default): the same answers as
the engine in the API's process, requests and updates crossing in batches, structured output
compiled again on the engine's side, aborts that free blocks, /metrics from both processes, and
the engine process's death seen at once (in-flight streams end with an error event, the server
exits 1)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.reliability.servers import running_server, server_process
from tests.server.engine.test_e2e_concurrency import stream_text
from tests.server.servers import PROMPT


@pytest.fixture(scope="module")
def split():
    with running_server(engine_process=True) as server:
        yield server
    assert not server.built.engine.process.is_alive()


@pytest.fixture(scope="module")
def http(split):
    with httpx.Client(base_url=split.url, timeout=600) as c:
        yield c


def test_the_engine_runs_in_another_process_and_answers_as_the_one_in_process(http, client, split):
    engine = split.built.engine
    assert engine.process.pid != os.getpid() and engine.process.is_alive()
    assert split.built.runner is None and split.built.card is None   # no card in the API process
    for body in ({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2},
                 {"prompt": [PROMPT, "The sky is"], "max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 2},
                 {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}):
        split_answer, one_answer = http.post("/v1/completions", json=body), client.post("/v1/completions", json=body)
        assert split_answer.status_code == one_answer.status_code == 200
        assert split_answer.json()["choices"] == one_answer.json()["choices"]
        split_usage, one_usage = split_answer.json()["usage"], one_answer.json()["usage"]
        # the steps' projected seconds cross the pipe too; their values depend on what each
        # server's prefix cache holds
        assert split_usage.pop("spyre")["projected_seconds"] > 0 and one_usage.pop("spyre")
        assert split_usage == one_usage


def test_requests_and_token_updates_cross_in_batches_not_one_message_per_token(split):
    traffic = split.built.engine.traffic
    before = dict(traffic)

    async def run():
        async with httpx.AsyncClient(base_url=split.url, timeout=600) as c:
            return await asyncio.gather(*(stream_text(c, f"{PROMPT} {i}", 16) for i in range(8)))

    results = asyncio.run(run())
    assert all(finish == "length" for _, finish in results)
    got = {k: traffic[k] - before[k] for k in traffic}
    assert got["updates_in"] >= 8 * 16 // 2          # a token per update at most twice per update
    assert got["batches_in"] * 3 <= got["updates_in"]  # each batch carried several streams' tokens
    assert got["items_out"] >= 8 and got["messages_out"] <= got["items_out"]


def test_structured_output_is_compiled_again_in_the_engine_process(http):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a number"}], "max_tokens": 24, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) == {"n"}
    else:
        assert choice["message"]["content"].startswith('{"n": ')


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_client_that_leaves_mid_stream_frees_its_request_and_blocks(http, split):
    async def leave():
        async with httpx.AsyncClient(base_url=split.url, timeout=600) as c:
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True, "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break      # one chunk, then the client is gone

    asyncio.run(leave())
    deadline = time.monotonic() + 60
    while split.built.engine.num_requests or metric(http, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
        time.sleep(0.05)


def test_metrics_hold_the_engine_process_and_the_api_process_each_family_once(http):
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    text = http.get("/metrics").text
    assert metric(http, "vllm:generation_tokens_total") > 0          # the engine's counters
    assert metric(http, "spyre_api_offload_workers") >= 1              # the API's threads
    assert metric(http, "spyre_engine_alive") == 1.0
    assert metric(http, "spyre_projected_step_seconds_count") >= 2    # each step, on a real card
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), "a family written twice"


def test_health_and_admission_read_the_engine_process(http, split):
    assert http.get("/health").status_code == 200
    engine = split.built.engine
    assert engine.num_running_requests == 0 and engine.num_waiting_sequences == 0


# ---- the engine process's death, seen by a real server process -------------------------------

def test_killing_the_engine_process_ends_every_stream_with_an_error_and_the_server_exits_1():
    # step 3 hangs for good (no step timeout): the stream is in flight when the engine is killed
    with server_process("--step-timeout", "0", env={"SPYRE_TEST_ENGINE_FAULT": "hang@3"}) as server:
        events: list[str] = []

        async def stream():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: "):])

        async def main():
            task = asyncio.create_task(stream())
            await asyncio.sleep(2.0)
            os.kill(server.engine_pid, signal.SIGKILL)
            t0 = time.monotonic()
            await asyncio.wait_for(task, 30)
            return time.monotonic() - t0

        took = asyncio.run(main())
        assert took < 5, f"the stream ended {took:.1f} s after the engine process died"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500, error            # what failed is in the log, not the answer
        assert server.wait(30) == 1
        assert "the engine process died: the engine process exited (exit code -9)" in server.log_tail(80)


# ---- several API processes before one engine process -----------------------------------------

def test_two_api_processes_share_the_port_and_the_engine_and_drain_on_sigterm():
    from pathlib import Path

    from tests.reliability.servers import descendants

    with server_process("--api-server-count", "2") as server:
        spawned = [k for k in descendants(server.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(spawned) == 3                           # the engine and two API processes

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                alone = (await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                               "temperature": 0})).json()["choices"][0]["text"]
                many = await asyncio.gather(*(stream_text(c, PROMPT, 8) for _ in range(12)))
                # connections of their own: the kernel hands them to either API process
                return alone, many

        alone, many = asyncio.run(main())
        assert all(text == alone and finish == "length" for text, finish in many)
        metrics = httpx.get(server.url + "/metrics").text
        assert "vllm:generation_tokens_total" in metrics and "spyre_api_offload_workers" in metrics
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        assert not any(Path(f"/proc/{k}").exists() for k in spawned)


def test_an_api_server_count_without_the_engine_process_is_refused():
    from spyre_serve.server.launch.cli import parse_command

    with pytest.raises(SystemExit):
        parse_command(["serve", "--api-server-count", "2", "--no-engine-process"])
