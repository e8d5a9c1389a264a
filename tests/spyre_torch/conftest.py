"""Shared helpers for the torch "spyre" device tests.

The device is one process-wide card (made by the first spyre tensor); tests share it. Ops
tests run with the CPU fallback off (`on_card`), so an op that silently left the card fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


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


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this venv (registration and autoload tests)."""
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=timeout)


def gate(stream) -> threading.Event:
    """Hold a torch.spyre.Stream until the returned event is set (a waiting command on the
    card's stream): work enqueued after it stays queued."""
    opened = threading.Event()
    stream._stream.enqueue(opened.wait, compute=False)
    return opened
