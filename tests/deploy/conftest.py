"""Fixtures of the deployment tests: replicas and nginx, stopped when the test ends."""

import pytest

from tests.deploy.procs import Nginx, Replica


@pytest.fixture
def replicas(tmp_path):
    """``start(n)`` -> n healthy replicas (started together); all stopped at the end."""
    started: list[Replica] = []

    def start(n: int) -> list[Replica]:
        new = [Replica(tmp_path, f"replica-{len(started) + i}") for i in range(n)]
        started.extend(new)
        return [r.wait() for r in new]

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def nginx(tmp_path):
    """``start(["127.0.0.1:PORT", ...])`` -> a running Nginx; stopped at the end."""
    started: list[Nginx] = []

    def start(upstreams: list[str]) -> Nginx:
        n = Nginx(tmp_path, upstreams)
        started.append(n)
        return n

    yield start
    for n in started:
        n.stop()
