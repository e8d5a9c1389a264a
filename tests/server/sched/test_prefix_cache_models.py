"""Prefix caching on the real runner: a sequence that starts from cached KV blocks (written by
an earlier step, or by another sequence earlier in the same step) gives the greedy output of
a full prefill, on granite-tiny and on a Llama checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, load_model, resolve_model
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from spyre_serve.server.engine.core import Engine
from spyre_serve.server.sched.sequence import GenerationParams
from tests.models.hf_checkpoints import write_granite_checkpoint
from tests.server.fakes import Collector

BLOCK = 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer():
    """granite-tiny's tokenizer (the engine detokenizes with it; both models' ids are in it)."""
    return load_tokenizer(resolve_model("granite-tiny"))


def checkpoint(name: str, tmp_path_factory):
    if name == "granite-tiny":
        return resolve_model("granite-tiny")
    return write_granite_checkpoint(tmp_path_factory.mktemp("llama"), vocab=256, hidden=128, layers=2,
                                    heads=4, kv_heads=2, tie=False, init_std=0.2, llama=True)


def greedy_outputs(runner, tokenizer, prompts, *, caching: bool, together: bool, budget: int):
    """Each prompt's greedy tokens from an engine over ``runner`` (one after another, or all
    submitted at once), and the engine's prefix cache stats."""
    engine = Engine(runner, tokenizer, max_num_seqs=4, max_num_batched_tokens=budget,
                    enable_prefix_caching=caching)
    engine.start()
    try:
        p = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS, ignore_eos=True)
        collectors = []
        for i, prompt in enumerate(prompts):
            c = Collector()
            engine.add_request(f"r{i}", prompt, [p], c)
            collectors.append(c)
            if not together:
                c.wait(600)
        outs = [c.wait(600).token_ids for c in collectors]
        return outs, engine.blocks.stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["granite-tiny", "llama"])
def test_greedy_output_is_the_same_with_and_without_a_cache_hit(name, tmp_path_factory, tokenizer):
    card = Card(512 << 20)
    model = load_model(checkpoint(name, tmp_path_factory), card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=128, block_size=BLOCK,
                         num_kv_blocks=48, seed=0)
    try:
        rng = np.random.default_rng(7)
        vocab = model.config.vocab_size
        system = rng.integers(1, vocab, 70).tolist()            # 4 full blocks + 6 tokens
        prompts = [system + rng.integers(1, vocab, 5).tolist() for _ in range(3)]
        prompts.append(list(prompts[0]))                        # the same prompt again
        plain, stats = greedy_outputs(runner, tokenizer, prompts, caching=False, together=False, budget=64)
        assert stats.hits == 0
        assert all(len(set(o)) > 3 for o in plain), plain       # varied output: a real check
        # one after another: the hits read blocks earlier steps wrote
        cached, stats = greedy_outputs(runner, tokenizer, prompts, caching=True, together=False, budget=64)
        assert stats.hits == 4 * BLOCK * 3 and stats.queries == 75 * 4
        assert cached == plain
        # all at once in one step: the later sequences read blocks the first writes in that step
        same_step, stats = greedy_outputs(runner, tokenizer, prompts, caching=True, together=True,
                                          budget=128)
        assert stats.hits == 4 * BLOCK * 3                      # one step holds all four
        assert same_step == plain
    finally:
        runner.close()
        card.close()
