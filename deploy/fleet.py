"""``spyre-fleet``: N spyre-serve replicas behind vllm-router on one machine, without Docker.

    spyre-fleet --replicas 3 --port 8000 -- --model granite-tiny --max-num-seqs 16

starts each replica (``spyre-serve serve`` with the arguments after ``--``) on 127.0.0.1 at
the ports after ``--port``, then vllm-router on ``--host``:``--port`` in front of them with
the policy and thresholds of ``ROUTER_FLAGS``. A replica that exits while the fleet runs is
started again on its port (as compose's ``restart: unless-stopped`` does), and the router
takes it back once its /health answers. SIGTERM or SIGINT stops the router first (no new
requests), then the replicas (each drains its running requests), and exits.

The router is the ``vllm-router`` package from the registry, kept out of the server's own
environment: ``make router`` installs the version ``deploy/router/requirements.txt`` pins into
``.venv-router/``; ``--router`` or ``SPYRE_FLEET_ROUTER`` names another.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger("spyre_fleet")

REPO = Path(__file__).resolve().parents[1]
# cache_aware: a request goes to the replica whose cache already holds most of its prompt's
# tokens (vllm-router asks a replica's /v1/completions/render for them) when at least
# --cache-threshold of them match, else to the replica holding the least. The balance
# thresholds switch it to the least loaded replica once the most loaded holds more than 8
# requests over it and 1.5x its load: vllm-router's defaults (64 and 1.5) never switch at a
# small fleet's loads, so one busy prefix could hold a replica while others idle. Health: a
# replica is checked every 5 s; two failed sends to it open its circuit (no requests for 10 s,
# then one to try it), so a request whose prefix points at a replica that died is retried on
# another (vllm-router's defaults, 10 failures and 60 s, spent a request's 5 retries on the
# dead replica and answered 500; a restarted replica waited a minute for traffic).
# docs/deployment.md has the measurements behind them (benchmarks/fleet.py).
ROUTER_FLAGS = ["--policy", "cache_aware", "--cache-threshold", "0.3", "--balance-abs-threshold", "8",
                "--balance-rel-threshold", "1.5", "--health-check-interval-secs", "5",
                "--health-check-endpoint", "/health", "--cb-failure-threshold", "2",
                "--cb-timeout-duration-secs", "10", "--worker-startup-timeout-secs", "900",
                "--worker-startup-check-interval", "2"]
RESTART_PAUSE = 2.0   # seconds between a replica's exit and its restart


def router_command() -> str:
    """The vllm-router to run: ``SPYRE_FLEET_ROUTER``, else ``.venv-router/`` beside this
    repository (``make router``), else ``vllm-router`` on the PATH."""
    for candidate in (os.environ.get("SPYRE_FLEET_ROUTER"), REPO / ".venv-router" / "bin" / "vllm-router",
                      shutil.which("vllm-router")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise SystemExit("spyre-fleet: no vllm-router found: run `make router` (it installs the pinned "
                     "vllm-router into .venv-router/), or give --router PATH")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path | None = None) -> None:
    """Until ``url``/health answers 200; RuntimeError (with the end of ``log``) when ``proc`` exits
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log is not None else ""
    raise RuntimeError(f"{url} not healthy after {timeout:g} s:\n{tail}")


