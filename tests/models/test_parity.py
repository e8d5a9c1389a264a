"""The whole model on the card against transformers on the same checkpoint (fp32).

Checkpoints are chosen so the reference output is varied and its top-1/top-2 gaps are far
above fp32 noise (asserted in each test; see docs/design.md, "Testing with random weights"):
untied 128-wide 2-layer with std 0.2, tied 128-wide 4-layer with std 1.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)

CHECKPOINTS = {
    "untied": dict(tie=False, hidden=128, layers=2, heads=4, kv_heads=1, init_std=0.2),
    "tied": dict(tie=True, hidden=128, layers=4, heads=4, kv_heads=2, init_std=1.0),
    "bf16": dict(tie=False, hidden=128, layers=2, heads=4, kv_heads=1, init_std=0.2,
                 dtype="bfloat16"),
    "llama": dict(tie=False, hidden=128, layers=2, heads=4, kv_heads=2, init_std=0.2, llama=True),
}


class Setup:
    """A checkpoint, its transformers reference, and a runner on a fresh card."""

    def __init__(self, path):
        self.path = path
        self.ref = load_reference_model(path)
        self.card = Card(256 << 20)
        self.model = load_model(path, self.card, tokenizer=False)
        # the bf16 checkpoint is placed in bf16 (its stored width) and computed in fp32:
        # transformers widens it to fp32, so the kernels' exact widening must match it
        self.runner = ModelRunner(self.model, self.card, max_num_seqs=16,
                                  max_num_batched_tokens=128, block_size=BLOCK,
                                  num_kv_blocks=96, seed=1, compute_dtype="float32")

    def close(self):
        self.runner.close()
        self.card.close()


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def setup(request, tmp_path_factory):
    path = write_granite_checkpoint(tmp_path_factory.mktemp(request.param), vocab=256,
                                    **CHECKPOINTS[request.param])
    s = Setup(path)
    s.kind = request.param
    # the parametrization is what it says: a bf16 file, a Llama model
    assert s.model.stored_dtype == ("bfloat16" if request.param == "bf16" else "float32")
    assert type(s.ref).__name__ == ("LlamaForCausalLM" if request.param == "llama"
                                    else "GraniteForCausalLM")
    yield s
    s.close()


def prompts_of(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def reference_greedy(ref, prompt, n_new):
    """transformers' greedy continuation (plain argmax of the forward pass, no logits
    processors such as EOS suppression) and the smallest relative top-1/top-2 gap."""
    ids = list(prompt)
    gap = np.inf
    with torch.no_grad():
        for _ in range(n_new):
            logits = ref(torch.tensor([ids])).logits[0, -1]               # [V]
            top2 = logits.topk(2).values
            gap = min(gap, ((top2[0] - top2[1]) / logits.abs().max()).item())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], gap


def reference_logits(ref, prompt):
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0].numpy()          # [n, V]


class BlockPool:
    """Hands out KV blocks in a scrambled order, so block tables are not contiguous."""

    def __init__(self, n, seed=0):
        self.free = np.random.default_rng(seed).permutation(n).tolist()

    def grow(self, table, tokens):
        while len(table) * BLOCK < tokens:
            table.append(self.free.pop())

    def release(self, table):
        self.free.extend(table)
        table.clear()


def run_mixed(runner, prompts, n_new, chunked=(), from_device=(), sampling=None,
              stagger=True, pool=None):
    """A small continuous-batching loop. Sequence i joins at step i (if stagger); the
    prompts of `chunked` are prefilled in 3 chunks, the others in one; decodes of
    `from_device` sequences read their token on the device. Returns generated ids."""
    pool = pool or BlockPool(runner.num_kv_blocks)
    n = len(prompts)
    sampling = sampling or [GREEDY] * n
    known = [list(p) for p in prompts]
    computed = [0] * n
    tables = [[] for _ in range(n)]
    chunks = []
    for i, p in enumerate(prompts):
        if i in chunked:
            a, b = len(p) // 3, 2 * len(p) // 3
            chunks.append([a, b - a, len(p) - b])
        else:
            chunks.append([len(p)])
    generated = [[] for _ in range(n)]
    sampled_last: set[int] = set()
    step = 0
    while any(len(g) < n_new for g in generated):
        work = []
        for i in range(n):
            if (stagger and i > step) or len(generated[i]) >= n_new:
                continue
            if chunks[i]:
                size = chunks[i].pop(0)
                ids = known[i][computed[i]:computed[i] + size]
                dev = False
            else:
                dev = i in from_device and i in sampled_last
                ids = [-1] if dev else [known[i][-1]]
            pool.grow(tables[i], computed[i] + len(ids))
            work.append(SeqWork(seq_id=i, token_ids=ids, start_pos=computed[i],
                                block_table=list(tables[i]),
                                sample=computed[i] + len(ids) == len(known[i]),
                                sampling=sampling[i], num_generated=len(generated[i]),
                                from_device=dev))
        out = runner.launch(work).result()
        for w in work:
            computed[w.seq_id] += len(w.token_ids)
        for sid, tok in zip(out.seq_ids, out.token_ids.tolist(), strict=True):
            generated[sid].append(tok)
            known[sid].append(tok)
        sampled_last = set(out.seq_ids)
        step += 1
    for t in tables:
        pool.release(t)
    return generated


def test_prefill_logits_match_transformers(setup):
    for prompt in prompts_of([1, 7, 33, 100], seed=3):
        ref = reference_logits(setup.ref, prompt)
        out = setup.runner.launch(
            [SeqWork(seq_id=0, token_ids=prompt, start_pos=0,
                     block_table=list(range(-(-len(prompt) // BLOCK))), sample=True,
                     sampling=GREEDY)], return_logits=True).result()
        got = out.logits[0]
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 1e-4 * scale, (setup.kind, len(prompt))
        assert out.token_ids[0] == ref[-1].argmax()


def test_greedy_generation_with_chunked_prefill_and_device_decode_matches(setup):
    prompts = prompts_of([5, 12, 30, 47, 64, 90], seed=0)
    n_new = 32
    expected, gaps = zip(*(reference_greedy(setup.ref, p, n_new) for p in prompts), strict=True)
    # the reference is a real test: varied tokens, gaps far above fp32 noise
    assert all(len(set(e)) >= 4 for e in expected), expected
    assert min(gaps) > 1e-5, gaps
    got = run_mixed(setup.runner, prompts, n_new, chunked={1, 3, 5}, from_device={0, 2, 3, 5})
    for i in range(len(prompts)):
        assert got[i] == list(expected[i]), (setup.kind, i)


def test_a_model_cut_after_its_first_layer_is_transformers_first_layer(setup):
    """load_model(num_layers=1): the final norm and LM head read layer 0's output (the logit
    lens benchmarks/numerics.py uses), as transformers' model with its later layers removed."""
    import torch

    from spyre_serve.models.checkpoints.loader import first_layers

    ref = load_reference_model(setup.path)
    ref.model.layers = ref.model.layers[:1]
    ref.config.num_hidden_layers = 1
    card = Card(256 << 20)
    try:
        model = load_model(setup.path, card, tokenizer=False, num_layers=1)
        assert model.config.num_hidden_layers == 1 and len(model.weights.layers) == 1
        runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=128, block_size=BLOCK,
                             num_kv_blocks=8, seed=1, compute_dtype="float32")
        prompt = prompts_of([40], seed=5)[0]
        got = runner.launch([SeqWork(seq_id=0, token_ids=prompt, start_pos=0, block_table=[0, 1, 2],
                                     sample=True, sampling=GREEDY)], return_logits=True).result().logits[0]
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
        assert np.abs(got - reference_logits(setup.ref, prompt)).max() > 1e-3   # not the whole model
        runner.close()
    finally:
        card.close()
    layers = setup.model.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"num_layers must be in 1..{layers}, got {layers + 1}"):
        first_layers(setup.model.config, {}, layers + 1)
