"""Two spyre-serve replicas behind nginx (deploy/nginx/nginx.conf, as compose uses it).

nginx runs in the foreground as a child with its own prefix and temp dirs; only the
upstream list and the listen port (the two included files) are this test's own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx

from tests.deploy.procs import REPO, metrics, total


def test_nginx_is_installed():
    # .ci/run installs Debian's nginx when it is missing; without it the tests below fail
    assert shutil.which("nginx") or shutil.which("/usr/sbin/nginx"), "apt-get install -y nginx"


def test_loadtest_through_nginx_completes_every_request_on_both_replicas(replicas, nginx,
                                                                          tmp_path):
    a, b = replicas(2)
    front = nginx([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "spyre_serve.deploy.loadtest", "--disable-tqdm", "--base-url", front.url,
         "--num-prompts", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "4",
         "--num-warmups", "0", "--result-file", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = json.loads(out.read_text())["points"][0]["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (8, 0, 32)
    served = {row["upstreams"][-1] for row in front.log_lines()
              if row["request"].startswith("POST /v1/completions")}
    assert served == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}


def test_sigterm_drains_accepted_requests_while_new_ones_go_to_the_other(replicas, nginx,
                                                                         tmp_path):
    a, b = replicas(2)
    addr_a, addr_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    front = nginx([addr_a, addr_b])
    out = tmp_path / "r.json"
    n, out_len = 32, 16   # long enough that requests still arrive after the signal (~1 s at 2 cores)
    run = subprocess.Popen(
        [sys.executable, "-m", "spyre_serve.deploy.loadtest", "--disable-tqdm", "--base-url", front.url,
         "--num-prompts", str(n), "--concurrency", "4", "--input-len", "16",
         "--output-len", str(out_len), "--num-warmups", "0", "--save-requests",
         "--result-file", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        # wait (bounded) until replica A is in the middle of requests, then stop it
        deadline = time.monotonic() + 120
        while total(metrics(a.url), "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "replica A never got a request"
            assert run.poll() is None, "the load test ended before replica A got a request"
            time.sleep(0.05)
        t_sig = time.time()
        a.proc.terminate()
        assert a.proc.wait(timeout=120) == 0, a.log.read_text()[-2000:]
        stdout, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, stdout + stderr

    # the client: every request completed with its full output
    reqs = json.loads(out.read_text())["points"][0]["requests"]
    assert len(reqs) == n and all(r["success"] for r in reqs), [r["error"] for r in reqs]
    assert {r["output_tokens"] for r in reqs} == {out_len}

    posts = [r for r in front.log_lines() if r["request"].startswith("POST /v1/completions")]
    assert len(posts) == n and {r["status"] for r in posts} == {200}
    # A drained: requests it had accepted before the signal finished there, after it
    drained = [r for r in posts if r["upstreams"][-1] == addr_a
               and r["msec"] - r["request_time"] < t_sig < r["msec"]]
    assert drained, "no request was running on replica A across its SIGTERM"
    # new requests were all served by B: those reaching nginx after the signal (and the
    # quarter second the server may take to run its signal handler; nginx logs in ms)
    later = [r for r in posts if r["msec"] - r["request_time"] > t_sig + 0.25]
    assert later, "the load test sent nothing after the SIGTERM"
    assert {r["upstreams"][-1] for r in later} == {addr_b}
    assert httpx.get(front.url + "/health", timeout=10).status_code == 200
