"""The report of one load point, laid out as `vllm bench serve` prints it."""

from __future__ import annotations

import math

from .stats import Metrics, Summary


def _line(label: str, value) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _section(lines: list[str], title: str, short: str, s: Summary) -> None:
    lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
    lines.append(_line(f"Mean {short} (ms):", s.mean))
    lines.append(_line(f"Median {short} (ms):", s.median))
    lines.append(_line(f"P90 {short} (ms):", s.p90))
    lines.append(_line(f"P99 {short} (ms):", s.p99))


def format_report(m: Metrics, concurrency: int, rate: float, not_sent: int = 0) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_line("Successful requests:", m.completed))
    lines.append(_line("Failed requests:", m.failed))
    if not_sent:
        lines.append(_line("Requests not sent (time limit):", not_sent))
    lines.append(_line("Maximum request concurrency:", concurrency))
    if not math.isinf(rate):
        lines.append(_line("Request rate configured (RPS):", rate))
    lines.append(_line("Benchmark duration (s):", m.duration_s))
    lines.append(_line("Total input tokens:", m.total_input_tokens))
    lines.append(_line("Total generated tokens:", m.total_output_tokens))
    lines.append(_line("Request throughput (req/s):", m.request_throughput))
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput))
    lines.append(_line("Output token throughput (tok/s):", m.output_throughput))
    lines.append(_line("Total Token throughput (tok/s):", m.total_token_throughput))
    _section(lines, "Time to First Token", "TTFT", m.ttft_ms)
    _section(lines, "Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms)
    _section(lines, "Inter-token Latency", "ITL", m.itl_ms)
    _section(lines, "End-to-end Latency", "E2EL", m.e2el_ms)
    lines.append("=" * 50)
    return "\n".join(lines)
