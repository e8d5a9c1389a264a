"""A Granite 4.0 hybrid model (Mamba-2 mixers, attention without positions, experts beside the
shared MLP), written by transformers, served through uvicorn: concurrent greedy completions equal
transformers' token for token, twice on the same server; an abort in the middle of a long
prefill and preemption under a small KV cache leave the answers and the slots intact; what it is
not served with is refused at start; the same model converted to GGUF as llama.cpp converts it
(tokenizer and chat template in the file) answers the same text over HTTP."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import numpy as np
import pytest
import torch

from spyre_serve.server.spec_decode.proposals import SpeculativeConfig
from tests.models.hf_checkpoints import write_hybrid_checkpoint
from tests.server.servers import ServerThread, http_client, real_settings

LAYERS = dict(layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4, num_experts_per_tok=2,
              position_embedding_type="nope")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"), vocab=8192, with_tokenizer=True, **LAYERS)


def served(path, **settings):
    from spyre_serve.server.launch.cli import build

    return build(real_settings(**{"model": str(path), "max_num_seqs": 8, "num_kv_blocks": 128, **settings}),
                 progress=False)


@pytest.fixture(scope="module")
def server(hybrid):
    built = served(hybrid[0])
    with ServerThread(built.app) as s:
        s.built = built
        yield s
    built.engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    yield from http_client(server)


def reference_ids(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def reference(model, prompt: list[int], n: int, tokenizer) -> tuple[int, str]:
    """transformers' greedy tokens as a completion answers them: their count and their text."""
    return n, tokenizer.decode(reference_ids(model, prompt, n), skip_special_tokens=True)


def complete(client, prompt: list[int], n: int) -> tuple[int, str]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["text"]


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8192, n).tolist() for n in lengths]


def test_concurrent_completions_equal_transformers_twice(client, hybrid, server):
    model, tok = hybrid[1], server.built.model.tokenizer
    # 7 tokens; 40 (under transformers' 32-token SSD chunk x 2); 150: three of the server's
    # 64-token chunks, interleaved with the others' decodes
    batch = prompts(1, (7, 40, 150, 90))
    assert all(len(set(reference_ids(model, p, 10))) > 3 for p in batch)       # varied references
    want = [reference(model, p, 10, tok) for p in batch]
    for _ in range(2):                                   # the second round reuses every state slot
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(client, p, 10), batch))
        assert got == want
    assert not server.built.engine.blocks.enable_caching        # prefix caching off for the hybrid
    assert len(server.built.runner._state_slots) == 0            # every sequence's slot given back


def test_an_abort_in_the_middle_of_a_long_prefill_frees_everything(client, hybrid, server, monkeypatch):
    engine, runner = server.built.engine, server.built.runner
    long = prompts(2, (600,))[0]
    launch, reached = runner.launch, []

    def slow_launch(work, *args, **kwargs):         # 0.1 s a step: ten chunks take a second
        reached.extend(w.start_pos + len(w.token_ids) for w in work)
        time.sleep(0.1)
        return launch(work, *args, **kwargs)

    monkeypatch.setattr(runner, "launch", slow_launch)
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(600, read=0.35)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": long, "max_tokens": 50, "ignore_eos": True})
    monkeypatch.setattr(runner, "launch", launch)
    deadline = time.monotonic() + 120
    while engine.num_requests or engine.blocks.num_free != engine.blocks.num_blocks:
        assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
        time.sleep(0.05)
    assert len(runner._state_slots) == 0
    assert 0 < max(reached) < len(long)                # it was aborted in its prefill
    p = prompts(3, (30,))[0]
    assert complete(client, p, 6) == reference(hybrid[1], p, 6, server.built.model.tokenizer)


def test_preempted_sequences_recompute_their_states_and_answer_the_same(hybrid):
    """A KV cache of 10 blocks (160 tokens) for four sequences of 70 tokens each: the scheduler
    preempts, and a preempted sequence recomputes from position 0 with fresh states."""
    built = served(hybrid[0], num_kv_blocks=10)
    try:
        with ServerThread(built.app) as s:
            with httpx.Client(base_url=s.url, timeout=600) as c:
                batch = prompts(4, (40, 40, 40, 40))
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    got = list(pool.map(lambda p: complete(c, p, 30), batch))
        assert built.engine.scheduler.num_preemptions > 0
        assert got == [reference(hybrid[1], p, 30, built.model.tokenizer) for p in batch]
    finally:
        built.engine.shutdown()


@pytest.mark.parametrize("flags,why", [
    (dict(speculative_config=SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')), "rolled back"),
    (dict(tensor_parallel_size=2, device_memory=256 << 20), "not sharded yet"),
    (dict(enable_lora=True), "attention and MLP projections"),
])
def test_what_it_is_not_served_with_is_refused_at_start(hybrid, flags, why):
    with pytest.raises(ValueError, match=why):
        served(hybrid[0], **flags)


def test_the_plan_sizes_a_hybrid_on_one_card_and_refuses_to_shard_it(hybrid):
    import io

    from spyre_serve.server.launch.plan import plan

    out = io.StringIO()
    assert plan(real_settings(model=str(hybrid[0])), out=out) == 0, out.getvalue()
    assert "weights" in out.getvalue() and "TTFT" in out.getvalue()
    out = io.StringIO()
    assert plan(real_settings(model=str(hybrid[0]), tensor_parallel_size=2), out=out) == 1
    assert "not sharded yet" in out.getvalue()


def test_answers_carry_the_real_cards_clock_of_the_mamba_layers_and_experts(client):
    r = client.post("/v1/completions", json={"prompt": prompts(5, (20,))[0], "max_tokens": 3, "temperature": 0})
    spyre = r.json()["usage"]["spyre"]
    assert spyre["projected_seconds"] > 0 and spyre["projected_ttft_seconds"] > 0


@pytest.fixture(scope="module")
def gguf_client(hybrid, tmp_path_factory):
    from tests.models.gguf_files import write_hybrid_gguf

    path = tmp_path_factory.mktemp("hybrid-gguf") / "granite-4-hybrid.gguf"
    write_hybrid_gguf(path, hybrid[1], hybrid[0], tokenizer_dir=hybrid[0])
    built = served(path)
    with ServerThread(built.app) as s:
        yield from http_client(s)
    built.engine.shutdown()


def test_the_gguf_file_serves_the_text_the_checkpoint_serves(client, gguf_client):
    """issue 35: the GGUF (tokenizer and chat template read from the file) against the checkpoint
    directory it was converted from, greedy, over HTTP: the same completions and the same chat."""
    for prompt in ("The river", "Once upon a time in a small village by the sea, there lived"):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        want = client.post("/v1/completions", json=body).json()
        got = gguf_client.post("/v1/completions", json=body).json()
        assert len(set(want["choices"][0]["text"].split())) > 3, want     # varied text, not one token repeated
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
        assert got["usage"] == {**want["usage"], "spyre": got["usage"]["spyre"]}
    chat = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 10, "temperature": 0}
    want = client.post("/v1/chat/completions", json=chat).json()
    got = gguf_client.post("/v1/chat/completions", json=chat).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
