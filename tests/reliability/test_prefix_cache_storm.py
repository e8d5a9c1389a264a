"""A storm of requests sharing a system prompt, on a real server whose KV cache is too small for
them all: prefix hits, preemption and clients hanging up mid-stream or mid-wait together. After
it nothing runs, nothing holds a block (every reference count back to 0: none leaked, none freed
twice, which raises in the block manager and would kill the engine), the cached blocks count as
free, and a greedy request still gives the text it gave before the storm."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.reliability.servers import metric, running_server, wait_idle
from tests.reliability.test_storm import storm

SYSTEM = ("the harbour archivist answers questions about boats, the old mill, seven stone bridges "
          "and the birds that nest under them, briefly and without inventing dates; ") * 2
WORDS = "river mill bird stone bridge harbour boat morning light hill quiet seven old".split()


@pytest.fixture(scope="module")
def server():
    with running_server() as s:          # 64 blocks of 16 tokens: a few dozen requests overflow it
        yield s


def shared_body(rng: random.Random) -> dict:
    """The system prompt and a few words of its own; some ask for two choices."""
    return {"prompt": SYSTEM + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20))),
            "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
            "n": rng.choice([1, 1, 2])}


def test_a_storm_sharing_a_system_prompt_leaks_no_block_and_changes_no_text(server):
    probe = {"prompt": SYSTEM + "which bridge is the oldest", "max_tokens": 16, "temperature": 0,
             "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=600) as http:
        before = http.post("/v1/completions", json=probe).json()["choices"][0]["text"]
        outcomes = asyncio.run(storm(server.url, 120, 32, seed=4, make_body=shared_body))
        idle = wait_idle(http)
        after = http.post("/v1/completions", json=probe).json()["choices"][0]["text"]
        hits = metric(http, "vllm:prefix_cache_hits_total")
        preemptions = metric(http, "spyre_preemptions_total")
    engine = server.built.engine
    assert not [k for k in outcomes if k[0] == "5"], outcomes
    assert outcomes["left"] >= 20 and outcomes["200"] >= 20, outcomes
    assert idle["vllm:kv_cache_usage_perc"] == 0 and idle["spyre_runner_held_sequences"] == 0
    blocks = engine.blocks
    assert blocks.num_free == blocks.num_blocks
    assert [b for b in range(blocks.num_blocks) if blocks.ref_count(b)] == []
    assert engine.alive and engine.stats.failed_steps == 0
    assert hits > 0 and preemptions > 0, (hits, preemptions)
    assert after == before
