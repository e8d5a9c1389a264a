"""Fixtures of this folder's tests; their helpers are in servers.py (tests import
helpers from there, never from a conftest)."""

from __future__ import annotations

import pytest

from tests.server.servers import POOLING_CONTEXT, PROMPT, ServerThread, http_client, real_settings


@pytest.fixture(scope="session")
def real_server():
    """The real stack (granite-tiny, ModelRunner, Engine, FastAPI) behind uvicorn, once per session."""
    from spyre_serve.server.launch.cli import build

    built = build(real_settings(), progress=False)
    with ServerThread(built.app) as server:
        server.built = built
        yield server
    built.engine.shutdown()


@pytest.fixture(scope="session")
def client(real_server):
    yield from http_client(real_server)


@pytest.fixture(scope="session")
def greedy(client):
    """The greedy completion of PROMPT (12 tokens, logprobs=1): the reference other tests cut."""
    r = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(set(body["choices"][0]["logprobs"]["tokens"])) > 6, "granite-tiny's greedy output should vary"
    return body


@pytest.fixture(scope="session")
def pooling_server():
    """granite-tiny served with --runner pooling (embeddings and scores), once per session."""
    from spyre_serve.server.launch.cli import build

    built = build(real_settings(runner="pooling", max_num_batched_tokens=POOLING_CONTEXT, max_num_seqs=8,
                                max_model_len=None),
                  progress=False)
    with ServerThread(built.app) as server:
        server.built = built
        yield server
    built.engine.shutdown()
