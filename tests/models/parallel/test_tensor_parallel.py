"""Tensor parallelism on emulated cards (models/parallel/shards.py, models/parallel/runner.py): a checkpoint
sharded over 2 and 4 cards, each card its own arena and stream, the step run in parts with
all-reduces and a logits all-gather between them, gives the greedy tokens one card gives and
logits within float32 summation order of its; a failure on one card fails the step."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, load_model
from spyre_serve.models.checkpoints.hf import load_checkpoint
from spyre_serve.models.parallel.runner import TensorParallelRunner, load_sharded
from spyre_serve.models.parallel.shards import shard_tensors, vocab_shard
from tests.models.hf_checkpoints import runner_greedy, write_granite_checkpoint

PROMPTS = [[5, 9, 33, 2, 14, 200, 7], [7, 1], list(range(40, 75)), [250, 3, 300, 12]]
SIZES = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_kv_blocks=24, max_model_len=128)


@pytest.fixture(scope="module", params=["granite", "llama"])
def model_dir(request, tmp_path_factory):
    # 8 query heads, 2 KV heads (split at tp 2, replicated at tp 4), vocab 301 (uneven shards)
    return write_granite_checkpoint(tmp_path_factory.mktemp(request.param), vocab=301, hidden=128, layers=3,
                                    heads=8, kv_heads=2, intermediate=192, tie=request.param == "granite",
                                    llama=request.param == "llama", init_std=0.2)


@pytest.fixture(scope="module")
def one_card(model_dir):
    card = Card(64 << 20)
    runner = ModelRunner(load_model(model_dir, card, tokenizer=False), card, **SIZES)
    logits, tokens = runner_greedy(runner, PROMPTS, 8)
    runner.close()
    card.close()
    return logits, tokens


@contextlib.contextmanager
def tp_runner(model_dir, tp: int):
    """A TensorParallelRunner over tp cards of the checkpoint, closed with its cards after."""
    cards = [Card(32 << 20) for _ in range(tp)]
    full, models = load_sharded(model_dir, cards, tokenizer=False)
    runner = TensorParallelRunner(models, cards, full, **SIZES)
    try:
        yield runner
    finally:
        runner.close()
        for card in cards:
            card.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_equal_one_cards(model_dir, one_card, tp):
    with tp_runner(model_dir, tp) as runner:
        logits, tokens = runner_greedy(runner, PROMPTS, 8)
        assert tokens == one_card[1]
        for i in range(len(PROMPTS)):
            np.testing.assert_allclose(logits[i], one_card[0][i], rtol=1e-4, atol=1e-4)
        assert runner.numerics.endswith(f"tp={tp}") and runner.held() == {"prompt_logprob_rows": 0,
                                                                            "penalty_slots": 0}


def test_each_card_holds_its_shard(model_dir):
    ckpt = load_checkpoint(model_dir)
    cfg, tensors = shard_tensors(ckpt.config, ckpt.tensors, 1, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 1, 96)
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"], q[4 * 16:8 * 16])
    down = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.down_proj.weight"], down[:, 96:])
    assert vocab_shard(301, 3, 4) == (228, 301) and tensors["lm_head.weight"].shape == (150, 128)
    _, four = shard_tensors(ckpt.config, ckpt.tensors, 3, 4)       # 2 KV heads over 4 cards: the one read
    k = ckpt.tensors["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(four["model.layers.0.self_attn.k_proj.weight"], k[16:32])


def test_a_failure_on_one_card_fails_the_step(model_dir):
    from spyre_serve.models import SamplingParams, SeqWork

    with tp_runner(model_dir, 2) as runner:
        def boom(*_):
            raise RuntimeError("card 1 fault")
        runner.runners[1].stream.enqueue(boom, label="fault")
        handle = runner.launch([SeqWork(0, [5, 6, 7], 0, [0], True, SamplingParams(temperature=0.0))])
        with pytest.raises(Exception, match="card 1 fault"):
            handle.result()


def test_a_part_that_fails_on_one_card_breaks_the_others_wait(model_dir, monkeypatch):
    from spyre_serve.models import SamplingParams, SeqWork
    from spyre_serve.models.parallel import runner as tp_module

    calls = {"n": 0}
    real = tp_module._sum_over_cards

    def fail_third(ys):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("all-reduce fault")
        real(ys)
    monkeypatch.setattr(tp_module, "_sum_over_cards", fail_third)
    with tp_runner(model_dir, 2) as runner:
        handle = runner.launch([SeqWork(0, [5, 6, 7], 0, [0], True, SamplingParams(temperature=0.0))])
        with pytest.raises(Exception, match="all-reduce fault|Broken"):
            handle.result()


def test_proposals_verified_over_two_cards_keep_one_cards_tokens(model_dir, one_card):
    """Speculative decoding over cards: each sequence proposes the tokens one card chose (all
    kept), or wrong ones (none kept); the tokens are one card's either way."""
    from tests.models.step.test_speculative import generate

    want = one_card[1]
    with tp_runner(model_dir, 2) as runner:
        for propose in (lambda i, o: want[i][len(o):len(o) + 3],
                        lambda i, o: [(t + 1) % 301 for t in want[i][len(o):len(o) + 2]]):
            got, _, history = generate(runner, PROMPTS, 8, [SamplingParams(temperature=0.0)] * len(PROMPTS), propose)
            assert got == want and history
