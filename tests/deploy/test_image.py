"""The Docker image, without a Docker engine: the Dockerfile's own steps, run here.

The fixture repeats what `docker build` would do: the wheel stage's COPY lines into a fresh
build context, `pip wheel` there, the wheel installed with its dependencies into a fresh venv
(no torch), the warm-up RUN and then the CMD, both as a non-root user with the image's ENV
(container paths mapped into a temporary directory), a read-only model directory and a cache
directory only that user may write. The one change to the CMD: it listens on 127.0.0.1 at a
free port instead of 0.0.0.0:8000.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.deploy.dockerfile import parse
from tests.deploy.procs import REPO, VENV_BIN, free_port, stop, wait_healthy

DOCKERFILE = REPO / "Dockerfile"
NOBODY = 65534
CONTAINER_PATHS = {"/var/cache/spyre-serve": "cache", "/model": "model"}

pytestmark = pytest.mark.slow


def context_files() -> list[str]:
    """The files `docker build .` sends: the repository less .dockerignore (docker-py's rules)."""
    from docker.utils.build import exclude_paths

    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return sorted(p for p in exclude_paths(str(REPO), patterns) if (REPO / p).is_file())


def docker_context(dest: Path) -> Path:
    for name in context_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest


def _python311() -> str:
    """A Python 3.11 that a non-root user can run (pyenv's lives under /root)."""
    for cand in (sys._base_executable, "/usr/bin/python3.11", shutil.which("python3.11")):
        if cand and os.path.exists(cand):
            real = Path(os.path.realpath(cand))
            if os.geteuid() != 0 or all(p.stat().st_mode & stat.S_IXOTH for p in real.parents):
                return str(real)
    raise RuntimeError("no Python 3.11 that a non-root user can run (apt-get install python3.11-venv)")


def _as_user() -> dict:
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)


class Image:
    def __init__(self, base: Path):
        self.base = base
        stages = parse(DOCKERFILE)
        self.build_stage, self.final = stages[0], stages[-1]
        self.venv = base / "venv"
        self.log = base / "server.log"

    def build_wheel(self) -> Path:
        """The wheel stage: its COPY lines, from the context Docker would send, into /src."""
        context = docker_context(self.base / "docker-context")
        src = self.base / "src"
        for sources, dest in self.build_stage.copies():     # Docker's COPY rules
            into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            for name in sources:
                s = context / name
                assert s.exists(), f"COPY {name}: not in the build context (.dockerignore?)"
                if s.is_dir():          # a directory's contents go into dest
                    shutil.copytree(s, src / dest, dirs_exist_ok=True)
                else:
                    target = src / dest / s.name if into_dir else src / dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(s, target)
        wheels = self.base / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
                       check=True, cwd=self.base, capture_output=True, text=True)
        (wheel,) = wheels.glob("spyre_serve-*.whl")
        return wheel

    def install(self, wheel: Path) -> None:
        subprocess.run([_python311(), "-m", "venv", "--without-pip", str(self.venv)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(self.venv / "bin" / "python"),
                        "install", "-q", "--no-compile", str(wheel)],
                       check=True, capture_output=True, text=True, timeout=900)

    def env(self, port: int) -> dict[str, str]:
        env = {"PATH": f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
               "HOME": str(self.base / "home"), "LANG": "C.UTF-8"}
        for key, value in self.final.env().items():
            for container, local in CONTAINER_PATHS.items():
                if value == container or value.startswith(container + "/"):
                    value = str(self.base / local) + value[len(container):]
            env[key] = value
        env["SPYRE_SERVE_PORT"] = str(port)
        for passthrough in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):   # this machine's BLAS fix
            if passthrough in os.environ:
                env[passthrough] = os.environ[passthrough]
        return env

    def cmd(self) -> list[str]:
        cmd = self.final.cmd()
        return [("127.0.0.1" if a == "0.0.0.0" else a) for a in cmd]


@pytest.fixture(scope="module")
def image():
    base = Path(tempfile.mkdtemp(prefix="spyre-image-"))
    base.chmod(0o755)
    img = Image(base)
    try:
        img.install(img.build_wheel())
        # the model: an embedded profile written by the project, mounted read-only
        from spyre_serve.models import resolve_model

        shutil.copytree(resolve_model("granite-tiny"), base / "model")
        _read_only(base / "model")
        (base / "home").mkdir(mode=0o555)          # HOME not writable: nothing may write there
        (base / "cache").mkdir()
        if os.geteuid() == 0:
            os.chown(base / "cache", NOBODY, NOBODY)
        for shell_cmd in img.final.runs_after_user():   # the build-time warm-up
            r = subprocess.run(["/bin/sh", "-c", shell_cmd], env=img.env(free_port()),
                               cwd=base / "home", capture_output=True, text=True, timeout=900,
                               **_as_user())
            assert r.returncode == 0, f"RUN {shell_cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        img.warm_cache = _compiled(img)
        port = free_port()
        img.url = f"http://127.0.0.1:{port}"
        with open(img.log, "w") as log:
            img.proc = subprocess.Popen(img.cmd(), env=img.env(port), cwd=base / "home",
                                        stdout=log, stderr=subprocess.STDOUT, **_as_user())
        wait_healthy(img.url, img.proc, img.log)
        yield img
    finally:
        if getattr(img, "proc", None) is not None:
            stop(img.proc)
        for p in base.rglob("*"):      # the read-only parts, so they can be removed
            if not p.is_symlink():
                p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(base, ignore_errors=True)


def test_image_has_no_torch(image):
    r = subprocess.run([str(image.venv / "bin" / "python"), "-c",
                        "import importlib.util as u; print(u.find_spec('torch') is None)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True"


def _compiled(img: Image) -> set[str]:
    """The compiled entries (numba's *.nbc files) in the image's program cache."""
    numba_dir = Path(img.env(0)["NUMBA_CACHE_DIR"])
    return {str(p.relative_to(numba_dir)) for p in numba_dir.rglob("*.nbc")}


def test_build_time_warmup_filled_the_program_cache(image):
    assert image.warm_cache, "the warm-up RUN compiled nothing into NUMBA_CACHE_DIR"


def test_serving_compiles_nothing_the_warmup_did_not(image):
    for body in ({"prompt": "Hi", "max_tokens": 3, "logprobs": 2},
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(image.url + path, json={"model": _served_name(image), **body}, timeout=120)
        assert r.status_code == 200, r.text
    assert _compiled(image) == image.warm_cache


def _served_name(image) -> str:
    return httpx.get(image.url + "/v1/models", timeout=10).json()["data"][0]["id"]


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
