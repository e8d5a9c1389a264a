"""Bad input gets its status and an OpenAI-shaped error with the numbers; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from spyre_serve.server.engine.core import Engine
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.app import create_app
from tests.server.servers import PROMPT, ServerThread


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


def post(client, **body):
    body.setdefault("prompt", "Hello")
    body.setdefault("max_tokens", 1)
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", -1.0, "temperature must be in [0, 2], got -1.0"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", 2.5, "got 2.5"),
        ("logprobs", 21, "logprobs must be between 0 and 20, got 21"),
        ("max_tokens", -1, "max_tokens must be >= 0, got -1"),
        ("min_p", 2.0, "min_p must be in [0, 1], got 2.0"),
        ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2], got 3.0"),
    ],
)
def test_an_invalid_sampling_value_is_a_400_naming_the_field_and_value(client, field, value, needle):
    err = error_of(post(client, **{field: value}), 400)
    assert err["param"] == field
    assert needle in err["message"]


def test_n_over_the_limit_is_a_400_with_the_limit(client):
    err = error_of(post(client, n=5), 400)
    assert err["param"] == "n" and "n must be at most 4, got 5" in err["message"]


def test_a_prompt_too_long_for_the_context_is_a_400_with_the_numbers(client):
    err = error_of(post(client, prompt=[5] * 1000, max_tokens=100), 400)
    assert "maximum context length is 1024 tokens" in err["message"]
    assert "1100 tokens (1000 in the prompt, 100 for the completion)" in err["message"]


def test_a_token_id_outside_the_vocabulary_is_a_400(client):
    err = error_of(post(client, prompt=[1, 99999]), 400)
    assert "token id 99999 is outside the vocabulary (0..8191)" in err["message"]


def test_an_unknown_model_is_a_404(client):
    err = error_of(post(client, model="gpt-17"), 404)
    assert "gpt-17" in err["message"] and err["param"] == "model"


def test_a_body_over_the_size_limit_is_a_413(client):
    err = error_of(post(client, prompt="a " * 600_000), 413)
    assert "over the limit of 1048576 bytes" in err["message"]


def test_a_body_that_is_not_json_is_a_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(r, 400)["message"]


def test_a_missing_prompt_is_a_400(client):
    err = error_of(client.post("/v1/completions", json={"max_tokens": 1}), 400)
    assert err["param"] == "prompt"


def test_chat_with_top_logprobs_but_no_logprobs_is_a_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "top_logprobs": 2})
    assert error_of(r, 400)["param"] == "top_logprobs"


def test_the_server_keeps_serving_after_bad_requests(client, greedy):
    for _ in range(3):
        error_of(post(client, temperature=-5), 400)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200
    assert greedy["choices"][0]["text"].startswith(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def side_app(real_server):
    """A second app over the same engine, with other server settings."""
    built = real_server.built
    servers = []

    def make(engine=None, **settings):
        app = create_app(engine or built.engine, built.model, Settings(**settings))
        server = ServerThread(app).__enter__()
        servers.append(server)
        return httpx.Client(base_url=server.url, timeout=600)

    yield make
    for s in servers:
        s.__exit__(None, None, None)


def test_a_wrong_api_key_is_a_401_and_health_stays_open(side_app):
    c = side_app(api_key="sesame")
    error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                    headers={"Authorization": "Bearer wrong"}), 401)
    error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 401)
    error_of(c.get("/v1/models"), 401)
    assert c.get("/health").status_code == 200
    ok = c.get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200


class Backlogged:
    """The real engine, with ``waiting`` sequences more in its queue than it has."""

    def __init__(self, engine, waiting: int) -> None:
        self._engine, self._waiting = engine, waiting

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def num_waiting_sequences(self) -> int:
        return self._engine.num_waiting_sequences + self._waiting


def test_a_full_waiting_queue_is_a_503_with_retry_after_counting_sequences(side_app, real_server):
    c = side_app(engine=Backlogged(real_server.built.engine, 3), max_waiting=4)
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2})
    err = error_of(r, 503)
    assert r.headers["retry-after"] == "1"
    assert err["message"] == ("the waiting queue is full: 3 sequences waiting, this request adds 2, the limit is 4 "
                              "(--max-waiting)")
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_full_queue_refuses_before_the_body_is_read(side_app, real_server):
    """With no room for even one sequence, a generation is refused (503) before its body is
    read or parsed: a body that is not even JSON gets the 503, not a 400."""
    c = side_app(engine=Backlogged(real_server.built.engine, 4), max_waiting=4)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = c.post(path, content=b"{not json" + b" " * 100_000, headers={"content-type": "application/json"})
        assert "waiting queue is full" in error_of(r, 503)["message"] and r.headers["retry-after"] == "1"


def test_a_request_with_more_sequences_than_the_queue_holds_is_a_400(side_app):
    c = side_app(max_waiting=3)
    err = error_of(c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "n": 2}), 400)
    assert err["message"] == ("this request asks for 4 sequences (2 prompts x n = 2), more than the 3 the waiting "
                              "queue holds (--max-waiting)")


def test_health_is_503_when_the_engine_loop_is_not_running(side_app, real_server):
    built = real_server.built
    stopped = Engine(built.runner, built.model.tokenizer, max_num_seqs=4, max_num_batched_tokens=64)
    c = side_app(engine=stopped)
    assert "engine loop is not running" in error_of(c.get("/health"), 503)["message"]
    error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 503)


def test_metrics_and_docs_are_open_by_default_and_behind_the_key_when_asked(side_app):
    open_ = side_app(api_key="sesame")
    for path in ("/metrics", "/openapi.json", "/docs", "/health"):
        assert open_.get(path).status_code == 200, path
    guarded = side_app(api_key="sesame", guard_metrics_and_docs=True)
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        error_of(guarded.get(path), 401)
        error_of(guarded.get(path, headers={"Authorization": "Bearer wrong"}), 401)
        assert guarded.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200, path
    assert guarded.get("/health").status_code == 200 and guarded.get("/version").status_code == 200


def test_an_empty_api_key_is_refused_at_start_and_a_set_one_never_shown(monkeypatch, capsys):
    from spyre_serve.server.launch.cli import parse_args

    for empty in ("", "  "):
        monkeypatch.setenv("SPYRE_SERVE_API_KEY", empty)
        with pytest.raises(SystemExit):
            parse_args(["serve"])
        assert "--api-key is empty" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            parse_args(["serve", "--api-key", empty])
    monkeypatch.setenv("SPYRE_SERVE_API_KEY", "s3cret-from-env")
    assert parse_args(["serve"]).api_key == "s3cret-from-env"
    assert parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    assert "s3cret-from-env" not in capsys.readouterr().out


def test_scoring_more_prompt_tokens_than_the_cap_is_a_400_naming_the_flag(side_app):
    c = side_app(max_scored_prompt_tokens=40)
    prompt = [[7] * 15, [8] * 15]                     # 30 tokens: fits once, not with n = 2
    ok = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    assert ok.status_code == 200, ok.text
    for extra in ({"prompt_logprobs": 1, "n": 2}, {"echo": True, "logprobs": 1, "n": 2}):
        err = error_of(c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra}), 400)
        assert "--max-scored-prompt-tokens" in err["message"] and "60 prompt tokens" in err["message"]
    plain = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "n": 2})
    assert plain.status_code == 200, plain.text      # no scoring asked: no cap


def test_with_every_render_thread_busy_a_request_gets_503_after_the_wait_and_health_says_why(side_app):
    """Four chats whose template renders for seconds hold the four threads; a fifth request
    waits --offload-wait, then gets 503 + Retry-After (it does not queue without bound),
    while /health answers at once and shows the pool busy."""
    import concurrent.futures
    import time

    slow = "{% for i in range(1000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    c = side_app(chat_template=slow, offload_wait=0.3, render_timeout=60)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(c.post, "/v1/chat/completions", json=chat) for _ in range(4)]
        deadline = time.monotonic() + 30
        while c.get("/health").json()["offload"]["busy"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        r = c.post("/tokenize", json={"prompt": "hello"})
        waited = time.monotonic() - t0
        err = error_of(r, 503)
        assert "--offload-wait" in err["message"] and r.headers["retry-after"] == "1"
        assert 0.25 < waited < 5
        t0 = time.monotonic()
        health = c.get("/health")
        assert health.status_code == 200 and time.monotonic() - t0 < 1
        assert health.json()["offload"]["busy"] == 4 and health.json()["offload"]["refused"] >= 1
        for f in busy:
            assert f.result().status_code == 200
    assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200


def test_past_limit_concurrency_a_new_connection_gets_503_before_any_work(real_server):
    """The serve command's uvicorn configuration caps open connections (--limit-concurrency,
    uvicorn's; a connection counts itself): two connections held open and idle, as a slow
    client holds them, and a third one's request is refused at once; once they close, it
    is served."""
    import socket
    import time

    from spyre_serve.server.launch.cli import uvicorn_config

    s = Settings(limit_concurrency=3, log_level="warning")
    app = real_server.built.app
    with ServerThread(app, uvicorn_config(app, s)) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        time.sleep(0.2)
        t0 = time.monotonic()
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 503
        assert time.monotonic() - t0 < 2
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200


def test_schemas_and_tools_over_their_caps_are_400s_naming_the_flag(side_app):
    c = side_app(max_schema_bytes=2000, max_tools=3, max_tools_bytes=1500)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}},
                         "response_format"),
                        ({"guided_json": big}, "guided_json"), ({"guided_json": json.dumps(big)}, "guided_json"),
                        ({"structured_outputs": {"json": big}}, "structured_outputs")]:
        err = error_of(c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **body}), 400)
        assert err["param"] == param and "--max-schema-bytes" in err["message"], err
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    many = [{**fn, "function": {**fn["function"], "name": f"f{i}"}} for i in range(4)]
    err = error_of(c.post("/v1/chat/completions", json={"messages": msgs, "tools": many}), 400)
    assert "--max-tools)" in err["message"] and err["param"] == "tools"
    wide = [{**fn, "function": {**fn["function"], "description": "d" * 2000}}]
    err = error_of(c.post("/v1/chat/completions", json={"messages": msgs, "tools": wide}), 400)
    assert "--max-tools-bytes" in err["message"]
    small = {"type": "object", "properties": {"a": {"type": "string"}}}
    ok = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "guided_json": small,
                                              "tools": many[:3]})
    assert ok.status_code == 200, ok.text
    bad = c.post("/v1/chat/completions", json={"messages": msgs, "guided_json": {"type": 3}})
    assert "guided_json is not a valid JSON schema" in error_of(bad, 400)["message"]   # checked off the loop


def test_a_stream_whose_client_stops_reading_is_aborted_and_frees_its_blocks(real_server):
    """A client that sends a streaming request and never reads: once the sockets' buffers
    are full (kept small here: 4 KiB each way) and the events have gone unread for
    --stream-send-timeout, the request is aborted (its blocks freed, generation stopped)
    instead of running to max_tokens into a queue."""
    import socket
    import time

    built = real_server.built
    engine = built.engine
    app = create_app(engine, built.model, Settings(stream_send_timeout=0.5))
    server = ServerThread(app)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # accepted sockets inherit it
    body = json.dumps({"prompt": PROMPT, "max_tokens": 900, "n": 4, "logprobs": 5, "stream": True,
                       "ignore_eos": True}).encode()
    aborted, steps = engine.stats.finished.get("abort", 0), engine.stats.steps
    with server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            deadline = time.monotonic() + 60
            while engine.num_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_requests == 1
            while engine.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.stats.finished.get("abort", 0) == aborted + 1   # long before max_tokens
            assert engine.stats.steps - steps < 500
            while engine.blocks.num_used and time.monotonic() < deadline:   # freed once the step
                time.sleep(0.05)                                              # in flight is read
            assert engine.num_requests == 0 and engine.blocks.num_used == 0
        finally:
            sock.close()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_text_too_long_for_the_context_whatever_its_tokens_is_refused_before_tokenizing(side_app, real_server):
    """More characters than max_model_len tokens of the vocabulary's longest could hold: a 400
    at once (no rendering or tokenizing of megabytes), unless the request truncates."""
    import time

    c = side_app()
    longest = real_server.built.app.state.serving.longest_token
    n = real_server.built.engine.max_model_len * longest + 1
    t0 = time.monotonic()
    err = error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * n}]}), 400)
    assert err["param"] == "messages" and f"{n} characters" in err["message"]
    err = error_of(c.post("/v1/completions", json={"prompt": ["ok", "b" * n], "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "over the model's context" in err["message"]
    assert time.monotonic() - t0 < 2
    ok = c.post("/v1/completions", json={"prompt": "c " * 3000, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert ok.status_code == 200, ok.text


def test_with_strict_request_fields_an_unknown_field_is_a_400_naming_it(side_app):
    c = side_app(strict_request_fields=True)
    err = error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "no_such_field": 1}), 400)
    assert err["param"] == "no_such_field" and "does not know the field `no_such_field`" in err["message"]
    err = error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "extra": 1}],
                                                         "max_tokens": 1}), 400)
    assert "does not know the field `extra`" in err["message"]
    # a field it knows at its neutral value passes either way
    ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                               "no_stop_trim": False, "include_reasoning": True})
    assert ok.status_code == 200, ok.text
