"""status.py: /v1/models, /health, /metrics."""

from __future__ import annotations

from tests.server.openai.fakes import ScriptedEngine, client_for


def test_models_lists_the_served_model_its_root_and_context_length():
    data = client_for(served_model_name="granite").get("/v1/models").json()["data"]
    assert len(data) == 1
    m = data[0]
    assert (m["id"], m["object"], m["root"], m["max_model_len"], m["parent"]) == ("granite", "model", "/models/tiny",
                                                                                   64, None)


def test_health_is_a_200_with_the_offload_pool_while_the_engine_runs():
    r = client_for().get("/health")
    assert r.status_code == 200
    assert r.json() == {"offload": {"workers": 4, "busy": 0, "waiting": 0, "refused": 0}}


def test_health_is_a_503_that_keeps_the_engines_error_to_the_log():
    engine = ScriptedEngine()
    engine.alive, engine.error = False, RuntimeError("device fault")
    r = client_for(engine).get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "the engine loop is not running (the server's log says why)"
    assert "RuntimeError" not in r.text and "device fault" not in r.text


def test_health_is_a_503_with_retry_after_while_draining():
    engine = ScriptedEngine()
    engine.accepting = False
    r = client_for(engine).get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


class Rendered:
    async def render_async(self):    # an API process's metrics ask the engine's: async
        return b"# metrics\n", "text/plain; version=0.0.4"


def test_metrics_are_what_the_metrics_render():
    r = client_for(metrics=Rendered()).get("/metrics")
    assert r.content == b"# metrics\n" and r.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_metrics_are_empty_without_metrics():
    r = client_for().get("/metrics")
    assert r.status_code == 200 and r.content == b""


def test_an_api_process_metrics_say_the_engine_is_down_when_its_process_does_not_answer():
    import asyncio

    from spyre_serve.server.metrics import ApiMetrics

    class Silent:           # an EngineProcessClient whose engine process is gone
        async def metrics_text(self):
            return b""

    class Pool:
        def stats(self):
            return {"workers": 4, "busy": 1, "waiting": 0, "refused": 2}

    metrics = ApiMetrics(Silent(), "m")
    metrics.watch_offload(Pool())
    text = asyncio.run(metrics.render_async())[0].decode()
    assert 'spyre_engine_alive{model_name="m"} 0.0' in text
    assert 'spyre_api_offload_busy{model_name="m"} 1.0' in text
    assert 'spyre_api_offload_refused_total{model_name="m"} 2.0' in text
