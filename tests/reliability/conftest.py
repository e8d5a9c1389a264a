"""Fixtures of this folder's tests; their helpers are in servers.py (tests import
helpers from there, never from a conftest)."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.servers import NORMAL, running_server


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def solo(http) -> str:
    """NORMAL's greedy text when it runs alone."""
    r = http.post("/v1/completions", json=NORMAL)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]
