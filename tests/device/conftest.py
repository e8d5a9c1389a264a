import pytest

from spyre_serve.device import Card


@pytest.fixture
def card():
    c = Card(memory_bytes=1 << 22)  # 4 MiB: small tests, quick to create
    yield c
    c.close()
