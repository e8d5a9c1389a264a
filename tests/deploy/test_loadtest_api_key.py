"""spyre-loadtest against a server that wants a bearer token (spyre-serve --api-key)."""

from __future__ import annotations

import json
import os

import pytest

from tests.deploy.procs import Replica, loadtest

KEY = "test-key-5"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    r = Replica(tmp_path_factory.mktemp("guarded"), "guarded", extra=["--api-key", KEY]).wait()
    yield r
    r.stop()


def _run(url, out, *extra, env_key=None):
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if env_key:
        env["OPENAI_API_KEY"] = env_key
    return loadtest("--base-url", url, "--model", "granite-tiny", "--num-prompts", "2",
                    "--concurrency", "2", "--input-len", "8", "--output-len", "2",
                    "--num-warmups", "0", "--result-file", str(out), *extra, env=env)


def test_key_from_the_environment_is_sent(guarded, tmp_path):
    proc = _run(guarded.url, tmp_path / "r.json", env_key=KEY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["points"][0]["metrics"]["completed"] == 2


def test_key_from_the_flag_is_sent_and_kept_out_of_the_result(guarded, tmp_path):
    proc = _run(guarded.url, tmp_path / "r.json", "--api-key", KEY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert KEY not in (tmp_path / "r.json").read_text()


def test_requests_without_the_key_fail_with_401(guarded, tmp_path):
    proc = _run(guarded.url, tmp_path / "r.json")
    assert proc.returncode == 1
    p = json.loads((tmp_path / "r.json").read_text())["points"][0]
    assert p["metrics"]["failed"] == 2 and all(e.startswith("HTTP 401") for e in p["errors"])


def test_model_lookup_refused_is_a_clear_error(guarded, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = loadtest("--base-url", guarded.url, "--num-prompts", "1", "--num-warmups", "0",
                    env=env)
    assert proc.returncode == 2
    assert "HTTP 401" in proc.stderr and "--api-key" in proc.stderr
    assert "Traceback" not in proc.stderr
