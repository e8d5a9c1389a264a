"""app.py: the routes wired, the API key on all but /health and /metrics, the handlers on."""

from __future__ import annotations

import pytest

from tests.server.openai.fakes import ScriptedEngine, client_for

GUARDED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "a"}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
           ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]})]


@pytest.fixture(scope="module")
def locked():
    return client_for(api_key="sesame")


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_every_api_route_wants_the_key(locked, method, path, body):
    assert locked.request(method, path, json=body).status_code == 401
    assert locked.request(method, path, json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/ping", "/version"])
def test_health_and_metrics_need_no_key(locked, path):
    assert locked.get(path).status_code == 200


def test_without_a_key_the_api_is_open():
    assert client_for().get("/v1/models").status_code == 200


class Broken(ScriptedEngine):
    def add_request(self, *args) -> None:
        raise KeyError("lost")


def test_an_unexpected_failure_is_an_openai_shaped_500():
    r = client_for(Broken(), raise_server_exceptions=False).post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("internal error (request id ")
    assert "KeyError" not in r.text and "lost" not in r.text
