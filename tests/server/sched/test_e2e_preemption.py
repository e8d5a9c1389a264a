"""A KV cache too small for every request at once: preemption, and still the right greedy text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from spyre_serve.server.launch.cli import build
from tests.server.servers import ServerThread, real_settings

PROMPTS = ["Once upon a time in a", "The river ran past the old mill and", "Seven small birds"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def small_cache_server():
    # 16-token blocks, 6 of them: one request needs 2, six at once need 12
    built = build(real_settings(num_kv_blocks=6, max_model_len=96, max_num_seqs=8), progress=False)
    with ServerThread(built.app) as server:
        server.built = built
        yield server
    built.engine.shutdown()


def test_preemption_completes_every_request_with_its_greedy_text(small_cache_server):
    url = small_cache_server.url
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=900) as c:
        alone = {p: c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in PROMPTS}

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=900) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json={**body, "prompt": PROMPTS[i % 3]})
                                        for i in range(6)])
            return [r.json() for r in rs]

    results = asyncio.run(together())
    engine = small_cache_server.built.engine
    assert engine.scheduler.num_preemptions > 0, "the cache should have been too small for all six"
    metrics = httpx.get(url + "/metrics").text
    assert f'vllm:num_preemptions_total{{model_name="granite-tiny"}} {float(engine.scheduler.num_preemptions)}' \
        in metrics
    for i, r in enumerate(results):
        assert r["choices"][0]["text"] == alone[PROMPTS[i % 3]]
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert engine.blocks.num_free == engine.blocks.num_blocks
