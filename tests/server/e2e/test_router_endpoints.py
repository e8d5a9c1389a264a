"""What a router in front of replicas reads of one, on the real server: the render endpoints give
the token ids the generation endpoints run (vllm-router's cache_aware matches prompts by them),
the model and server information, the load, and the metrics the Inference Extension reads."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.servers import PROMPT

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


def test_completion_render_gives_each_prompts_token_ids_as_the_completion_counts_them(client):
    prompts = [PROMPT, "Another prompt"]
    rendered = client.post("/v1/completions/render", json={"prompt": prompts, "max_tokens": 4})
    assert rendered.status_code == 200, rendered.text
    items = rendered.json()
    assert [item["model"] for item in items] == ["granite-tiny"] * 2
    ids = client.post("/v1/completions/render", json={"prompt": [[5, 6, 7], [8]]}).json()
    assert [item["token_ids"] for item in ids] == [[5, 6, 7], [8]]
    for item, prompt in zip(items, prompts, strict=True):
        done = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
        assert len(item["token_ids"]) == done["usage"]["prompt_tokens"]
    assert items[0]["token_ids"] == client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def test_chat_render_gives_the_templated_prompt_the_chat_runs(client):
    body = {"messages": MESSAGES, "max_tokens": 1}
    rendered = client.post("/v1/chat/completions/render", json=body).json()
    assert rendered["token_ids"] == client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert len(rendered["token_ids"]) == client.post("/v1/chat/completions", json=body).json()["usage"][
        "prompt_tokens"]


def test_render_submits_nothing_and_refuses_what_the_generation_refuses(client, real_server):
    engine = real_server.built.engine
    steps = engine.stats.steps
    for _ in range(3):
        assert client.post("/v1/completions/render", json={"prompt": PROMPT}).status_code == 200
    assert engine.stats.steps == steps and engine.num_requests == 0
    bad = client.post("/v1/completions/render", json={"prompt": [[10**9]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    bad = client.post("/v1/chat/completions/render", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_model_and_server_information(client):
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["served_model_name"] == "granite-tiny" and info["is_generation"] is True
        assert info["max_model_len"] == 1024
    for path in ("/get_server_info", "/server_info"):
        info = client.get(path).json()
        assert (info["kv_block_size"], info["max_num_seqs"], info["tp_size"]) == (16, 32, 1)


def test_load_counts_the_requests_the_engine_holds(real_server):
    async def main():
        async with httpx.AsyncClient(base_url=real_server.url, timeout=600) as c:
            idle = (await c.get("/get_load")).json(), (await c.get("/load")).json()
            body = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}
            running = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(3)]
            seen = 0
            while not all(t.done() for t in running):
                seen = max(seen, (await c.get("/get_load")).json()["load"])
                await asyncio.sleep(0.01)
            return idle, seen, (await c.get("/load")).json()

    (idle_sglang, idle_vllm), seen, after = asyncio.run(main())
    assert idle_sglang == {"load": 0} and idle_vllm == {"server_load": 0} and after == {"server_load": 0}
    assert 1 <= seen <= 3


def metric_lines(client, name: str) -> list[str]:
    return [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]


def test_cache_config_info_names_the_block_size_and_blocks(client):
    [line] = metric_lines(client, "vllm:cache_config_info")
    assert 'block_size="16"' in line and 'num_gpu_blocks="256"' in line and line.endswith(" 1.0")
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert metric_lines(client, name), name


@pytest.mark.parametrize("path", ["/get_model_info", "/get_server_info", "/v1/completions/render"])
def test_the_information_is_behind_the_api_key_and_the_load_is_not(side_app_with_key, path):
    c = side_app_with_key
    r = c.post(path, json={"prompt": "x"}) if path.startswith("/v1") else c.get(path)
    assert r.status_code == 401
    assert c.get("/load").status_code == 200 and c.get("/get_load").status_code == 200


@pytest.fixture(scope="module")
def side_app_with_key(real_server):
    from spyre_serve.server.launch.settings import Settings
    from spyre_serve.server.openai.app import create_app
    from tests.server.servers import ServerThread

    built = real_server.built
    with ServerThread(create_app(built.engine, built.model, Settings(api_key="sesame"))) as server:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            yield c
