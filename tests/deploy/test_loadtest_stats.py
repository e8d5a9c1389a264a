"""The load-test figures on inputs whose answers are known by hand."""

import math

import numpy as np
import pytest

from spyre_serve.deploy.loadtest.arrivals import arrival_gaps
from spyre_serve.deploy.loadtest.report import format_report
from spyre_serve.deploy.loadtest.stats import (
    RequestResult,
    Summary,
    compute_metrics,
    is_good,
    parse_goodput,
    percentile,
)


def ok(ttft, latency, out, prompt=10, itl=None):
    return RequestResult(success=True, prompt_tokens=prompt, output_tokens=out, ttft=ttft,
                         latency=latency, itl=itl or [])


def test_percentile_interpolates_linearly_between_ranks():
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 0) == 10.0
    assert percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == 25.0            # halfway between ranks 1 and 2
    assert percentile(xs, 90) == pytest.approx(37.0)   # rank 2.7
    assert percentile(xs, 99) == pytest.approx(39.7)   # rank 2.97


def test_percentile_ignores_input_order_and_matches_numpy():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for p in (1, 25, 50, 90, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_percentile_of_nothing_is_zero_and_out_of_range_is_refused():
    assert percentile([], 99) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_the_serving_benchmark_reports_a_level_without_successes_as_zero_like_the_load_test(
        monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("benchmark_serving", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)   # its dataclasses look themselves up
    spec.loader.exec_module(bench)
    assert bench.percentile is percentile
    level = bench.summarize("spyre-serve", 4, [bench.Result(ok=False, error="503")] * 4, 1.0, None)
    assert (level.ttft_p50_ms, level.ttft_p99_ms, level.tpot_p50_ms, level.tpot_p99_ms) == (0.0,) * 4


def test_tpot_excludes_the_first_token():
    # 0.5 s to the first token, 2.5 s in all, 5 tokens: 4 gaps over 2 s
    assert ok(0.5, 2.5, 5).tpot == pytest.approx(0.5)


def test_tpot_is_undefined_for_one_token():
    assert ok(0.5, 0.5, 1).tpot is None


def test_summary_is_in_milliseconds():
    s = Summary.of([0.1, 0.2, 0.3, 0.4])
    assert s.mean == pytest.approx(250.0)
    assert s.median == pytest.approx(250.0)
    assert s.p90 == pytest.approx(370.0)
    assert s.std == pytest.approx(math.sqrt(12500.0))


def test_metrics_count_only_successful_requests():
    results = [ok(0.1, 1.1, 11, prompt=100, itl=[0.1] * 10),
               ok(0.3, 2.3, 21, prompt=50, itl=[0.1] * 20),
               RequestResult(success=False, error="HTTP 503")]
    m = compute_metrics(results, duration_s=4.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (150, 32)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.total_token_throughput == pytest.approx(182 / 4.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.tpot_ms.mean == pytest.approx(100.0)   # both requests: 0.1 s per token
    assert m.itl_ms.median == pytest.approx(100.0)
    assert m.e2el_ms.median == pytest.approx(1700.0)
    assert m.request_goodput is None


def test_goodput_counts_requests_within_every_slo():
    slos = parse_goodput(["ttft:200", "tpot:50"])
    assert slos == {"ttft": 0.2, "tpot": 0.05}
    fast = ok(0.1, 0.5, 11)          # tpot 0.04
    slow_first = ok(0.3, 0.7, 11)    # ttft over
    slow_tokens = ok(0.1, 1.1, 11)   # tpot 0.1 over
    one_token = ok(0.2, 0.2, 1)      # tpot counts as 0; ttft exactly at the bound
    failed = RequestResult(success=False)
    assert [is_good(r, slos) for r in (fast, slow_first, slow_tokens, one_token, failed)] == \
        [True, False, False, True, False]
    m = compute_metrics([fast, slow_first, slow_tokens, one_token, failed], 2.0, slos)
    assert m.request_goodput == pytest.approx(1.0)


@pytest.mark.parametrize("bad", ["ttft", "speed:10", "ttft:x", "ttft:-5"])
def test_goodput_refuses_malformed_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_gamma_gaps_average_one_over_the_rate():
    gaps = arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=1)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_vary_as_one_over_sqrt_burstiness(burstiness):
    gaps = np.array(arrival_gaps(20000, rate=10.0, burstiness=burstiness, seed=2))
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_gaps(3, rate=math.inf) == [0.0, 0.0, 0.0]


def test_report_has_vllm_lines():
    m = compute_metrics([ok(0.1, 1.1, 11, itl=[0.1] * 10)], 1.0, parse_goodput(["ttft:500"]))
    text = format_report(m, concurrency=4, rate=math.inf)
    lines = text.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ")
    for label in ("Successful requests:", "Failed requests:", "Request throughput (req/s):",
                  "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "P90 E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    assert "Mean TPOT (ms):                          100.00" in text
