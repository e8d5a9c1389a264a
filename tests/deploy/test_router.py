"""Three replicas behind the real vllm-router (the registry's package, installed by `make router`),
started by `spyre-fleet` as a user starts them, on 127.0.0.1.

A prefix workload (K groups of shared prefixes, M suffixes each, shuffled, concurrency 4) sends
each group to one replica, every replica gets a group, and the fleet's prefix-cache hit ratio
beats a round-robin router's on the same shape of workload (new prompts). A replica stopped
with SIGTERM mid-load drains and no client sees an error; one killed with SIGKILL fails no more
requests than it held, the router sends the requests after it elsewhere, and the fleet starts it
again and the router takes it back. The tests share the fleet and run in this order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from spyre_serve.deploy.fleet import ROUTER_FLAGS, router_command
from spyre_serve.deploy.loadtest.prefix_groups import hit_ratio, prefix_groups, scrape, served
from tests.deploy.procs import REPO, loadtest, wait_healthy

REPLICAS = 3
SERVE = ["--model", "granite-tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
         "--device-memory", "1G"]
GROUPS, PER_GROUP = 3, 8


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65000:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def replica_pid(port: int) -> int:
    """The pid listening on 127.0.0.1:``port``."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on {port}")


class FleetUnderTest:
    def __init__(self, tmp: Path):
        base = free_ports(REPLICAS + 2)
        self.port, self.rr_port = base, base + REPLICAS + 1
        self.url, self.rr_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{self.rr_port}"
        self.replicas = [f"http://127.0.0.1:{base + 1 + i}" for i in range(REPLICAS)]
        self.log_dir = tmp / "fleet"
        self.log = tmp / "fleet.log"
        self._out = open(self.log, "w")
        metrics = free_ports(2)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spyre_serve.deploy.fleet", "--replicas", str(REPLICAS), "--port", str(base),
             "--metrics-port", str(metrics), "--log-dir", str(self.log_dir), "--", *SERVE],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=REPO)
        # the same replicas behind a second router, round-robin: the baseline
        self._rr_out = open(tmp / "rr-router.log", "w")
        self.rr = subprocess.Popen([router_command(), "--host", "127.0.0.1", "--port", str(self.rr_port),
                                    "--worker-urls", *self.replicas, "--prometheus-port", str(metrics + 1),
                                    *ROUTER_FLAGS, "--policy", "round_robin"],
                                   stdout=self._rr_out, stderr=subprocess.STDOUT)
        # the router answers /health once one replica does: wait for every replica too
        for url in (*self.replicas, self.url):
            wait_healthy(url, self.proc, self.log)
        wait_healthy(self.rr_url, self.rr, tmp / "rr-router.log")

    def scrape_all(self) -> list[dict[str, float]]:
        return [scrape(u) for u in self.replicas]

    def stop(self) -> int:
        self.rr.terminate()
        self.rr.wait(30)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        self._out.close()
        self._rr_out.close()
        return code


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = FleetUnderTest(tmp_path_factory.mktemp("router"))
    yield f
    assert f.stop() == 0, f.log.read_text()[-3000:]


def run_groups(front: str, tmp: Path, seed: int) -> dict:
    """The prefix workload (new prompts for each ``seed``) through ``front``: the load test's metrics."""
    data, out = tmp / f"groups-{seed}.jsonl", tmp / f"groups-{seed}.json"
    prefix_groups(data, GROUPS, PER_GROUP, prefix_words=150, suffix_words=12, seed=seed)
    run = loadtest("--base-url", front, "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts",
                   str(GROUPS * PER_GROUP), "--concurrency", "4", "--num-warmups", "0", "--ignore-eos",
                   "--result-file", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())["points"][0]["metrics"]


def successes(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("vllm:request_success_total"))


