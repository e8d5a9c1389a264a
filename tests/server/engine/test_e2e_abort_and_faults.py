"""Client disconnects free KV blocks; a failing step fails only its requests; on the real stack."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.servers import PROMPT, real_settings, sse_events

MARK = 7777  # a prompt holding this token id is the one the injected fault hits


def wait_until(predicate, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_blocks_metric(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("spyre_kv_blocks_free{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError("spyre_kv_blocks_free not exported")


def idle(engine) -> bool:
    return engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_streaming_client_that_disconnects_frees_its_blocks(client, real_server):
    engine = real_server.built.engine
    total = engine.blocks.num_blocks
    assert free_blocks_metric(client) == total
    body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        assert free_blocks_metric(client) < total  # the request holds blocks while it runs
    wait_until(lambda: idle(engine), "the aborted stream's blocks to be freed")
    assert free_blocks_metric(client) == total
    assert engine.stats.finished.get("abort", 0) >= 1


def test_a_non_streaming_client_that_disconnects_frees_its_blocks(real_server):
    engine = real_server.built.engine
    aborted = engine.stats.finished.get("abort", 0)
    # 1000 tokens take several seconds even on an idle machine; the client gives up after 1
    with httpx.Client(base_url=real_server.url, timeout=httpx.Timeout(600, read=1.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True})
    wait_until(lambda: engine.stats.finished.get("abort", 0) > aborted, "the request to be aborted")
    wait_until(lambda: idle(engine), "the blocks to be freed")


@pytest.fixture
def faulty_runner(real_server, monkeypatch):
    """Make launches fail for sequences whose prompt holds ``state["mark"]`` (MARK unless a
    test sets it; the prompt must fit one prefill chunk), from a given position on."""
    runner = real_server.built.runner
    launch = runner.launch
    marked: dict[int, int] = {}  # seq_id -> prompt length
    state = {"from_decode": 0, "mark": MARK}

    def failing_launch(work, *args, **kwargs):
        for w in work:
            if state["mark"] in w.token_ids and w.start_pos == 0:
                marked[w.seq_id] = len(w.token_ids)
            if w.seq_id in marked and w.start_pos >= marked[w.seq_id] + state["from_decode"]:
                raise RuntimeError(f"injected fault at position {w.start_pos}")
        return launch(work, *args, **kwargs)

    monkeypatch.setattr(runner, "launch", failing_launch)
    return state


def internal_error_logged(message: str, caplog, fault: str) -> None:
    """The client's message names a request id and nothing of the fault; the log has the fault
    under that id."""
    assert message.startswith("internal error (request id ") and "injected" not in message
    request_id = message.split("request id ")[1].split(")")[0]
    assert any(request_id in rec.getMessage() and fault in rec.getMessage() for rec in caplog.records)


def test_a_failing_step_is_a_500_and_the_server_keeps_serving(client, faulty_runner, greedy, caplog):
    r = client.post("/v1/completions", json={"prompt": [MARK, 1, 2], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 500
    internal_error_logged(r.json()["error"]["message"], caplog, "injected fault at position 3")
    ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                              "ignore_eos": True})
    assert ok.status_code == 200
    assert greedy["choices"][0]["text"].startswith(ok.json()["choices"][0]["text"])


def test_a_step_failing_mid_stream_sends_an_error_chunk_then_done(client, faulty_runner, real_server, caplog):
    faulty_runner["from_decode"] = 2
    body = {"prompt": [MARK, 1, 2], "max_tokens": 8, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    internal_error_logged(events[-2]["error"]["message"], caplog, "injected fault at position 5")
    assert any("choices" in e for e in events[:-2])  # tokens came before the error
    wait_until(lambda: idle(real_server.built.engine), "the failed request's blocks to be freed")
    assert client.get("/health").status_code == 200


CHAT = [{"role": "user", "content": "Tell me about the river."}]


def test_a_step_failing_mid_chat_stream_sends_an_error_chunk_then_done_and_no_usage(client, faulty_runner,
                                                                                     real_server, caplog):
    ids = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert len(ids) <= real_settings().max_num_batched_tokens, "the fault needs a one-chunk prompt"
    faulty_runner["mark"] = ids[-1]  # no other request runs meanwhile
    faulty_runner["from_decode"] = 2
    # a salt of its own: the fault marks a prompt computed from position 0, never one found in
    # the prefix cache (another test of the session's server may have sent the same chat)
    body = {"messages": CHAT, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": "a-step-failing-mid-chat-stream"}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500
    internal_error_logged(events[-2]["error"]["message"], caplog, f"injected fault at position {len(ids) + 2}")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = events[1:-2]
    assert chunks and all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in chunks)
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks)
    wait_until(lambda: idle(real_server.built.engine), "the failed request's blocks to be freed")
    assert client.get("/health").status_code == 200


def test_a_chat_streaming_client_that_disconnects_frees_its_blocks(client, real_server):
    engine = real_server.built.engine
    aborted = engine.stats.finished.get("abort", 0)
    body = {"messages": CHAT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line)
        next(lines)  # the role chunk
        assert '"content"' in next(lines)  # a token: the request is running
    wait_until(lambda: engine.stats.finished.get("abort", 0) > aborted, "the chat stream to be aborted")
    wait_until(lambda: idle(engine), "the aborted chat stream's blocks to be freed")
