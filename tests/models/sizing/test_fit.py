"""models/sizing/fit.py: the bytes `spyre-serve plan` counts from a config alone are the bytes the runner
places (weights in each width, step buffers, KV blocks), and tensor-parallel shards split as
the plugin splits them."""

from __future__ import annotations

import dataclasses

import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, load_model
from spyre_serve.models.sizing.fit import (
    capacity,
    card_config,
    gemm_bytes,
    granite_33_8b,
    kv_token_bytes,
    plan_fit,
    scratch_bytes,
    weight_bytes,
)
from spyre_serve.models.step.kv_cache import block_bytes
from tests.models.hf_checkpoints import granite_config, write_granite_checkpoint


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("fit"), vocab=300, hidden=128, layers=2,
                                    heads=4, kv_heads=2, tie=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_weights_and_buffers_are_what_the_runner_places(small_granite_dir, untied_dir, dtype, which):
    card = Card(256 << 20)
    model = load_model(small_granite_dir if which == "tied" else untied_dir, card, tokenizer=False, dtype=dtype)
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=48, block_size=16,
                         num_kv_blocks=20, max_model_len=200)
    try:
        cfg = model.config
        assert weight_bytes(cfg, dtype) == model.weights.nbytes
        assert scratch_bytes(cfg, capacity(cfg, 4, 48, 200, 16)) == runner.scratch_bytes
        assert runner.kv.nbytes == (20 + 1) * block_bytes(cfg, 16, runner.kv_cache_dtype)
        assert kv_token_bytes(cfg, runner.kv_cache_dtype) * 16 == block_bytes(cfg, 16, runner.kv_cache_dtype)
    finally:
        runner.close()
        card.close()


@pytest.mark.parametrize("kind", ["hybrid", "granitemoe"])
def test_a_hybrids_and_an_moes_weights_and_states_are_what_the_runner_places(tmp_path, kind):
    """Granite 4.0's layers (Mamba-2 mixers, experts beside the shared MLP) and Granite MoE's
    experts alone: the plan's bytes are the runner's, its states counted with its buffers."""
    from tests.models.hf_checkpoints import write_hybrid_checkpoint, write_moe_checkpoint

    if kind == "hybrid":
        path, _ = write_hybrid_checkpoint(tmp_path, layer_types=["mamba", "attention", "mamba"],
                                          num_local_experts=4, num_experts_per_tok=2)
    else:
        path, _ = write_moe_checkpoint(tmp_path, shared=False)
    card = Card(256 << 20)
    model = load_model(path, card, tokenizer=False, dtype="bfloat16")
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=48, block_size=16,
                         num_kv_blocks=20, max_model_len=200)
    try:
        cfg = model.config
        assert weight_bytes(cfg, "bfloat16") == model.weights.nbytes
        assert scratch_bytes(cfg, capacity(cfg, 4, 48, 200, 16)) == runner.scratch_bytes
        assert runner.kv.nbytes == (20 + 1) * block_bytes(cfg, 16, runner.kv_cache_dtype)
        assert len(runner.kv.k) == len(cfg.attention_layers)
    finally:
        runner.close()
        card.close()


def test_tensor_parallel_shards_by_heads_columns_rows_and_vocabulary():
    cfg = granite_config(vocab=301, hidden=128, layers=3, heads=8, kv_heads=2, intermediate=96, tie=True)
    d = 16
    # tp 2: 4 q heads and 1 KV head a card, 48 of the MLP, 151 vocabulary rows (301 padded)
    layer = (gemm_bytes(128, (4 + 2) * d, "float16") + gemm_bytes(4 * d, 128, "float16")
             + gemm_bytes(128, 96, "float16") + gemm_bytes(48, 128, "float16") + 2 * 4 * 128)
    assert weight_bytes(cfg, "float16", 2) == gemm_bytes(128, 151, "float16") + 3 * layer + 4 * 128
    # tp 4 > 2 KV heads: each card keeps one (replicated)
    assert card_config(cfg, 4).num_key_value_heads == 1 and card_config(cfg, 4).num_attention_heads == 2
    assert kv_token_bytes(cfg, "float16", 4) == kv_token_bytes(cfg, "float16", 2) == 2 * 3 * 1 * d * 2
    with pytest.raises(ValueError, match="num_attention_heads \\(8\\) is not divisible by --tensor-parallel-size 3"):
        weight_bytes(cfg, "float16", 3)
    with pytest.raises(ValueError, match="intermediate_size \\(100\\) is not divisible"):
        weight_bytes(dataclasses.replace(cfg, intermediate_size=100), "float16", 8)


def test_granite_33_8b_plan_by_hand():
    cfg = granite_33_8b()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (40, 4096, 8, 49159)
    fit = plan_fit(cfg, dtype="float16", kv_dtype="float16", tp=1, max_num_seqs=16, max_num_batched_tokens=512,
                   max_model_len=3072, block_size=64)
    assert fit.kv_token_bytes == 2 * 40 * 8 * 128 * 2                       # 160 KiB a token
    assert fit.kv_cache == (16 * 3072 // 64 + 1) * 64 * fit.kv_token_bytes
    assert 16.2e9 < fit.weights < 16.5e9                                     # 8.17B parameters x 2 bytes
    assert fit.fits and fit.left == fit.usable - fit.weights - fit.kv_cache - fit.scratch
    four = plan_fit(cfg, dtype="float16", kv_dtype="float16", tp=4, max_num_seqs=32, max_num_batched_tokens=512,
                    max_model_len=32768, block_size=64)
    assert four.kv_token_bytes == fit.kv_token_bytes // 4 and four.weights < fit.weights / 3.9
