"""Fixtures of the torch "spyre" device tests (their helpers: processes.py).

The device is one process-wide card (made by the first spyre tensor); tests share it. Ops
tests run with the CPU fallback off (`on_card`), so an op that silently left the card fails.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def on_card():
    """The CPU fallback off for the test: every op must run on the card."""
    torch.spyre.set_cpu_fallback(False)
    yield
    torch.spyre.set_cpu_fallback(True)


@pytest.fixture
def fallbacks():
    """The fallback counts, reset before the test."""
    torch.spyre.reset_fallback_counts()
    yield torch.spyre.fallback_counts
    torch.spyre.reset_fallback_counts()
