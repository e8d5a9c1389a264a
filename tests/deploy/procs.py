"""Real processes on 127.0.0.1 for the deployment tests: spyre-serve replicas and nginx.

Every process is started with a bounded wait for readiness and stopped by its own pid
when its test ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from spyre_serve.deploy import fleet
from spyre_serve.deploy.loadtest.prefix_groups import scrape as metrics  # noqa: F401  (a server's /metrics)

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
START_TIMEOUT = 480.0   # a first start compiles the programs (cached on disk afterwards)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT):
    fleet.wait_healthy(url, proc, timeout, log)


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def server_args(port: int) -> list[str]:
    """A small spyre-serve on 127.0.0.1: granite-tiny, few step buckets, a small card.

    Started as ``python -m server.launch.cli`` from the repository, which is what the
    ``spyre-serve`` command runs, independent of how the venv installed the package.
    """
    return [sys.executable, "-m", "spyre_serve.server.launch.cli", "serve", "--model", "granite-tiny",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8",
            "--max-num-batched-tokens", "128", "--device-memory", "1G"]


class Replica:
    def __init__(self, tmp: Path, name: str, extra: list[str] = (), env: dict | None = None,
                 **popen):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen([*server_args(self.port), *extra], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO, **popen)

    def wait(self):
        wait_healthy(self.url, self.proc, self.log)
        return self

    def stop(self) -> int:
        code = stop(self.proc)
        self._log.close()
        return code


class Nginx:
    """deploy/nginx/nginx.conf, byte for byte, with this test's upstreams and port."""

    def __init__(self, tmp: Path, upstreams: list[str]):
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.prefix = tmp / "nginx"
        conf = self.prefix / "conf"
        conf.mkdir(parents=True)
        shutil.copyfile(NGINX_CONF, conf / "nginx.conf")
        (conf / "upstreams.conf").write_text(
            "".join(f"server {u} max_fails=1 fail_timeout=10s;\n" for u in upstreams))
        self.port = free_port()
        (conf / "listen.conf").write_text(f"listen 127.0.0.1:{self.port};\n")
        self.url = f"http://127.0.0.1:{self.port}"
        self.access_log = self.prefix / "access.log"
        self.error_log = self.prefix / "error.log"
        user = "user root;" if os.geteuid() == 0 else ""
        self._out = open(self.access_log, "w")
        self._err = open(self.error_log, "w")
        self.proc = subprocess.Popen(
            [nginx, "-p", f"{self.prefix}/", "-c", str(conf / "nginx.conf"), "-e", "stderr",
             "-g", f"daemon off; {user}"], stdout=self._out, stderr=self._err)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.error_log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"nginx not listening after 30 s: {self.error_log.read_text()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)   # graceful: finish open requests
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        self._err.close()

    def log_lines(self) -> list[dict]:
        """The access log (format "replicas" in nginx.conf) as dicts."""
        import shlex

        rows = []
        for line in self.access_log.read_text().splitlines():
            parts = shlex.split(line)
            fields = dict(p.split("=", 1) for p in parts[4:])
            rows.append({"msec": float(parts[0]), "request_time": float(parts[1]),
                         "request": parts[2], "status": int(parts[3]),
                         "upstreams": _tries(fields["upstream"]),
                         "upstream_status": _tries(fields["upstream_status"])})
        return rows


def _tries(field: str) -> list[str]:
    """One entry per upstream try: nginx separates them with ", " within one location and
    with " : " across an internal redirect (error_page to @turned_away)."""
    return [a.strip() for group in field.split(" : ") for a in group.split(",")]


def total(m: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def loadtest(*args: str, timeout: float = 300.0, **popen) -> subprocess.CompletedProcess:
    """Run ``python -m deploy.loadtest`` (the spyre-loadtest command) to completion."""
    return subprocess.run([sys.executable, "-m", "spyre_serve.deploy.loadtest", "--disable-tqdm", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, **popen)
