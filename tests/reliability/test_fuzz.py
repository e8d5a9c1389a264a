"""Fuzz: schemathesis over the server's own OpenAPI document, against a real server.

granite-tiny with a 256-token context; every operation of /openapi.json gets cases that fit
its schema (positive) and cases that break it (negative), a fixed number of each, from a
fixed seed (Hypothesis's derandomized generation), so a run is the same every time and
takes well under two minutes. A positive case that would generate asks for at most
``MAX_TOKENS`` tokens (its other fields are left as generated), so generations stay short.
Afterwards: no response had a status of 500 or more (nor failed to arrive), the server is
healthy, nothing is running or waiting, and the KV cache is empty again.
"""

from __future__ import annotations

import time
from collections import Counter

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation.modes import GenerationMode

from tests.reliability.servers import metric

# cases per operation that takes a body: (positive, negative); one that takes none gets FEW
PER_BODY = (48, 24)
FEW = 4
MAX_TOKENS = 4  # the most tokens a generated request may ask for
SECONDS = 110  # the whole run's bound (cases, then the server settling)


def short(case) -> object:
    """``case`` with its output limits held to ``MAX_TOKENS`` (where it has them as integers),
    if it is a generation's."""
    body, path = case.body, case.operation.path
    if isinstance(body, dict) and path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if key in body and (value is None or (isinstance(value, int) and not isinstance(value, bool))):
                body[key] = MAX_TOKENS if value is None else min(value, MAX_TOKENS)
        if path == "/v1/responses":             # its only output limit
            body.setdefault("max_output_tokens", MAX_TOKENS)
        elif "/chat/" not in path or "max_completion_tokens" not in body:
            body.setdefault("max_tokens", MAX_TOKENS)
    return case


def run_cases(operation, mode: GenerationMode, count: int, url: str, session: requests.Session,
              statuses: Counter, failures: list, deadline: float) -> None:
    """``count`` cases of ``operation`` in ``mode`` sent to ``url``; statuses counted, anything
    of 500 or more (or no answer) kept in ``failures`` (not raised: no shrinking, one run)."""

    @settings(max_examples=count, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode).map(short))
    def send(case) -> None:
        if time.monotonic() > deadline:
            return
        try:
            response = case.call(base_url=url, session=session, timeout=60)
        except requests.RequestException as exc:
            failures.append((operation.label, mode.value, repr(case.body)[:300], f"no answer: {exc!r}"))
            statuses["no answer"] += 1
            return
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append((operation.label, mode.value, repr(case.body)[:300], response.text[:300]))

    send()


def settled(http) -> bool:
    return (http.get("/health").status_code == 200
            and metric(http, "vllm:num_requests_running") == 0
            and metric(http, "vllm:num_requests_waiting") == 0
            and metric(http, "vllm:kv_cache_usage_perc") == 0)


def test_the_servers_own_api_fuzzed_gives_no_500_and_leaves_it_healthy_and_empty(server, http):
    t0 = time.monotonic()
    deadline = t0 + SECONDS - 15
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    statuses: Counter = Counter()
    failures: list = []
    per_operation: dict[str, dict] = {}
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            takes_body = bool(operation.body)
            for mode, count in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
                                   PER_BODY if takes_body else (FEW, 0), strict=True):
                if count:
                    seen: Counter = Counter()
                    run_cases(operation, mode, count, server.url, session, seen, failures, deadline)
                    per_operation[f"{operation.label} {mode.value}"] = dict(seen)
                    statuses.update(seen)
    sent = sum(statuses.values())
    print(f"\nfuzz: {sent} requests in {time.monotonic() - t0:.1f} s; "
          f"statuses {dict(sorted(statuses.items(), key=str))}")
    print("per operation:", per_operation)
    assert not failures, "\n".join(map(str, failures[:10]))
    assert sent >= 250 and time.monotonic() < deadline, "the run was cut short by its time bound"
    while not settled(http):
        assert time.monotonic() < t0 + SECONDS, "the server did not settle: requests left or KV blocks held"
        time.sleep(0.1)
    assert statuses[200] >= 40 and statuses[400] >= 40  # both kinds of case reached the server
