"""LoRA adapters on the card against transformers + peft on the same base (fp32, greedy):
several adapters (ranks, targets, rsLoRA) and the base model in one batch; the arena's LRU
with more adapters than slots; adapters refused with what is wrong."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import GraniteConfig, ModelRunner, SamplingParams, SeqWork, load_model
from spyre_serve.models.lora.adapter import LoraError, read_adapter
from spyre_serve.models.step.interface import SeqWorkError
from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint
from tests.models.lora_adapters import (
    reference_greedy,
    reference_with_adapter,
    runner_greedy_lora,
    write_lora_adapter,
)

ADAPTERS = {
    "qv8": dict(r=8, alpha=16, targets=["q_proj", "v_proj"], seed=1),
    "all4": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"], seed=2, use_rslora=True),
    "mlp16": dict(r=16, alpha=8, targets=["o_proj", "gate_proj", "up_proj", "down_proj"], seed=3),
}
N_NEW = 12


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    base = write_granite_checkpoint(tmp_path_factory.mktemp("lora_base"), vocab=256, tie=False,
                                    hidden=128, layers=2, heads=4, kv_heads=1, init_std=0.2)
    paths = {name: write_lora_adapter(base, tmp_path_factory.mktemp(name), **kw)
             for name, kw in ADAPTERS.items()}
    prompts = [np.random.default_rng(i).integers(1, 256, n).tolist()
               for i, n in enumerate([9, 23, 40, 17])]
    names = [None, "qv8", "all4", "mlp16"]
    expected = {}
    for name in [None, *ADAPTERS]:
        ref = (load_reference_model(base) if name is None
               else reference_with_adapter(base, paths[name]))
        expected[name] = [reference_greedy(ref, p, N_NEW) for p in prompts]
    return base, paths, prompts, names, expected


@contextmanager
def _runner(base, max_loras, max_rank=16):
    """(model, runner) on a card of their own, with an arena of max_loras slots; both closed after."""
    card = Card(256 << 20)
    model = load_model(base, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                         num_kv_blocks=128, seed=1, compute_dtype="float32", lora=(max_loras, max_rank))
    try:
        yield model, runner
    finally:
        runner.close()
        card.close()


def test_adapters_and_base_in_one_batch_match_transformers_peft(lora_setup):
    base, paths, prompts, _, expected = lora_setup
    for name in ADAPTERS:                 # the adapters move the output, and the test is real
        assert any(expected[name][i][0] != expected[None][i][0] for i in range(len(prompts)))
        assert min(g for _, g in expected[name]) > 1e-5
    with _runner(base, max_loras=3) as (model, runner):
        for name, path in paths.items():
            runner.lora.register(name, read_adapter(path, model.config, 16))
        runner.warmup(progress=False)          # every bucket prepared: serving adapters compiles nothing
        compiles = runner.card.counters.snapshot()["compiles"]
        runner.profile(True)                   # the adapters' updates have a timer of their own
        # every prompt with every adapter and the base, all in one batch
        combos = [(i, name) for i in range(len(prompts)) for name in [None, *ADAPTERS]]
        got = runner_greedy_lora(runner, [prompts[i] for i, _ in combos],
                                 [name for _, name in combos], N_NEW)
        for (i, name), ids in zip(combos, got, strict=True):
            assert ids == expected[name][i][0], (i, name)
        assert runner.held()["lora_pins"] == 0
        assert runner.card.counters.snapshot()["compiles"] == compiles
        seconds = runner.kernel_seconds()
        assert seconds["lora"] > 0 and seconds["qkv"] > 0 and seconds["down"] > 0
        assert runner.memory_plan["lora_arena"] == runner.lora.nbytes > 0


def test_the_arena_is_the_size_the_plan_counts(lora_setup):
    from spyre_serve.models.sizing.fit import lora_arena_bytes

    base = lora_setup[0]
    with _runner(base, max_loras=3, max_rank=8) as (model, runner):
        assert runner.lora.nbytes == lora_arena_bytes(model.config, 3, 8) == runner.memory_plan["lora_arena"]


def test_more_adapters_than_slots_evicts_the_least_recently_used(lora_setup):
    base, paths, prompts, _, expected = lora_setup
    with _runner(base, max_loras=2) as (model, runner):
        for name, path in paths.items():
            runner.lora.register(name, read_adapter(path, model.config, 16))
        seq = 0
        for names in (["qv8", "all4"], ["mlp16", None], ["qv8", "mlp16"], ["all4", "all4"]):
            got = runner_greedy_lora(runner, prompts[:2], names, N_NEW, first_seq=seq)
            seq += 2
            for i, name in enumerate(names):
                assert got[i] == expected[name][i][0], (names, i)
        assert sorted(n for n in runner.lora.slots if n) == ["all4", "mlp16"]
        # every slot pinned by running sequences: a third adapter has none
        greedy = SamplingParams(temperature=0.0)
        assert runner.lora.pin(100, "qv8") is not None and runner.lora.pin(101, "mlp16") is not None
        assert not runner.lora.can_pin("all4")
        with pytest.raises(SeqWorkError, match="slots are held"):
            runner.launch([SeqWork(102, [5, 6], 0, [60], True, greedy, lora="all4")])
        runner.forget(100)
        assert runner.lora.can_pin("all4")
        runner.forget(101)
        assert runner.held()["lora_pins"] == 0


def test_an_adapter_unloaded_while_in_use_keeps_its_slot_until_its_sequences_end(lora_setup):
    base, paths, prompts, _, expected = lora_setup
    with _runner(base, max_loras=2) as (model, runner):
        arena = runner.lora
        arena.register("qv8", read_adapter(paths["qv8"], model.config, 16))
        slot = arena.pin(1, "qv8")
        arena.unregister("qv8")
        assert arena.pin(1, "qv8") == slot            # the running sequence keeps reading it
        with pytest.raises(KeyError, match="not registered"):
            arena.pin(2, "qv8")                        # a new one does not find it
        arena.register("qv8", read_adapter(paths["qv8"], model.config, 16))
        assert arena.pin(2, "qv8") != slot             # loaded again: placed afresh
        arena.unpin(1)
        arena.unpin(2)
        assert arena.slots.count(None) == 1 and arena.pinned() == 0
        got = runner_greedy_lora(runner, prompts[:1], ["qv8"], N_NEW, first_seq=10)
        assert got[0] == expected["qv8"][0][0]


def _edit_config(path, **changes):
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"r": 32}, "rank 32 is greater than max_lora_rank 16"),
])
def test_unsupported_adapters_are_refused_naming_why(lora_setup, tmp_path, changes, message):
    base, paths, *_ = lora_setup
    path = tmp_path / "bad"
    shutil.copytree(paths["qv8"], path)
    _edit_config(path, **changes)
    with pytest.raises(LoraError, match=message) as e:
        read_adapter(path, GraniteConfig.from_file(base), 16)
    assert e.value.rank_over == ("r" in changes)


def test_missing_or_broken_files_are_refused(lora_setup, tmp_path):
    base, paths, *_ = lora_setup
    config = GraniteConfig.from_file(base)
    with pytest.raises(LoraError, match="not a directory"):
        read_adapter(tmp_path / "nowhere", config, 16)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="not a JSON file"):
        read_adapter(tmp_path, config, 16)
    (tmp_path / "adapter_config.json").write_text((paths["qv8"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoraError, match="safetensors"):
        read_adapter(tmp_path, config, 16)
