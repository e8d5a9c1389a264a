"""spyre-loadtest against a real spyre-serve on 127.0.0.1: its counts agree with /metrics.

Loads are small (a few requests of a few tokens): the point is the accounting, not speed.
"""

from __future__ import annotations

import json

import pytest

from tests.deploy.procs import Replica, loadtest, metrics, total

COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    r = Replica(tmp_path_factory.mktemp("server"), "server").wait()
    yield r
    r.stop()


def _deltas(url, run):
    before = metrics(url)
    result = run()
    after = metrics(url)
    return result, {c: total(after, c) - total(before, c) for c in COUNTERS}


def test_random_prompt_counts_agree_with_server_metrics(server, tmp_path):
    out = tmp_path / "r.json"
    proc, delta = _deltas(server.url, lambda: loadtest(
        "--base-url", server.url, "--num-prompts", "6", "--concurrency", "3",
        "--input-len", "24", "--output-len", "5", "--num-warmups", "1",
        "--result-file", str(out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    (point,) = res["points"]
    m, w = point["metrics"], res["warmup"]
    assert (m["completed"], m["failed"]) == (6, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (6 * 24, 6 * 5)
    assert (w["completed"], w["prompt_tokens"], w["output_tokens"]) == (1, 24, 5)
    assert delta == {"vllm:request_success_total": 6 + 1,
                     "vllm:prompt_tokens_total": 6 * 24 + 24,
                     "vllm:generation_tokens_total": 6 * 5 + 5}


def test_chat_prompt_counts_agree_with_server_metrics(server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about number {i}."}) + "\n"
                               for i in range(3)))
    out = tmp_path / "r.json"
    proc, delta = _deltas(server.url, lambda: loadtest(
        "--base-url", server.url, "--endpoint", "/v1/chat/completions", "--dataset", "jsonl",
        "--dataset-path", str(prompts), "--num-prompts", "3", "--concurrency", "3",
        "--output-len", "4", "--ignore-eos", "--num-warmups", "0", "--result-file", str(out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = json.loads(out.read_text())["points"][0]["metrics"]
    assert (m["completed"], m["total_output_tokens"]) == (3, 12)
    assert m["ttft_ms"]["mean"] > 0
    assert delta == {"vllm:request_success_total": 3,
                     "vllm:prompt_tokens_total": m["total_input_tokens"],
                     "vllm:generation_tokens_total": 12}


def test_sweep_reports_every_concurrency_and_plots_them(server, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = loadtest("--base-url", server.url, "--num-prompts", "2", "--concurrency", "1", "2",
                    "--input-len", "8", "--output-len", "3", "--num-warmups", "0",
                    "--result-file", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    points = json.loads(out.read_text())["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    assert all(p["metrics"]["completed"] == 2 for p in points)
    assert proc.stdout.count("Serving Benchmark Result") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_duration_cuts_a_run_short_and_says_so(server, tmp_path):
    out = tmp_path / "r.json"
    proc = loadtest("--base-url", server.url, "--num-prompts", "40", "--concurrency", "2",
                    "--input-len", "8", "--output-len", "64", "--num-warmups", "0",
                    "--max-duration", "1", "--result-file", str(out), timeout=120)
    assert proc.returncode == 1
    p = json.loads(out.read_text())["points"][0]
    assert p["not_sent"] > 0
    assert p["metrics"]["completed"] + p["metrics"]["failed"] + p["not_sent"] == 40
    assert any("max-duration" in e for e in p["errors"])


def test_server_exposes_the_gauge_the_autoscaler_scales_on(server):
    # deploy/k8s/hpa.yaml scales on vllm:num_requests_waiting (through prometheus-adapter)
    assert "vllm:num_requests_waiting" in {k.split("{")[0] for k in metrics(server.url)}


def test_refused_requests_count_as_failed_with_the_server_message(server, tmp_path):
    out = tmp_path / "r.json"
    proc = loadtest("--base-url", server.url, "--model", "no-such-model", "--num-prompts", "2",
                    "--concurrency", "2", "--input-len", "8", "--output-len", "2",
                    "--num-warmups", "0", "--result-file", str(out))
    assert proc.returncode == 1
    p = json.loads(out.read_text())["points"][0]
    assert (p["metrics"]["completed"], p["metrics"]["failed"]) == (0, 2)
    assert p["errors"] and all(e.startswith("HTTP 404") for e in p["errors"])


def test_bursty_request_rate_completes_every_request(server, tmp_path):
    out = tmp_path / "r.json"
    proc = loadtest("--base-url", server.url, "--num-prompts", "4", "--concurrency", "4",
                    "--request-rate", "20", "--burstiness", "0.5", "--input-len", "8",
                    "--output-len", "2", "--num-warmups", "0", "--result-file", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = json.loads(out.read_text())["points"][0]
    assert (p["request_rate"], p["burstiness"], p["metrics"]["completed"]) == (20.0, 0.5, 4)
    assert "Request rate configured (RPS):           20.00" in proc.stdout
