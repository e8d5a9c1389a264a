"""Weights on the card, in the layout the kernels want."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models.checkpoints.hf import load_checkpoint
from spyre_serve.models.checkpoints.loader import load_model
from spyre_serve.models.step.weights import COL_K_CACHE, COL_QKV, LAYER_FIELDS, build_layer_table
from tests.models.hf_checkpoints import write_granite_checkpoint


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("w_untied"), vocab=256, hidden=64,
                                    layers=2, heads=4, kv_heads=2, tie=False, init_std=0.2)


def test_qkv_is_fused_and_transposed(untied):
    card = Card(64 << 20)
    t = load_checkpoint(untied).tensors
    w = load_model(untied, card, tokenizer=False).weights
    qkv = w.layers[1].qkv.numpy()                                   # [H, QD + 2 KD]
    p = "model.layers.1.self_attn."
    want = np.concatenate([t[p + "q_proj.weight"].T, t[p + "k_proj.weight"].T,
                           t[p + "v_proj.weight"].T], axis=1)
    assert qkv.shape == (64, 64 + 2 * 32)
    np.testing.assert_array_equal(qkv, want)


def test_gate_up_is_fused_and_down_and_o_are_transposed(untied):
    card = Card(64 << 20)
    t = load_checkpoint(untied).tensors
    lw = load_model(untied, card, tokenizer=False).weights.layers[0]
    p = "model.layers.0."
    np.testing.assert_array_equal(lw.gate_up.numpy(), np.concatenate(
        [t[p + "mlp.gate_proj.weight"].T, t[p + "mlp.up_proj.weight"].T], axis=1))
    np.testing.assert_array_equal(lw.down.numpy(), t[p + "mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(lw.o.numpy(), t[p + "self_attn.o_proj.weight"].T)


def test_untied_lm_head_is_transposed(untied):
    card = Card(64 << 20)
    t = load_checkpoint(untied).tensors
    w = load_model(untied, card, tokenizer=False).weights
    assert not w.tied
    np.testing.assert_array_equal(w.lm_head.numpy(), t["lm_head.weight"].T)   # [H, V]


def test_tied_lm_head_is_the_embedding_itself(tmp_path):
    path = write_granite_checkpoint(tmp_path, vocab=256, hidden=64, layers=1, tie=True)
    card = Card(64 << 20)
    w = load_model(path, card, tokenizer=False).weights
    assert w.tied and w.lm_head.address == w.embed.address


def test_bf16_weights_are_widened_exactly(tmp_path):
    path = write_granite_checkpoint(tmp_path, vocab=256, hidden=64, layers=1, tie=False,
                                    dtype="bfloat16", init_std=0.2)
    card = Card(64 << 20)
    m = load_model(path, card, tokenizer=False)
    assert m.stored_dtype == "bfloat16"
    emb = m.weights.embed.numpy()
    assert np.all(emb.view(np.uint32) & 0xFFFF == 0)                # low 16 bits: zero
    assert np.abs(emb).max() > 0


def test_layer_table_holds_each_layers_addresses(untied):
    card = Card(64 << 20)
    w = load_model(untied, card, tokenizer=False).weights
    k = [card.empty((4,), np.float32) for _ in range(2)]
    v = [card.empty((4,), np.float32) for _ in range(2)]
    table = build_layer_table(card, w, k, v).numpy()
    assert table.shape == (2, LAYER_FIELDS)
    assert table[1, COL_QKV] == w.layers[1].qkv.address
    assert table[0, COL_K_CACHE] == k[0].address


def test_weights_on_a_card_too_small_are_refused_and_freed(untied):
    from spyre_serve.device import DeviceOutOfMemory

    card = Card(200 << 10)
    with pytest.raises(DeviceOutOfMemory):
        load_model(untied, card, tokenizer=False)
    assert card.allocator.stats().allocated == 0
