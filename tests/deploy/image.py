"""The Docker image's build, without a Docker engine: the Dockerfile's own steps, run here.

``Image.build`` repeats what `docker build` would do: the wheel stage's COPY lines into a fresh
build context, `pip wheel` there, the wheel installed with its dependencies into a fresh venv
(no torch), a read-only model directory, a cache directory only the image's user may write,
and the warm-up RUN as that non-root user with the image's ENV (container paths mapped into
the base folder). ``python -m tests.deploy.image BASE`` builds into BASE: the image test runs
it in the background while the rest of the suite runs (tests/background.py), then starts the
CMD itself.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from tests.deploy.dockerfile import parse
from tests.deploy.procs import REPO, free_port

DOCKERFILE = REPO / "Dockerfile"
NOBODY = 65534
CONTAINER_PATHS = {"/var/cache/spyre-serve": "cache", "/model": "model"}


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


def as_user() -> dict:
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


def read_only(path: Path) -> None:
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
                       check=True, capture_output=True, text=True, timeout=2400)

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

    def build(self) -> None:
        """Everything before the CMD: wheel, venv, model, cache, the build-time warm-up."""
        self.base.chmod(0o755)
        self.install(self.build_wheel())
        # the model: an embedded profile written by the project, mounted read-only
        from spyre_serve.models import resolve_model

        shutil.copytree(resolve_model("granite-tiny"), self.base / "model")
        read_only(self.base / "model")
        (self.base / "home").mkdir(mode=0o555)          # HOME not writable: nothing may write there
        (self.base / "cache").mkdir()
        if os.geteuid() == 0:
            os.chown(self.base / "cache", NOBODY, NOBODY)
        for shell_cmd in self.final.runs_after_user():   # the build-time warm-up
            r = subprocess.run(["/bin/sh", "-c", shell_cmd], env=self.env(free_port()),
                               cwd=self.base / "home", capture_output=True, text=True, timeout=2400,
                               **as_user())
            if r.returncode != 0:
                raise SystemExit(f"RUN {shell_cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")

    def compiled(self) -> set[str]:
        """The compiled entries (numba's *.nbc files) in the image's program cache."""
        numba_dir = Path(self.env(0)["NUMBA_CACHE_DIR"])
        return {str(p.relative_to(numba_dir)) for p in numba_dir.rglob("*.nbc")}

    def unlock(self) -> None:
        """Make the read-only parts writable again, so the folder can be removed."""
        for p in self.base.rglob("*"):
            if not p.is_symlink():
                p.chmod(0o755 if p.is_dir() else 0o644)


if __name__ == "__main__":
    Image(Path(sys.argv[1])).build()
