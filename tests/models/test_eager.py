"""The eager baseline (models/eager.py): the program path's tokens, one freshly prepared
program per op, nothing kept between steps."""

from __future__ import annotations

import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from spyre_serve.models.eager import EagerModel
from tests.models.hf_checkpoints import write_granite_checkpoint

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("eager"), vocab=256, hidden=128,
                                    layers=2, heads=4, kv_heads=1, tie=request.param,
                                    init_std=None if request.param else 0.2)


@pytest.fixture()
def pair(model_dir):
    card = Card(128 << 20)
    model = load_model(model_dir, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=64,
                         block_size=BLOCK, num_kv_blocks=16, seed=0)
    eager = EagerModel(model, card, block_size=BLOCK, num_kv_blocks=16)
    yield runner, eager
    eager.close()
    runner.close()
    card.close()


def work(seq_id, ids, start, blocks, sample=True):
    return SeqWork(seq_id, ids, start, blocks, sample, GREEDY)


def test_chunked_prefill_and_mixed_decode_give_the_runners_tokens(pair):
    runner, eager = pair
    a = [5, 17, 3, 99, 42, 8, 1, 250, 77, 13, 6, 200, 31, 9, 64, 2, 18, 111, 4, 70]   # 20 tokens
    b = [7, 3, 140, 60]
    steps = [
        [work(0, a[:12], 0, [0, 1], sample=False), work(1, b, 0, [2])],   # chunk 1 of a; b whole
        [work(0, a[12:], 12, [0, 1])],                                    # chunk 2 of a samples
    ]
    got, want = [], []
    for step in steps:
        want.append(runner.launch(step).result().token_ids.tolist())
        got.append(eager.step(step).tolist())
    ta, tb = want[1][0], want[0][0]
    for k in range(6):                                                    # both decode together
        step = [work(0, [ta], len(a) + k, [0, 1]), work(1, [tb], len(b) + k, [2])]
        w = runner.launch(step).result().token_ids.tolist()
        want.append(w)
        got.append(eager.step(step).tolist())
        ta, tb = w
    assert got == want
    if not eager.weights.tied:   # a small random tied Granite repeats itself (docs/design.md)
        assert len({t for s in want for t in s}) > 3                      # varied output


def test_each_op_is_a_new_program_prepared_and_launched_once(pair):
    _, eager = pair
    card = eager.card
    eager.step([work(0, [1, 2, 3], 0, [0])])
    before, mem = card.counters.snapshot(), card.allocator.stats().allocated
    eager.step([work(0, [4], 3, [0])])
    after = card.counters.snapshot()
    ops = 1 + 14 * eager.config.num_hidden_layers + 5        # embedding, 14 per layer, head + sample
    assert after["prepares"] - before["prepares"] == ops
    assert after["launches"] - before["launches"] == ops
    assert after["compiles"] == before["compiles"]
    assert card.allocator.stats().allocated == mem                        # tables and intermediates freed
