"""Sampling through the whole model: seeds independent of the batch, top-k 1 is greedy,
logprobs and prompt logprobs equal transformers' log-softmax, penalties see device tokens.
(The distribution test of the sampler lives with the kernel, tests/device/kernels/sampling.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint
from tests.models.test_parity import BLOCK, BlockPool, prompts_of, reference_logits, run_mixed

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_granite_checkpoint(tmp_path_factory.mktemp("sampling"), vocab=256, hidden=128,
                                    layers=2, heads=4, kv_heads=1, tie=False, init_std=0.2)
    card = Card(256 << 20)
    model = load_model(path, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=16, max_num_batched_tokens=256,
                         block_size=BLOCK, num_kv_blocks=200, seed=5)
    yield runner, load_reference_model(path)
    runner.close()
    card.close()


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_16(setup):
    runner, _ = setup
    prompts = prompts_of([9] + [3 + 2 * i for i in range(15)], seed=11)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = run_mixed(runner, prompts[:1], 16, sampling=[mine], stagger=False)[0]
    others = [SamplingParams(temperature=0.5 + 0.1 * i, top_k=i % 4 * 10, seed=i)
              for i in range(15)]
    batch = run_mixed(runner, prompts, 16, sampling=[mine] + others, chunked={0, 4},
                      from_device={0, 3}, stagger=True)
    assert batch[0] == alone
    assert len(set(alone)) > 3            # temperature 1 actually sampled something varied


def test_top_k_1_equals_greedy(setup):
    runner, _ = setup
    prompts = prompts_of([6, 20], seed=4)
    greedy = run_mixed(runner, prompts, 12, stagger=False)
    top1 = run_mixed(runner, prompts, 12, stagger=False,
                     sampling=[SamplingParams(temperature=1.0, top_k=1, seed=s) for s in (1, 2)])
    assert top1 == greedy


def test_logprobs_of_the_sampled_token_and_top_5_match_transformers(setup):
    runner, ref = setup
    prompt = prompts_of([21], seed=8)[0]
    sp = SamplingParams(temperature=1.0, seed=3, logprobs=5)
    out = runner.launch([SeqWork(0, prompt, 0, [0, 1], True, sp)]).result()
    lsm = torch.log_softmax(torch.tensor(reference_logits(ref, prompt)[-1]), -1).numpy()
    tok = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(lsm[tok], abs=1e-4)
    assert out.top_ids.shape == (1, 5)
    assert out.top_ids[0].tolist() == np.argsort(-lsm)[:5].tolist()
    np.testing.assert_allclose(out.top_logprobs[0], np.sort(lsm)[::-1][:5], atol=1e-4)


def test_prompt_logprobs_across_chunks_match_transformers(setup):
    runner, ref = setup
    prompt = prompts_of([40], seed=9)[0]
    sp = SamplingParams(temperature=0.0, logprobs=2)
    lp, top = [], []
    for start, end in ((0, 15), (15, 40)):
        w = SeqWork(0, prompt[start:end], start, [3, 4, 5], end == 40, sp, prompt_logprobs=True)
        got = runner.launch([w]).result().prompt_logprobs[0]
        lp.append(got[0])
        top.append(got[1])
    lsm = torch.log_softmax(torch.tensor(reference_logits(ref, prompt)), -1).numpy()  # [40, V]
    want = lsm[np.arange(39), prompt[1:]]
    np.testing.assert_allclose(np.concatenate(lp), want, atol=1e-4)
    assert np.concatenate(top)[:, 0].tolist() == lsm[:39].argmax(-1).tolist()


def test_presence_penalty_counts_the_token_read_on_the_device(setup):
    runner, _ = setup
    prompt = prompts_of([8], seed=2)[0]
    sp = SamplingParams(temperature=0.0, presence_penalty=1e4)
    pool = BlockPool(runner.num_kv_blocks)
    table: list[int] = []
    pool.grow(table, len(prompt) + 24)
    n = len(prompt)
    out = runner.launch([SeqWork(0, prompt, 0, table, True, sp, num_prompt=n)]).result()
    gen = [int(out.token_ids[0])]
    for i in range(20):
        # the host sends no token history: the device counts each token it reads
        w = SeqWork(0, [-1], n + i, table, True, sp, num_generated=i + 1, from_device=True,
                    num_prompt=n)
        h = runner.launch([w])
        gen.append(int(h.result().token_ids[0]))
    runner.forget(0)
    assert len(set(gen)) == len(gen), gen
    # without the penalty the same model repeats itself
    plain = run_mixed(runner, [prompt], 21, stagger=False)[0]
    assert len(set(plain)) < len(plain)
