"""Speculative decoding at the runner: a sequence's proposed tokens are verified in one step
(`SeqWork.num_draft`), each row sampling with the RNG counter of the output token it stands
for, and the step keeps the samples up to the first that differs from its proposal. So the
tokens kept are exactly those of one token a step: greedy or seeded, whatever was proposed."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from spyre_serve.models.step.interface import SeqWorkError
from tests.models.hf_checkpoints import write_granite_checkpoint
from tests.models.test_parity import BLOCK, BlockPool, prompts_of

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, logprobs=3)


@pytest.fixture(scope="module")
def runner():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = write_granite_checkpoint(Path(d), vocab=256, hidden=128, layers=2, heads=4,
                                        kv_heads=1, tie=False, init_std=0.2)
        card = Card(256 << 20)
        model = load_model(path, card, tokenizer=False)
        r = ModelRunner(model, card, max_num_seqs=8, max_num_batched_tokens=128,
                        block_size=BLOCK, num_kv_blocks=120, seed=5)
        yield r
        r.close()
        card.close()


def generate(runner, prompts, n_new, sampling, propose=None):
    """Each prompt prefilled in one step, then decoded with `propose(i, out_so_far)` tokens
    proposed each step (None or []: one token a step); all sequences in every step. Returns
    (outputs, their logprobs, [(proposed, kept)] per step of sequence 0)."""
    pool = BlockPool(runner.num_kv_blocks, seed=3)
    n = len(prompts)
    known = [list(p) for p in prompts]
    outs, lps = [[] for _ in range(n)], [[] for _ in range(n)]
    tables = [[] for _ in range(n)]
    history = []
    first = True
    while any(len(o) < n_new for o in outs):
        work = []
        for i in range(n):
            if len(outs[i]) >= n_new:
                continue
            if first:
                toks, start, k = known[i], 0, 0
            else:
                room = n_new - len(outs[i]) - 1
                d = list((propose(i, outs[i]) if propose else None) or [])[:room]
                toks, start, k = [known[i][-1]] + d, len(known[i]) - 1, len(d)
            pool.grow(tables[i], start + len(toks))
            work.append(SeqWork(i, toks, start, list(tables[i]), True, sampling[i],
                                num_generated=len(outs[i]), num_draft=k))
        out = runner.launch(work).result()
        for j, sid in enumerate(out.seq_ids):
            rows = out.rows_of(j)
            kept = out.token_ids[rows.start:rows.stop].tolist()
            if sid == 0 and not first:
                history.append((work[0].num_draft, len(kept)))
            outs[sid] += kept
            known[sid] += kept
            lps[sid] += out.logprobs[rows.start:rows.stop].tolist()
        first = False
    return [o[:n_new] for o in outs], [lp[:n_new] for lp in lps], history


def test_proposals_right_wrong_or_none_give_the_same_greedy_tokens(runner):
    prompts = prompts_of([12, 30, 5], seed=1)
    plain, plain_lp, _ = generate(runner, prompts, 20, [GREEDY] * 3)
    oracle, _, hist = generate(runner, prompts, 20, [GREEDY] * 3,
                               lambda i, o: plain[i][len(o):len(o) + 4])
    assert oracle == plain
    assert all(kept == k + 1 for k, kept in hist) and len(hist) < 8   # every proposal kept
    wrong, wrong_lp, hist = generate(runner, prompts, 20, [GREEDY] * 3,
                                     lambda i, o: [(t + 1) % 256 for t in plain[i][len(o):len(o) + 3]])
    assert wrong == plain
    assert all(kept == 1 for _, kept in hist)                          # every proposal refused
    np.testing.assert_allclose(np.array(wrong_lp), np.array(plain_lp), atol=1e-5)
    half, _, hist = generate(runner, prompts, 20, [GREEDY] * 3,
                             lambda i, o: plain[i][len(o):len(o) + 2] + [0, 0])
    assert half == plain
    assert any(kept == 3 for _, kept in hist)                          # two of four kept


def test_seeded_sampling_keeps_its_tokens_and_logprobs_with_proposals(runner):
    prompts = prompts_of([9, 17], seed=2)
    sampling = [SEEDED, SamplingParams(temperature=0.8, top_k=20, seed=5)]
    plain, plain_lp, _ = generate(runner, prompts, 16, sampling)
    assert len(set(plain[0])) > 3                                      # it really sampled
    spec, spec_lp, hist = generate(runner, prompts, 16, sampling,
                                   lambda i, o: plain[i][len(o):len(o) + 3] if len(o) % 2 else [1, 2])
    assert spec == plain
    np.testing.assert_allclose(np.array(spec_lp), np.array(plain_lp), atol=1e-5)
    assert any(kept > 1 for _, kept in hist)


def test_a_step_mixes_proposals_with_prefills_and_plain_decodes(runner):
    prompts = prompts_of([7, 11, 40], seed=4)
    plain, _, _ = generate(runner, prompts, 10, [GREEDY] * 3)
    mixed, _, _ = generate(runner, prompts, 10, [GREEDY] * 3,
                           lambda i, o: plain[i][len(o):len(o) + 3] if i != 1 else None)
    assert mixed == plain


def test_proposals_with_state_they_would_advance_are_refused(runner):
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    bias = SamplingParams(temperature=0.0, logit_bias={3: 5.0})
    work = [SeqWork(1, [5, 6, 7], 4, [0], True, pen, num_prompt=4, num_draft=2),
            SeqWork(2, [5, 6, 7], 4, [1], True, bias, num_draft=2),
            SeqWork(3, [5, 6], 4, [2], True, GREEDY, num_draft=2),
            SeqWork(4, [5, 6], 4, [3], True, GREEDY, num_draft=1, banned_token_ids=[0])]
    with pytest.raises(SeqWorkError) as err:
        runner.launch(work)
    assert set(err.value.seq_ids) == {1, 2, 3, 4}
    assert "penalties" in err.value.reasons[1] and "logit_bias" in err.value.reasons[2]
    assert "num_draft 2 must be in 1..1" in err.value.reasons[3]
    with pytest.raises(ValueError, match="return_logits"):
        runner.launch([SeqWork(5, [5, 6], 0, [4], True, GREEDY, num_draft=1)], return_logits=True)
    # the runner is still usable: a plain step runs
    assert len(runner.launch([SeqWork(6, [5, 6], 0, [5], True, GREEDY)]).result().token_ids) == 1


def test_with_proposals_the_kept_tokens_follow_the_models_distribution(tmp_path):
    """A vocabulary of 16, temperature 1, 3000 seeds: the first kept token of a decode that
    proposes token p follows softmax(logits) (chi-square), and the second, kept when the first
    is p, follows the model's distribution after p."""
    from scipy.stats import chisquare

    path = write_granite_checkpoint(tmp_path, vocab=16, hidden=64, layers=1, heads=2, kv_heads=1,
                                    tie=False, init_std=1.0)
    card = Card(64 << 20)
    runner = ModelRunner(load_model(path, card, tokenizer=False), card, max_num_seqs=16,
                         max_num_batched_tokens=64, block_size=BLOCK, num_kv_blocks=40, seed=1)
    try:
        context = [1, 5, 9, 2]
        first = runner.launch([SeqWork(0, context, 0, [0], True,
                                       SamplingParams(temperature=1.0, logprobs=16))]).result()
        p = int(first.top_ids[0, 0])                    # the likeliest next token: kept often
        after_p = runner.launch([SeqWork(1, context + [p], 0, [1], True,
                                         SamplingParams(temperature=1.0, logprobs=16))]).result()
        probs = [np.zeros(16), np.zeros(16)]
        for q, out in zip(probs, (first, after_p), strict=True):
            q[out.top_ids[0]] = np.exp(out.top_logprobs[0])
        kept = [np.zeros(16), np.zeros(16)]
        for base in range(0, 3000, 16):                 # 16 seeds a step, each in a block of its own
            work = [SeqWork(100 + base + i, [context[-1], p], 3, [3 + i], True,
                            SamplingParams(temperature=1.0, seed=base + i), num_generated=1, num_draft=1)
                    for i in range(16)]
            runner.launch([SeqWork(w.seq_id, context[:3], 0, w.block_table, False, GREEDY) for w in work])
            out = runner.launch(work).result()
            for j in range(len(out.seq_ids)):
                rows = out.rows_of(j)
                kept[0][out.token_ids[rows[0]]] += 1
                if len(rows) == 2:
                    kept[1][out.token_ids[rows[1]]] += 1
        for n, q in zip(kept, probs, strict=True):
            assert n.sum() > 200
            seen = q > 0
            assert chisquare(n[seen], q[seen] / q[seen].sum() * n.sum()).pvalue > 1e-3, (n, q)
        assert kept[1].sum() == kept[0][p]              # the second is kept exactly when the first is p
    finally:
        runner.close()
        card.close()
