"""--spyre-compat through a real uvicorn server (granite-tiny): concurrent requests all complete,
every step the engine ran was one of the plugin's (decodes only, or one whole prefill chunk),
the greedy tokens equal those of the server without the flag (compat changes only the
schedule), no program is compiled after warm-up, and a request over the context is a 400."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.servers import PROMPT, ServerThread, http_client, real_settings

CHUNK = 64
# granite-tiny with the plugin's KV block; warm-up on (compat refuses --no-warmup)
SIZES = dict(block_size=64, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=CHUNK)
# (prompt, max_tokens): 10 to ~150 tokens, sharing PROMPT as a prefix (whole-chunk cache hits)
CASES = [(" ".join([PROMPT] * k) + f" {k}", 6 + k) for k in (1, 12, 3, 8, 5, 10)]


def served(**overrides):
    from spyre_serve.server.launch.cli import build

    built = build(real_settings(**SIZES, **overrides), progress=False)
    server = ServerThread(built.app).__enter__()
    server.built = built
    return server


@pytest.fixture(scope="module")
def compat_server():
    server = served(spyre_compat=True, warmup=True)
    steps = []
    scheduler = server.built.engine.scheduler
    schedule = scheduler.schedule

    def recorded():
        chunks = schedule()
        steps.append([(c.start, c.num_new, c.seq.num_prompt) for c in chunks])
        return chunks

    scheduler.schedule = recorded
    server.steps = steps
    yield server
    server.__exit__()
    server.built.engine.shutdown()


@pytest.fixture(scope="module")
def free_server():
    server = served()
    yield server
    server.__exit__()
    server.built.engine.shutdown()


def completions(server) -> list[list[str]]:
    """The greedy tokens of every case, all sent at once."""
    async def one(client, prompt, max_tokens):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await asyncio.gather(*(one(client, *case) for case in CASES))

    return asyncio.run(run())


def test_concurrent_requests_complete_in_plugin_steps_with_the_free_servers_tokens(compat_server, free_server):
    tokens = completions(compat_server)
    assert [len(t) for t in tokens] == [m for _, m in CASES]
    assert tokens == completions(free_server)
    steps = [s for s in compat_server.steps if s]
    assert len(steps) > len(CASES)
    for s in steps:
        prefills = [(start, n, p) for start, n, p in s if n > 1 or start < p]
        assert not prefills or len(s) == 1, s                          # one prefill, alone
        for start, n, p in prefills:
            assert start % CHUNK == 0 and (n == CHUNK or start + n == p), s   # whole chunks
    engine = compat_server.built.engine
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_no_program_is_compiled_after_warm_up_and_a_request_over_the_context_is_a_400(compat_server):
    for client in http_client(compat_server):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1020})
        assert r.status_code == 400 and "maximum context length is 1024 tokens" in r.text
        metrics = client.get("/metrics").text
    assert 'spyre_compiles_after_warmup{model_name="granite-tiny"} 0.0' in metrics
