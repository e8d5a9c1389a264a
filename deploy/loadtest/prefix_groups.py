"""A fleet's prefix workload, and what each replica served of it.

``prefix_groups`` writes K groups of M prompts: every prompt of a group starts with the group's
shared prefix and ends with a suffix of its own, the groups shuffled together, as a JSONL dataset for
``spyre-loadtest --dataset jsonl``. Each group asks for its own ``max_tokens``, one of vLLM's
1-2-5 bucket edges (``GROUP_MAX_TOKENS``), so that a replica's histogram
``vllm:request_params_max_tokens`` says how many requests of each group it served: no header
or log is needed to tell where a router sent each request. ``served`` reads that from two
scrapes of every replica, and ``hit_ratio`` the fleet's prefix-cache hit ratio between them.

Every call draws new words (``seed``), so a run never sends a prefix an earlier run sent: a
prefix a replica still caches would measure nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx

# one per group: vLLM's bucket edges of vllm:request_params_max_tokens (1, 2, 5, 10, 20, 50, ...)
GROUP_MAX_TOKENS = (5, 10, 20, 50, 100, 200)
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vi", "do", "pa", "re", "su", "ti", "ba", "go", "hu")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def prefix_groups(path: Path, groups: int, per_group: int, prefix_words: int, suffix_words: int,
                  seed: int, max_tokens: tuple[int, ...] = GROUP_MAX_TOKENS) -> list[dict]:
    """Write ``groups`` x ``per_group`` prompts to ``path`` (JSONL, the groups shuffled together:
    strict turns would line a group up with a replica of a round-robin router) and return the
    rows. Group g asks for ``max_tokens[g]`` tokens."""
    if groups > len(max_tokens):
        raise ValueError(f"at most {len(max_tokens)} groups (one max_tokens bucket each), got {groups}")
    rng = random.Random(seed)
    prefixes = [" ".join(_word(rng) for _ in range(prefix_words)) for _ in range(groups)]
    rows = [{"prompt": f"{prefixes[g]} | {' '.join(_word(rng) for _ in range(suffix_words))}",
             "max_tokens": max_tokens[g], "group": g}
            for _ in range(per_group) for g in range(groups)]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def scrape(url: str) -> dict[str, float]:
    """A replica's /metrics as {"name{labels}": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _at_most(scraped: dict[str, float], edge: int) -> float:
    return scraped.get(f'vllm:request_params_max_tokens_bucket{{le="{float(edge)}"}}', 0.0)


def served(before: dict[str, float], after: dict[str, float], groups: int,
           max_tokens: tuple[int, ...] = GROUP_MAX_TOKENS) -> list[int]:
    """How many requests of each group one replica served between two scrapes."""
    counts, below = [], 0.0
    for g in range(groups):
        upto = _at_most(after, max_tokens[g]) - _at_most(before, max_tokens[g])
        counts.append(round(upto - below))
        below = upto
    return counts


def hit_ratio(before: list[dict[str, float]], after: list[dict[str, float]]) -> float:
    """The fleet's prefix-cache hit ratio between two scrapes of every replica: cached prompt
    tokens over prompt tokens looked up (vllm:prefix_cache_hits / vllm:prefix_cache_queries)."""
    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))

    queries = delta("vllm:prefix_cache_queries_total")
    return delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0
