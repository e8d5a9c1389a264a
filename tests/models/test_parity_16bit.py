"""16-bit weights and 16-bit compute against transformers on the same checkpoints.

16-bit weights (`dtype` bfloat16/float16/dlfloat16, `compute_dtype` float32): the kernels widen every
stored value exactly, so the model on the card is the checkpoint rounded to that format and
computed in fp32. It must give transformers' fp32 greedy tokens on the same rounded weights,
token for token: Granite and Llama, tied and untied.

16-bit compute (`compute_dtype` = the weights' format): every GEMM input is rounded to the
format, products are exact, sums fp32; activations between GEMMs stay fp32, where transformers
in bf16/fp16 rounds each of them. The contract, against transformers run in that dtype on the
same checkpoint, teacher-forced on transformers' fp32 greedy continuations:
- logits: our largest deviation from transformers-16 is at most LOGIT_RATIO times the format's
  own error, transformers-16's largest deviation from transformers-32 (measured: 0.8-1.2x);
- tokens: on these random models the top-1/top-2 gaps are often below what 16 bits resolve
  (transformers-16 itself disagrees with transformers-32 on up to 8 of 75 positions), so greedy
  tokens are compared where the fp32 gap is at least RESOLVED of the largest |logit|, and agree
  on at least 90% of those positions (measured: 94-100%). On a trained model the issue's 95% of
  all positions is checked by tests/models/gguf/test_smollm2.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spyre_serve.device import Card
from spyre_serve.device.numerics import dlfloat16_round
from spyre_serve.models import ModelRunner, SeqWork, load_model
from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint
from tests.models.test_parity import BLOCK, GREEDY, prompts_of, reference_greedy, run_mixed

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_RATIO = 1.5
RESOLVED = 0.02

CHECKPOINTS = {
    "granite-untied": dict(tie=False, hidden=128, layers=2, heads=4, kv_heads=1, init_std=0.2),
    "granite-tied": dict(tie=True, hidden=128, layers=4, heads=4, kv_heads=2, init_std=1.0),
    "llama-untied": dict(tie=False, hidden=128, layers=2, heads=4, kv_heads=2, init_std=0.2,
                         llama=True),
    "llama-tied": dict(tie=True, hidden=128, layers=2, heads=4, kv_heads=2, init_std=1.0,
                       llama=True),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp(request.param), vocab=256,
                                    **CHECKPOINTS[request.param])


def rounded_reference(path, dtype: str):
    """transformers in fp32 on the checkpoint's weights rounded to `dtype`."""
    ref = load_reference_model(path)
    with torch.no_grad():
        for p in ref.parameters():
            if dtype == "dlfloat16":          # the card's format: device/numerics.py's rounding
                p.copy_(torch.from_numpy(dlfloat16_round(p.numpy())))
            else:
                p.copy_(p.to(TORCH[dtype]).float())
    return ref


def runner_for(path, dtype: str, compute_dtype: str):
    card = Card(256 << 20)
    model = load_model(path, card, tokenizer=False, dtype=dtype)
    assert model.weights.dtype == dtype
    runner = ModelRunner(model, card, max_num_seqs=16, max_num_batched_tokens=128,
                         block_size=BLOCK, num_kv_blocks=96, seed=1, compute_dtype=compute_dtype)
    return runner, card


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "dlfloat16"])
def test_16_bit_weights_give_transformers_greedy_tokens_on_the_rounded_weights(checkpoint, dtype):
    ref = rounded_reference(checkpoint, dtype)
    prompts = prompts_of([5, 30, 64], seed=1)
    expected, gaps = zip(*(reference_greedy(ref, p, 24) for p in prompts), strict=True)
    assert all(len(set(e)) >= 4 for e in expected), expected      # varied, a real test
    assert min(gaps) > 1e-5, gaps                                   # far above fp32 noise
    runner, card = runner_for(checkpoint, dtype, "float32")
    try:
        got = run_mixed(runner, prompts, 24, chunked={1}, from_device={0, 2})
    finally:
        runner.close()
        card.close()
    assert got == [list(e) for e in expected]


def teacher_forced(runner, ids):
    """Logits of every position of `ids` in one prefill: float32[n, V]."""
    out = runner.launch([SeqWork(seq_id=0, token_ids=ids, start_pos=0,
                                 block_table=list(range(-(-len(ids) // BLOCK))), sample=True,
                                 sampling=GREEDY)], return_logits=True).result()
    return out.logits[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_compute_agrees_with_transformers_in_that_dtype(checkpoint, dtype):
    ref32 = load_reference_model(checkpoint)
    ref16 = load_reference_model(checkpoint).to(TORCH[dtype])
    runner, card = runner_for(checkpoint, dtype, dtype)
    agree = resolved = 0
    ours_err = format_err = 0.0
    try:
        for prompt in prompts_of([8, 40, 90], seed=2):
            cont, _ = reference_greedy(ref32, prompt, 24)
            ids = prompt + cont
            with torch.no_grad():
                want16 = ref16(torch.tensor([ids])).logits[0].float().numpy()   # [n, V]
                want32 = ref32(torch.tensor([ids])).logits[0].numpy()
            got = teacher_forced(runner, ids)
            ours_err = max(ours_err, float(np.abs(got - want16).max()))
            format_err = max(format_err, float(np.abs(want32 - want16).max()))
            rows = slice(len(prompt) - 1, len(ids))                 # positions that predict
            top2 = np.sort(want32[rows], axis=1)[:, -2:]
            gap = (top2[:, 1] - top2[:, 0]) / np.abs(want32[rows]).max(axis=1)
            same = got[rows].argmax(1) == want16[rows].argmax(1)
            agree += int(same[gap >= RESOLVED].sum())
            resolved += int((gap >= RESOLVED).sum())
    finally:
        runner.close()
        card.close()
    assert ours_err <= LOGIT_RATIO * format_err, (ours_err, format_err)
    assert resolved >= 50, resolved                                  # enough positions to judge
    assert agree >= 0.90 * resolved, (agree, resolved)
