"""Helpers of the torch "spyre" device tests: a fresh interpreter (`run_python`), and a gate
that holds a stream (`gate`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
