"""A decoder checkpoint served as an embedding model (`ModelRunner(pooling=...)`, the server's
`--runner pooling`): each prompt's final hidden states (after the last RMSNorm) pooled on the
card equal transformers' `last_hidden_state` pooled the same way, batched and alone."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from spyre_serve.models.step.interface import SeqWorkError
from tests.models.hf_checkpoints import write_granite_checkpoint

PROMPTS = [[5, 9, 33, 2], [7], [100, 3, 3, 8, 19, 45, 61, 2, 11], [42, 17, 250]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("pooling"), vocab=256, hidden=64,
                                    layers=2, heads=4, kv_heads=2, tie=True, init_std=0.2)


@pytest.fixture(scope="module")
def reference_states(model_dir):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in PROMPTS]


def pooled(model_dir, pooling, prompts, batched=True):
    card = Card(64 << 20)
    runner = ModelRunner(load_model(model_dir, card, tokenizer=False), card, max_num_seqs=4,
                         max_num_batched_tokens=32, block_size=16, num_kv_blocks=16,
                         pooling=pooling)
    try:
        work = [SeqWork(i, p, 0, [2 * i, 2 * i + 1], False, SamplingParams(), pool=True)
                for i, p in enumerate(prompts)]
        if batched:
            out = runner.launch(work).result()
            assert out.seq_ids == list(range(len(prompts)))
            return out.pooled
        return np.stack([runner.launch([w]).result().pooled[0] for w in work])
    finally:
        runner.close()
        card.close()


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
@pytest.mark.parametrize("batched", [True, False])
def test_pooled_states_match_transformers(model_dir, reference_states, kind, batched):
    got = pooled(model_dir, (kind, True), PROMPTS, batched)
    for g, states in zip(got, reference_states, strict=True):
        want = states[-1] if kind == "LAST" else states.mean(0)
        want = want / np.linalg.norm(want)
        assert 1.0 - float(g @ want) / float(np.linalg.norm(g)) <= 1e-5
        np.testing.assert_allclose(g, want, atol=2e-5)


def test_unnormalized_last_state_is_the_raw_hidden_state(model_dir, reference_states):
    got = pooled(model_dir, ("LAST", False), PROMPTS[:1])
    np.testing.assert_allclose(got[0], reference_states[0][-1], rtol=1e-4, atol=1e-4)


def test_pooling_runner_takes_only_whole_prompts(model_dir):
    card = Card(64 << 20)
    runner = ModelRunner(load_model(model_dir, card, tokenizer=False), card, max_num_seqs=4,
                         max_num_batched_tokens=32, block_size=16, num_kv_blocks=16,
                         pooling=("LAST", True))
    try:
        assert runner.max_model_len == 32          # a prompt is pooled from one step's rows
        with pytest.raises(SeqWorkError) as err:
            runner.launch([SeqWork(3, [1, 2], 4, [0], False, SamplingParams(), pool=True),
                           SeqWork(4, [1, 2], 0, [1], True, SamplingParams())])
        assert err.value.seq_ids == (3, 4)
    finally:
        runner.close()
        card.close()
