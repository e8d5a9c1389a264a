"""Prefix caching on a real server (granite-tiny behind uvicorn): chats sharing a long system
prompt start from its cached blocks, /metrics counts the hits in tokens as vLLM, the greedy
text does not change, and the KV cache is empty again (cached blocks count as free)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from spyre_serve.server.launch.cli import build
from spyre_serve.server.launch.settings import Settings, add_flags
from tests.reliability.servers import metric, wait_idle
from tests.server.servers import ServerThread, real_settings

SYSTEM = ("You are the archivist of a small harbour town. You answer questions about its boats, "
          "its mill, its bridges and the birds that nest under them, in short plain sentences. "
          "You never invent a date, you say so when you do not know, and you keep every answer "
          "under forty words. The town has seven stone bridges, one old mill and a quiet harbour "
          "where boats rest until morning light returns to the hills.")
BODY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


def chat(user: str) -> dict:
    return {**BODY, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


@pytest.fixture(scope="module")
def server():
    built = build(real_settings(num_kv_blocks=128, max_num_batched_tokens=64), progress=False)
    with ServerThread(built.app) as s:
        s.built = built
        yield s
    built.engine.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chats_sharing_a_system_prompt_hit_the_cache_and_keep_their_text(server, http):
    first = http.post("/v1/chat/completions", json=chat("How many bridges are there?"))
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 100
    assert metric(http, "vllm:prefix_cache_hits_total") == 0
    assert metric(http, "vllm:prefix_cache_queries_total") == prompt_tokens
    again = http.post("/v1/chat/completions", json=chat("How many bridges are there?"))
    hits = metric(http, "vllm:prefix_cache_hits_total")
    assert hits == (prompt_tokens - 1) // 16 * 16              # all but the last token, in blocks
    assert text(again) == text(first)
    other = http.post("/v1/chat/completions", json=chat("Who lives under the bridges?"))
    assert text(other)
    assert metric(http, "vllm:prefix_cache_hits_total") - hits >= len(SYSTEM) // 8   # the system part
    wait_idle(http)
    assert metric(http, "spyre_kv_blocks_free") == metric(http, "spyre_kv_blocks_total")
    assert metric(http, "spyre_kv_blocks_cached") > 0


def test_concurrent_chats_with_one_system_prompt_all_hit_and_leave_the_cache_idle(server, http):
    users = [f"Question {i}: what do the birds under bridge {i} sing?" for i in range(6)]
    alone = {u: text(http.post("/v1/chat/completions", json=chat(u))) for u in users[:2]}
    before = metric(http, "vllm:prefix_cache_hits_total")

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(u)) for u in users))

    rs = asyncio.run(together())
    texts = [text(r) for r in rs]
    assert texts[:2] == [alone[u] for u in users[:2]]
    assert metric(http, "vllm:prefix_cache_hits_total") - before >= 6 * 64
    assert wait_idle(http)["vllm:kv_cache_usage_perc"] == 0


def test_the_flag_turns_prefix_caching_off():
    parser = argparse.ArgumentParser()
    add_flags(parser, ["enable_prefix_caching"])
    assert parser.parse_args([]).enable_prefix_caching is True
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert Settings().enable_prefix_caching is True


def test_a_cache_salt_shares_blocks_only_with_the_same_salt(server, http):
    """vLLM's cache_salt: a salted prompt never starts from another salt's blocks (or from
    unsalted ones), so a client cannot learn from its time to first token what another
    tenant's prompts hold; the same salt hits as before, and the text does not change."""
    body = chat("Which birds nest under the bridges, and since when?")

    def hits_of(extra: dict) -> float:
        before = metric(http, "vllm:prefix_cache_hits_total")
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return metric(http, "vllm:prefix_cache_hits_total") - before, text(r)

    hits, plain = hits_of({})                           # warms the unsalted cache
    assert hits_of({})[0] > 100
    first_a, text_a = hits_of({"cache_salt": "tenant-a"})
    assert first_a == 0 and text_a == plain             # unsalted blocks are not a's
    assert hits_of({"cache_salt": "tenant-b"})[0] == 0  # nor a's b's
    again_a, _ = hits_of({"cache_salt": "tenant-a"})
    assert again_a > 100                                # a's own blocks are
    for bad in ("", 7, "x" * 1025):
        r = http.post("/v1/chat/completions", json={**body, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
