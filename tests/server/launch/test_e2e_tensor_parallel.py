"""`serve --tensor-parallel-size 2` and `4` through the HTTP API: granite-tiny sharded over
emulated cards answers greedily what one card answers, and says so in its fingerprint."""

from __future__ import annotations

import httpx
import pytest

from tests.server.servers import PROMPT, ServerThread, real_settings


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_answers_equal_one_cards(client, tp):
    from spyre_serve.server.launch.cli import build

    built = build(real_settings(tensor_parallel_size=tp, device_memory=256 << 20, num_kv_blocks=64), progress=False)
    bodies = [{"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
              {"prompt": ["The sky is", "Once upon a time"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}]
    try:
        assert built.runner.tp == tp and len(built.runner.cards) == tp
        with ServerThread(built.app) as server, httpx.Client(base_url=server.url, timeout=600) as c:
            for body in bodies:
                got, want = c.post("/v1/completions", json=body), client.post("/v1/completions", json=body)
                assert got.status_code == want.status_code == 200, got.text
                assert [ch["text"] for ch in got.json()["choices"]] == [ch["text"] for ch in want.json()["choices"]]
                assert got.json()["system_fingerprint"].endswith(f"tp={tp}")
            chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 6, "temperature": 0})
            assert chat.status_code == 200
            metrics = c.get("/metrics").text
        # each card its own series, and spyre-smi a line for each
        from spyre_torch.smi import parse_metrics

        cards = parse_metrics(metrics, 0.0)
        assert len(cards) == tp and all(card.launches > 0 and card.mem_used > 0 for card in cards)
        assert f'spyre_compiles_after_warmup{{card="{tp - 1}",model_name="granite-tiny"}} 0.0' in metrics
    finally:
        built.engine.shutdown()
        built.runner.close()


def test_what_tensor_parallelism_does_not_take_is_refused_at_start():
    from spyre_serve.server.launch.cli import build

    with pytest.raises(ValueError, match="--runner pooling"):
        build(real_settings(tensor_parallel_size=2, runner="pooling"), progress=False)
    with pytest.raises(ValueError, match="num_attention_heads \\(8\\) is not divisible by --tensor-parallel-size 3"):
        build(real_settings(tensor_parallel_size=3), progress=False)
