"""The figures of a run, defined as `vllm bench serve` defines them.

Per request (all times in seconds, measured by the client):
- TTFT: from sending the request to the first chunk that carries a token;
- ITL: the gaps between consecutive token chunks;
- E2EL: from sending the request to the last token chunk;
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one
  output token: the mean time per token after the first.

Per run: throughputs divide by the run's wall time (first send to last
answer); percentiles interpolate linearly between ranks (numpy's default);
goodput counts the successful requests that meet every SLO given
(TTFT, TPOT, E2EL, each <= its bound; a request of one token has TPOT 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request."""

    success: bool
    prompt_tokens: int = 0        # the server's usage.prompt_tokens, else the prompt's known length
    output_tokens: int = 0        # the server's usage.completion_tokens, else the token chunks counted
    ttft: float = 0.0             # s
    itl: list[float] = field(default_factory=list)   # s, one per token chunk after the first
    latency: float = 0.0          # s, send to last token chunk (E2EL)
    start: float = 0.0            # s, when it was sent, from the start of its run
    finish_reason: str | None = None
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None for 0-1 tokens."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation, as numpy's default.

    An empty list gives 0.0 (as `vllm bench serve` reports an empty metric).
    """
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return 0.0
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(slots=True)
class Summary:
    """One latency metric over a run, in milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Summary:
        if not seconds:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        ms = [s * 1000.0 for s in seconds]
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
        return cls(mean, percentile(ms, 50), std, percentile(ms, 90), percentile(ms, 99))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the bound must be positive")
        slos[key] = ms / 1000.0
    return slos


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    """A successful request that meets every SLO in ``slos`` (seconds)."""
    if not r.success:
        return False
    observed = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(observed[k] <= bound for k, bound in slos.items())


@dataclass(slots=True)
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float       # completed requests / s
    request_goodput: float | None   # good requests / s, None without SLOs
    output_throughput: float        # output tokens / s
    total_token_throughput: float   # (input + output tokens) / s
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos: dict[str, float] | None = None) -> Metrics:
    """The run's figures from its requests (failed ones count only as failed)."""
    if duration_s <= 0:
        raise ValueError(f"a run's duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    goodput = None
    if slos:
        goodput = sum(is_good(r, slos) for r in ok) / duration_s
    return Metrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Summary.of([r.ttft for r in ok]),
        tpot_ms=Summary.of([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Summary.of([gap for r in ok for gap in r.itl]),
        e2el_ms=Summary.of([r.latency for r in ok]),
    )
