"""LoRA adapters through a real uvicorn server (one, shared by these tests): concurrent requests
of different ``model`` names against transformers + peft on the same base (fp32, greedy), with
more adapters than --max-loras slots; /v1/models; the 404 of an unknown name; runtime load and
unload (400 for a rank over --max-lora-rank or broken files, disabled without
--allow-runtime-lora; the --lora-modules' directory the allowed root); host copies of the
adapters capped by --max-cpu-loras (2, as --max-loras: the third is read again when used);
prefix-cache blocks never shared across adapters; no KV block left."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint
from tests.models.lora_adapters import reference_greedy, reference_with_adapter, write_lora_adapter
from tests.reliability.servers import running_server
from tests.server.servers import real_settings

ADAPTERS = {
    "qv8": dict(r=8, alpha=16, targets=["q_proj", "v_proj"], seed=1),
    "all4": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"], seed=2, use_rslora=True),
    "mlp16": dict(r=16, alpha=8, targets=["o_proj", "gate_proj", "up_proj", "down_proj"], seed=3),
}
RUNTIME = dict(r=8, alpha=8, targets=["k_proj", "o_proj", "down_proj"], seed=4)
N_NEW = 10


class Lora:
    """The base checkpoint, its adapters, the prompts and what transformers + peft answer."""

    def __init__(self, root):
        self.base = write_granite_checkpoint(root / "base", vocab=8192, tie=False, hidden=128,
                                             layers=2, heads=4, kv_heads=1, init_std=0.2,
                                             with_tokenizer=True)
        self.paths = {n: write_lora_adapter(self.base, root / n, **kw) for n, kw in ADAPTERS.items()}
        self.paths["runtime"] = write_lora_adapter(self.base, root / "runtime", **RUNTIME)
        rng = np.random.default_rng(7)
        # 40 tokens: two full 16-token blocks each, which the prefix cache may share
        self.prompts = [rng.integers(100, 8000, 40).tolist() for _ in range(3)]   # [2]: the cache test's
        self.expected = {}
        for name in [None, *self.paths]:
            ref = (load_reference_model(self.base) if name is None
                   else reference_with_adapter(self.base, self.paths[name]))
            self.expected[name] = [reference_greedy(ref, p, N_NEW) for p in self.prompts]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return Lora(tmp_path_factory.mktemp("lora_e2e"))


def lora_settings(lora, **changes) -> dict:
    return {"model": str(lora.base), "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
            "lora_modules": {n: str(lora.paths[n]) for n in ADAPTERS}, "allow_runtime_lora": True,
            "served_model_name": "base", **changes}


@pytest.fixture(scope="module")
def server(lora):
    with running_server(**lora_settings(lora)) as s:     # its context: 256 tokens, 64 KV blocks
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def completion(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}


def answered(server, body: dict, want: list[int]) -> bool:
    """Whether a completion generated the ids ``want``: as many tokens, the same text."""
    text = server.built.model.tokenizer.decode(want, skip_special_tokens=True)
    return body["usage"]["completion_tokens"] == len(want) and body["choices"][0]["text"] == text


def wait_idle(server, seconds: float = 60) -> None:
    engine = server.built.engine
    deadline = time.monotonic() + seconds
    while engine.num_requests or engine.blocks.num_used:
        assert time.monotonic() < deadline, (engine.num_requests, engine.blocks.num_used)
        time.sleep(0.02)


def test_models_lists_each_adapter_with_the_base_as_parent(client, lora):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["base", *ADAPTERS]
    assert data[0]["parent"] is None
    for m in data[1:]:
        assert m["parent"] == "base" and m["root"] == str(lora.paths[m["id"]])


def test_concurrent_requests_of_every_adapter_match_transformers_peft(server, lora):
    """Base and three adapters at once over two slots: every answer is its own reference (the
    requests whose adapter finds every slot pinned wait, then run)."""
    for name in ADAPTERS:
        assert any(lora.expected[name][i][0] != lora.expected[None][i][0] for i in range(2))
        assert min(g for _, g in lora.expected[name]) > 1e-5

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            jobs = [(name, i) for _ in range(2) for name in ["base", *ADAPTERS] for i in range(2)]
            answers = await asyncio.gather(*(c.post("/v1/completions", json=completion(n, lora.prompts[i]))
                                             for n, i in jobs))
            return jobs, answers

    jobs, answers = asyncio.run(run())
    for (name, i), r in zip(jobs, answers, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == name
        want = lora.expected[None if name == "base" else name][i][0]
        assert answered(server, body, want), (name, i, body["choices"][0]["text"])
    wait_idle(server)
    assert server.built.runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0, "lora_pins": 0}


def test_chat_and_responses_take_an_adapter_by_model(client):
    msg = [{"role": "user", "content": "hello"}]
    r = client.post("/v1/chat/completions", json={"model": "qv8", "messages": msg, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "qv8"
    r = client.post("/v1/responses", json={"model": "all4", "input": "hello", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "all4"


def test_an_adapters_projected_time_counts_its_modules(client, lora):
    """usage.spyre prices the adapter's shrink and expand on a real card: the same prompt
    costs more with an adapter than without, and more with seven modules than with two."""
    prompt = lora.prompts[1]
    # each computes the whole prompt (a salt of its own: no prefix another test cached)
    projected = {m: client.post("/v1/completions", json={**completion(m, prompt), "max_tokens": 2,
                                                          "cache_salt": f"projected-{m}"}
                                ).json()["usage"]["spyre"]["projected_seconds"]
                 for m in ("base", "qv8", "all4")}
    assert projected["base"] < projected["qv8"] < projected["all4"], projected


def test_an_unknown_model_is_a_404_and_changes_nothing(client, server, lora):
    used = server.built.engine.blocks.num_used
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json=body)
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["message"].startswith("The model `nope` does not exist.") and err["code"] == 404
        assert err["param"] == "model"
    assert server.built.engine.blocks.num_used == used


def test_runtime_load_and_unload(client, server, lora):
    # a rank over --max-lora-rank: 400, nothing loaded (under the --lora-modules' directory: allowed)
    big = lora.paths["runtime"].parent / "big"
    shutil.copytree(lora.paths["runtime"], big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32}))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and "rank 32 is greater than max_lora_rank 16" in r.json()["error"]["message"]
    # broken files: 400 naming the problem
    broken = lora.paths["runtime"].parent / "broken"
    broken.mkdir()
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    shutil.copy(lora.paths["runtime"] / "adapter_model.safetensors", broken)
    (broken / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json=completion("big", lora.prompts[0])).status_code == 404
    # a good one: served at once, as transformers + peft answer
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": str(lora.paths["runtime"])})
    assert r.status_code == 200, r.text
    assert "runtime" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": str(lora.paths["runtime"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=completion("runtime", lora.prompts[1]))
    assert r.status_code == 200, r.text
    assert answered(server, r.json(), lora.expected["runtime"][1][0])
    # unloaded while a stream of it runs: the stream ends as it would have; then it is gone
    # from the list, a 404 to use, a 404 to unload again
    first = threading.Event()

    def stream() -> list:
        body = {**completion("runtime", lora.prompts[0]), "max_tokens": 60, "stream": True}
        with httpx.Client(base_url=server.url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()
            return chunks

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        assert first.wait(60)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}).status_code == 200
        chunks = running.result(120)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "error" not in chunks[-1]
    assert "runtime" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post("/v1/completions", json=completion("runtime", lora.prompts[1])).status_code == 404
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    wait_idle(server)
    assert server.built.runner.held()["lora_pins"] == 0


def test_runtime_updates_are_off_without_allow_runtime_lora(server, lora):
    from fastapi.testclient import TestClient

    from spyre_serve.server.openai.app import create_app

    built = server.built
    app = create_app(built.engine, built.model, real_settings(**lora_settings(lora, allow_runtime_lora=False)))
    with TestClient(app) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
        assert r.status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "qv8"}).status_code == 404
        assert "qv8" in [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert "/v1/load_lora_adapter" not in c.get("/openapi.json").json()["paths"]


def test_openapi_declares_the_runtime_routes_bodies(client):
    doc = client.get("/openapi.json").json()
    for path, name, fields in [("/v1/load_lora_adapter", "LoadLoRAAdapterRequest", {"lora_name", "lora_path"}),
                               ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest", {"lora_name", "lora_int_id"})]:
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        assert set(doc["components"]["schemas"][name]["properties"]) == fields
        assert {"400", "401", "500"} <= set(post["responses"])


def test_prefix_cache_blocks_are_never_shared_across_adapters(client, server, lora):
    """A prompt no test sent before, under the base twice then an adapter twice: the second of
    each model reads the first's blocks from the cache, the adapter's first reads none of the
    base's, and every answer is its model's own."""
    stats = server.built.engine.blocks.stats
    hits = []
    for name in ("base", "base", "mlp16", "mlp16"):
        before = stats.hits
        r = client.post("/v1/completions", json=completion(name, lora.prompts[2]))
        assert r.status_code == 200, r.text
        assert answered(server, r.json(), lora.expected[None if name == "base" else name][2][0]), name
        hits.append(stats.hits - before)
    assert hits == [0, 32, 0, 32]      # two full 16-token blocks of the 40-token prompt
    wait_idle(server)


def test_the_engine_in_its_own_process_serves_and_loads_adapters(lora):
    """serve's default: adapters at start and loaded at run time reach the engine process's
    card through its pipe, answering as transformers + peft do."""
    with running_server(engine_process=True, **lora_settings(lora)) as s, \
            httpx.Client(base_url=s.url, timeout=600) as c:
        r = c.post("/v1/completions", json=completion("all4", lora.prompts[0]))
        assert r.status_code == 200 and answered(s, r.json(), lora.expected["all4"][0][0]), r.text
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": str(lora.paths["runtime"])})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=completion("runtime", lora.prompts[0]))
        assert r.status_code == 200 and answered(s, r.json(), lora.expected["runtime"][0][0]), r.text
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(lora.base)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}).status_code == 200
        assert c.post("/v1/completions", json=completion("runtime", lora.prompts[0])).status_code == 404


def test_a_bad_adapter_at_start_is_refused_naming_it(lora, tmp_path):
    from spyre_serve.server.launch.cli import build

    with pytest.raises(ValueError, match="--lora-modules bad=.*adapter_config.json"):
        build(real_settings(**lora_settings(lora, lora_modules={"bad": str(tmp_path)})), progress=False)


def test_a_request_waiting_for_an_adapter_slot_lets_the_ones_behind_it_pass(server, lora):
    """Two long streams hold both slots; a request of the third adapter waits for one, and a
    base request sent after it runs and answers meanwhile (vLLM skips it; no head-of-line wait)."""
    names = list(ADAPTERS)
    engine = server.built.engine

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            long = [asyncio.create_task(c.post("/v1/completions", json={**completion(n, lora.prompts[0]),
                                                                        "max_tokens": 200})) for n in names[:2]]
            while engine.num_running_requests < 2:
                await asyncio.sleep(0.005)
            third = asyncio.create_task(c.post("/v1/completions", json=completion(names[2], lora.prompts[1])))
            while engine.num_waiting_requests < 1:
                await asyncio.sleep(0.005)
            deadline = time.monotonic() + 30       # the engine takes it from its inbox, then publishes
            while f'waiting_lora_adapters="{names[2]}"' not in (metrics := (await c.get("/metrics")).text):
                assert time.monotonic() < deadline and not third.done(), metrics[-2000:]
                await asyncio.sleep(0.01)
            base = await c.post("/v1/completions", json=completion("base", lora.prompts[1]))
            passed = not third.done() and not any(t.done() for t in long)
            return base, passed, metrics, await third, await asyncio.gather(*long)

    base, passed, metrics, third, long = asyncio.run(run())
    assert passed, "the base request should have answered while the third adapter's waited"
    # vLLM's vllm:lora_requests_info, which the Inference Extension reads for adapter affinity
    [info] = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert ('max_lora="2"' in info and f'running_lora_adapters="{",".join(sorted(names[:2]))}"' in info
            and f'waiting_lora_adapters="{names[2]}"' in info), info
    assert answered(server, base.json(), lora.expected[None][1][0])
    assert answered(server, third.json(), lora.expected[names[2]][1][0])
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200 for r in long)
    wait_idle(server)