@dataclass
class Replica:
    """One spyre-serve process on 127.0.0.1:``port``, started again when it exits."""

    port: int
    args: list[str]
    log_dir: Path | None
    cores: list[int] | None = None      # the CPUs it may run on (--cores-per-replica), None: all
    proc: subprocess.Popen | None = None
    restarts: int = 0
    _out: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self._out is not None:
            self._out.close()          # a restart: the log is opened again, appended to
        if self.log_dir is not None:
            self._out = open(self.log_dir / f"replica-{self.port}.log", "a")
        command = [sys.executable, "-m", "spyre_serve.server.launch.cli", "serve", *self.args,
                   "--host", "127.0.0.1", "--port", str(self.port)]
        env, pin = None, None
        if self.cores is not None:
            env = {**os.environ, "NUMBA_NUM_THREADS": str(len(self.cores))}
            cores = set(self.cores)

            def pin():
                os.sched_setaffinity(0, cores)
        self.proc = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT if self._out else None,
                                     env=env, preexec_fn=pin)

    def stop(self, timeout: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    def __init__(self, replicas: list[Replica], router: list[str], log_dir: Path | None) -> None:
        self.replicas, self.router_command, self.log_dir = replicas, router, log_dir
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        out = open(self.log_dir / "router.log", "a") if self.log_dir is not None else None
        self.router = subprocess.Popen(self.router_command, stdout=out, stderr=subprocess.STDOUT if out else None)
        log.info("router pid %d in front of %s", self.router.pid, ", ".join(r.url for r in self.replicas))

    def watch(self) -> int:
        """Until asked to stop: a replica that exited is started again; the router exiting ends
        the fleet with its code."""
        while not self.stopping.wait(0.5):
            if self.router.poll() is not None:
                log.error("the router exited with %s; stopping the replicas", self.router.returncode)
                self.stop_replicas()
                return self.router.returncode or 1
            for r in self.replicas:
                if r.proc.poll() is not None and not self.stopping.is_set():
                    log.warning("replica %s exited with %s; starting it again", r.url, r.proc.returncode)
                    time.sleep(RESTART_PAUSE)
                    r.restarts += 1
                    r.start()
        return 0

    def stop(self, drain_timeout: float) -> None:
        self.stopping.set()
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        self.stop_replicas(drain_timeout)

    def stop_replicas(self, drain_timeout: float = 60.0) -> None:
        threads = [threading.Thread(target=r.stop, args=(drain_timeout,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def cores_of(i: int, per_replica: int) -> list[int] | None:
    """Replica ``i``'s cores: the next ``per_replica`` of the ones this process may use, in turn
    (wrapping round when the replicas want more than there are); None for 0."""
    if per_replica <= 0:
        return None
    mine = sorted(os.sched_getaffinity(0))
    return [mine[(i * per_replica + k) % len(mine)] for k in range(per_replica)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="spyre-fleet", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every replica's `spyre-serve serve`.")
    p.add_argument("--replicas", type=int, default=2, help="spyre-serve processes (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port; replica i listens on port + 1 + i")
    p.add_argument("--cores-per-replica", type=int, default=0,
                   help="pin replica i to its own N of this machine's cores (i*N, ... in turn), as separate "
                        "machines would run them; 0 (default): every replica may use every core")
    p.add_argument("--metrics-port", type=int, default=29000,
                   help="the router's own Prometheus metrics, on 127.0.0.1 (default 29000, vllm-router's)")
    p.add_argument("--router", default=None, help="the vllm-router command (default: see `make router`)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for vllm-router, after ours (repeat; e.g. --router-arg=--policy "
                        "--router-arg=round_robin)")
    p.add_argument("--log-dir", type=Path, default=None, help="write each process's output to a file here")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds a replica may drain when stopping")
    args = p.parse_args(own)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, got {args.replicas}")
    if any(a in ("--host", "--port") or a.startswith(("--host=", "--port=")) for a in serve):
        p.error("the replicas' --host and --port are the fleet's to choose (127.0.0.1, port + 1 + i)")
    return args, serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, serve = parse_args(sys.argv[1:] if argv is None else argv)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    replicas = [Replica(args.port + 1 + i, serve, args.log_dir, cores_of(i, args.cores_per_replica))
                for i in range(args.replicas)]
    router = [args.router or router_command(), "--host", args.host, "--port", str(args.port),
              "--worker-urls", *(r.url for r in replicas), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(args.metrics_port), *ROUTER_FLAGS, *args.router_arg]
    fleet = Fleet(replicas, router, args.log_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: fleet.stopping.set())
    fleet.start()
    code = fleet.watch()
    fleet.stop(args.drain_timeout)
    log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