def test_each_prefix_group_goes_to_one_replica_and_the_cache_beats_round_robin(fleet, tmp_path):
    before = fleet.scrape_all()
    m = run_groups(fleet.url, tmp_path, seed=1)
    after = fleet.scrape_all()
    assert (m["completed"], m["failed"]) == (GROUPS * PER_GROUP, 0)
    by_replica = [served(b, a, GROUPS) for b, a in zip(before, after, strict=True)]
    for g in range(GROUPS):
        share = max(r[g] for r in by_replica) / PER_GROUP
        assert share >= 0.9, (g, by_replica)
    assert all(sum(r) > 0 for r in by_replica), by_replica
    routed = hit_ratio(before, after)

    before = fleet.scrape_all()
    assert run_groups(fleet.rr_url, tmp_path, seed=2)["failed"] == 0     # new prefixes: nothing cached
    round_robin = hit_ratio(before, fleet.scrape_all())
    assert routed > round_robin, (routed, round_robin)


def random_load(front: str, out: Path, n: int = 40) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "spyre_serve.deploy.loadtest", "--disable-tqdm", "--base-url", front,
         "--num-prompts", str(n), "--concurrency", "6", "--input-len", "32", "--output-len", "24",
         "--num-warmups", "0", "--save-requests", "--result-file", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def wait_running(url: str, load: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while scrape(url).get("vllm:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, f"{url} never got a request"
        assert load.poll() is None, "the load ended before the replica got a request"
        time.sleep(0.02)


def finished(load: subprocess.Popen, out: Path, failures_allowed: bool = False) -> list[dict]:
    """Every request's record; the load test exits 1 when any failed."""
    stdout, stderr = load.communicate(timeout=300)
    assert load.returncode in ((0, 1) if failures_allowed else (0,)), stdout + stderr
    return json.loads(out.read_text())["points"][0]["requests"]


def test_a_replica_stopped_with_sigterm_mid_load_drains_and_no_client_sees_an_error(fleet, tmp_path):
    target = fleet.replicas[0]
    load = random_load(fleet.url, tmp_path / "term.json")
    try:
        wait_running(target, load)
        os.kill(replica_pid(int(target.rsplit(":", 1)[1])), signal.SIGTERM)
        reqs = finished(load, tmp_path / "term.json")
    finally:
        if load.poll() is None:
            load.kill()
    assert all(r["success"] for r in reqs), [r["error"] for r in reqs if not r["success"]]
    assert {r["output_tokens"] for r in reqs} == {24}
    wait_healthy(target, fleet.proc, fleet.log)     # the fleet started it again


def test_a_replica_killed_mid_load_fails_at_most_what_it_held_then_comes_back(fleet, tmp_path):
    target = fleet.replicas[1]
    port = int(target.rsplit(":", 1)[1])
    load = random_load(fleet.url, tmp_path / "kill.json")
    try:
        wait_running(target, load)
        held = httpx.get(target + "/load", timeout=10).json()["server_load"]
        os.kill(replica_pid(port), signal.SIGKILL)
        reqs = finished(load, tmp_path / "kill.json", failures_allowed=True)
    finally:
        if load.poll() is None:
            load.kill()
    failed = [r for r in reqs if not r["success"]]
    assert len(failed) <= held, (held, [r["error"] for r in failed])
    # requests sent after the kill, while the replica is down, all answered elsewhere
    after = random_load(fleet.url, tmp_path / "down.json", n=12)
    assert all(r["success"] for r in finished(after, tmp_path / "down.json"))
    wait_healthy(target, fleet.proc, fleet.log)     # started again by the fleet
    before = successes(target)
    deadline = time.monotonic() + 90
    while True:          # the round-robin router takes it back once its health check passes
        back = random_load(fleet.rr_url, tmp_path / "back.json", n=6)
        assert all(r["success"] for r in finished(back, tmp_path / "back.json"))
        if successes(target) > before:
            break
        assert time.monotonic() < deadline, "the router never sent the restarted replica a request"
        time.sleep(1)
