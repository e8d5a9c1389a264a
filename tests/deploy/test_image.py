"""The Docker image, without a Docker engine: the Dockerfile's own steps, run here.

The image is built by tests/deploy/image.py (wheel, venv, read-only model, the warm-up RUN as
a non-root user), in the background while the rest of the suite runs: its warm-up compiles
every step program into an empty cache, minutes of one core (tests/background.py). The
fixture then starts the CMD as that user, with one change: it listens on 127.0.0.1 at a free
port instead of 0.0.0.0:8000.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import background
from tests.deploy.dockerfile import parse
from tests.deploy.image import DOCKERFILE, NOBODY, Image, as_user, context_files
from tests.deploy.procs import REPO, VENV_BIN, free_port, stop, wait_healthy

pytestmark = pytest.mark.slow


@background.job("image-build")
def _build(scratch: str) -> background.Job:
    return background.Job([[sys.executable, "-m", "tests.deploy.image", scratch]],
                          env={**os.environ}, cwd=str(REPO), seconds=220)


@pytest.fixture(scope="module")
def image():
    (built,) = background.result("image-build")
    img = Image(background.scratch("image-build"))
    try:
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
        img.warm_cache = img.compiled()
        port = free_port()
        img.url = f"http://127.0.0.1:{port}"
        with open(img.log, "w") as log:
            img.proc = subprocess.Popen(img.cmd(), env=img.env(port), cwd=img.base / "home",
                                        stdout=log, stderr=subprocess.STDOUT, **as_user())
        wait_healthy(img.url, img.proc, img.log)
        yield img
    finally:
        if getattr(img, "proc", None) is not None:
            stop(img.proc)
        img.unlock()


@pytest.mark.background("image-build")
def test_image_has_no_torch(image):
    r = subprocess.run([str(image.venv / "bin" / "python"), "-c",
                        "import importlib.util as u; print(u.find_spec('torch') is None)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True"


@pytest.mark.background("image-build")
def test_build_time_warmup_filled_the_program_cache(image):
    assert image.warm_cache, "the warm-up RUN compiled nothing into NUMBA_CACHE_DIR"


@pytest.mark.background("image-build")
def test_serving_compiles_nothing_the_warmup_did_not(image):
    for body in ({"prompt": "Hi", "max_tokens": 3, "logprobs": 2},
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(image.url + path, json={"model": _served_name(image), **body}, timeout=120)
        assert r.status_code == 200, r.text
    assert image.compiled() == image.warm_cache


def _served_name(image) -> str:
    return httpx.get(image.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.background("image-build")
def test_cmd_serves_a_completion_as_non_root_from_a_read_only_model(image):
    r = httpx.post(image.url + "/v1/completions",
                   json={"model": _served_name(image), "prompt": "Hello", "max_tokens": 5, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    if os.geteuid() == 0:
        assert _uid_of(image.proc.pid) == NOBODY


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


@pytest.mark.background("image-build")
def test_healthcheck_command_passes(image):
    (hc,) = image.final.args("HEALTHCHECK")
    cmd = json.loads(hc[hc.index("CMD") + 3:].strip())
    port = image.url.rsplit(":", 1)[1]
    env = image.env(int(port))
    cmd[0] = str(image.venv / "bin" / cmd[0]) if cmd[0] == "python" else cmd[0]
    assert subprocess.run(cmd, env=env, timeout=30).returncode == 0


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(VENV_BIN / "hadolint")
    r = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_user_is_numeric_and_not_root():
    (user,) = parse(DOCKERFILE)[-1].args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_build_context_holds_only_what_the_image_copies():
    copied = [src.rstrip("/") for sources, _ in parse(DOCKERFILE)[0].copies() for src in sources]
    for name in context_files():
        assert name in ("Dockerfile", ".dockerignore") or any(
            name == c or name.startswith(c + "/") for c in copied), name
