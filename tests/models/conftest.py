"""Fixtures of this folder's tests; their helpers are in checkpoints.py (tests import
helpers from there, never from a conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.hf_checkpoints import write_granite_checkpoint


@pytest.fixture(scope="session")
def small_granite_dir(tmp_path_factory) -> Path:
    """A tied 128-wide, 2-layer Granite checkpoint in float32 (vocab 256)."""
    return write_granite_checkpoint(tmp_path_factory.mktemp("small_granite"))
