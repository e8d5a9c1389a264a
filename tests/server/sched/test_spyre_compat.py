"""--spyre-compat: the vLLM Spyre plugin's scheduling and admission rules (server/sched/spyre_compat.py),
each rule a test: the scheduler with a real block manager (steps read back as they are made),
the engine over the fake runner (steps in flight, concurrent requests), the start-up refusals;
and without the flag the freer scheduling still holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.engine.core import Engine
from spyre_serve.server.launch.cli import parse_command
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import GenerationParams, Sequence
from spyre_serve.server.sched.spyre_compat import (
    MAX_BATCH_TKV,
    MAX_CONTEXT,
    SpyreCompat,
    for_engine,
)
from tests.server.fakes import Collector, FakeRunner, FakeTokenizer, reference

CHUNK, BS = 64, 16      # the chunk (--max-num-batched-tokens) and KV block of the scheduler tests


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 8) -> Sequence:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens)
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), params, 0.0)


def make(compat: bool = True, num_blocks: int = 64, limit: int = MAX_BATCH_TKV) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=8, max_num_batched_tokens=CHUNK,
                     compat=SpyreCompat(CHUNK, BS, limit) if compat else None)


def prompt(n: int, first: int = 1) -> list[int]:
    return [(first + i) % 39 + 1 for i in range(n)]


def step(sched: Scheduler) -> list[tuple[str, int, int, int]]:
    """One step, read back at once (each sample a token; a sequence that has all its tokens is
    finished): (kind, seq id, start, tokens) of each chunk, kind "P" (prompt tokens or several)
    or "D" (one generated token)."""
    chunks = sched.schedule()
    out = []
    for c in chunks:
        out.append(("P" if c.num_new > 1 or c.start < c.seq.num_prompt else "D", c.seq.seq_id,
                    c.start, c.num_new))
        sched.collected(c, 7 if c.sample else None)
        if c.seq.num_generated >= c.seq.params.max_tokens:
            sched.finish(c.seq, "length")
    return out


def kinds(steps) -> list[str]:
    return ["".join(sorted({k for k, *_ in s})) for s in steps]


# ---- rule 1: one prefill at a time, never in a step with decodes --------------------------

def test_one_sequence_prefills_a_step_never_beside_decodes_and_prefills_alternate_with_decodes():
    sched = make()
    for i in range(3):
        sched.add(make_seq(i, prompt(20, i)))
    steps = [step(sched) for _ in range(7)]
    assert steps[:6] == [[("P", 0, 0, 20)], [("D", 0, 20, 1)],           # a prefill, then decodes
                         [("P", 1, 0, 20)], [("D", 0, 21, 1), ("D", 1, 20, 1)],
                         [("P", 2, 0, 20)], [("D", 0, 22, 1), ("D", 1, 21, 1), ("D", 2, 20, 1)]]
    assert kinds(steps) == ["P", "D", "P", "D", "P", "D", "D"]


def test_a_long_prompt_prefills_chunk_by_chunk_between_decode_steps_and_alone_back_to_back():
    sched = make()
    sched.add(make_seq(0, prompt(150)))                 # alone: its chunks back to back
    assert [step(sched) for _ in range(3)] == [[("P", 0, 0, 64)], [("P", 0, 64, 64)], [("P", 0, 128, 22)]]
    sched.add(make_seq(1, prompt(150, 5)))              # beside a decoding sequence: interleaved
    steps = [step(sched) for _ in range(7)]
    assert kinds(steps) == ["D", "P", "D", "P", "D", "P", "D"]   # after a prefill, the decodes
    assert [s[0][1:] for s in steps[1::2]] == [(1, 0, 64), (1, 64, 64), (1, 128, 22)]
    assert steps[6] == [("D", 0, 153, 1), ("D", 1, 150, 1)]


def test_a_sequence_waits_while_another_prefills_even_with_room_in_the_budget():
    sched = make()
    sched.add(make_seq(0, prompt(100)))
    sched.add(make_seq(1, prompt(4, 9)))
    assert step(sched) == [("P", 0, 0, 64)]             # 4 tokens would fit beside it: no
    assert step(sched) == [("P", 0, 64, 36)]            # nothing decodes yet: prefill again
    assert step(sched) == [("D", 0, 100, 1)]
    assert step(sched) == [("P", 1, 0, 4)]


def test_without_compat_a_step_mixes_prefills_and_decodes():
    sched = make(compat=False)
    for i in range(3):
        sched.add(make_seq(i, prompt(20, i)))
    assert step(sched) == [("P", 0, 0, 20), ("P", 1, 0, 20), ("P", 2, 0, 20)]
    sched.add(make_seq(3, prompt(40)))
    assert kinds([step(sched)]) == ["DP"]               # three decodes and a prefill


# ---- rule 2: prefill chunks of the fixed size ---------------------------------------------

def test_a_chunk_is_never_shrunk_to_the_free_blocks_the_scheduler_preempts_instead():
    def second_chunk(compat: bool):
        sched = make(compat, num_blocks=8)              # 128 tokens of KV cache
        sched.add(make_seq(0, prompt(30), max_tokens=50))   # 2 blocks, decoding
        step(sched)
        step(sched)
        sched.add(make_seq(1, prompt(120, 3)))          # its second chunk needs 4 more blocks: 2 free
        chunks = [c for s in [step(sched) for _ in range(4)] for c in s if c[1] == 1]
        return chunks[1], sched.num_preemptions

    assert second_chunk(compat=True) == (("P", 1, 64, 56), 1)    # whole: the decoder preempted
    assert second_chunk(compat=False)[0] == ("P", 1, 63, 17)     # cut to the free block's 17


def test_a_prompt_logprobs_chunk_is_whole_under_compat_and_cut_to_the_scored_budget_without():
    def first_chunk(compat: bool) -> int:
        sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=CHUNK,
                          max_scored_tokens_per_step=16, compat=SpyreCompat(CHUNK, BS) if compat else None)
        seq = make_seq(0, prompt(100))
        seq.params.prompt_logprobs = True
        sched.add(seq)
        return sched.schedule()[0].num_new

    assert (first_chunk(True), first_chunk(False)) == (64, 16)


# ---- rule 3: batch x max context at admission ---------------------------------------------

def test_admission_keeps_batch_times_max_context_within_the_limit_at_every_future_step():
    compat = SpyreCompat(CHUNK, BS, max_batch_tkv=200)
    a, b = make_seq(0, prompt(20), 80), make_seq(1, prompt(20), 80)      # each ends at 100 tokens
    assert compat.fits_volume(b, [a])                                   # 2 x 100 = 200
    assert not compat.fits_volume(make_seq(2, prompt(20), 80), [a, b])  # 3 x 100 = 300
    short = make_seq(3, prompt(20), 5)          # 3 x 25 while it runs, then 2 x 100: it fits
    assert compat.fits_volume(short, [a, b])    # (batch x the longest end, 300, would not)


def test_a_request_over_the_volume_waits_until_one_leaves():
    sched = make(limit=200)
    for i in range(3):
        sched.add(make_seq(i, prompt(20, i), 80))
    for _ in range(6):
        step(sched)
    assert [s.seq_id for s in sched.running] == [0, 1] and sched.waiting[0].seq_id == 2
    while sched.running[0].seq_id == 0:
        step(sched)                              # seq 0 ends (80 tokens): seq 2 gets its slot
    assert step(sched) == [("P", 2, 0, 20)]


# ---- rule 6: prefix-cache hits in whole chunks --------------------------------------------

def hit_start(compat: bool) -> int:
    sched = make(compat)
    shared = prompt(100)
    sched.add(make_seq(0, shared + prompt(50, 20)))
    while sched.running or sched.waiting:
        step(sched)                             # its 9 full blocks are cached (144 tokens)
    sched.add(make_seq(1, shared + prompt(60, 30)))
    return sched.schedule()[0].start            # 100 shared tokens: 6 full blocks (96)


def test_a_cached_prefix_is_used_in_whole_chunks():
    assert hit_start(compat=True) == 64          # one chunk; the block-granular hit is 96


def test_without_compat_a_cached_prefix_is_used_to_its_last_full_block():
    assert hit_start(compat=False) == 96


# ---- the engine over the fake runner: steps in flight, concurrent requests --------------------

TOK = FakeTokenizer()
TEXT = "the quick brown fox jumps over the lazy dog, then it runs away from the hunter."


def engine_steps(compat: bool):
    """Eight concurrent greedy requests (prompts 10..220 tokens sharing a prefix) through an
    engine on the fake runner: (each request's tokens, every step's chunks)."""
    runner = FakeRunner(block_size=BS, num_kv_blocks=128, max_model_len=512)
    engine = Engine(runner, TOK, max_num_seqs=8, max_num_batched_tokens=CHUNK,
                    spyre_compat=SpyreCompat(CHUNK, BS) if compat else None)
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        chunks = schedule()
        steps.append([(c.start, c.num_new, c.seq.num_prompt) for c in chunks])
        return chunks

    engine.scheduler.schedule = recorded
    engine.start()
    try:
        prompts = [TOK.encode((TEXT * 3)[:n]) for n in (10, 220, 45, 130, 64, 180, 90, 150)]
        done = []
        for i, ids in enumerate(prompts):
            c = Collector()
            p = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=12, ignore_eos=True)
            engine.add_request(f"r{i}", ids, [p], c)
            done.append(c)
        tokens = [c.wait().token_ids for c in done]
    finally:
        engine.shutdown()
    assert runner.violations == []
    assert tokens == [reference(ids, 12, ignore_eos=True) for ids in prompts]
    return tokens, [s for s in steps if s]


def test_concurrent_requests_under_compat_make_only_plugin_steps_and_the_same_tokens():
    tokens, steps = engine_steps(compat=True)
    for s in steps:
        prefills = [(start, n, p) for start, n, p in s if n > 1 or start < p]
        assert not prefills or len(s) == 1, s                          # one prefill, alone
        for start, n, p in prefills:
            assert start % CHUNK == 0 and (n == CHUNK or start + n == p), s   # whole chunks
    assert tokens == engine_steps(compat=False)[0]


def test_without_compat_the_engine_mixes_prefills_and_decodes_in_a_step():
    _, steps = engine_steps(compat=False)
    assert any(len({n > 1 or start < p for start, n, p in s}) == 2 for s in steps)


# ---- start-up refusals, with the numbers ----------------------------------------------------

def compat_settings(**kw) -> Settings:
    return Settings(spyre_compat=True, **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(max_num_batched_tokens=100), "--max-num-batched-tokens 100 is the prefill chunk size, "
     "which must be a multiple of 64 (the KV block): give 64 or 128"),
    (dict(block_size=16), "--block-size 16: the plugin's KV blocks are 64 tokens"),
    (dict(warmup=False), "--no-warmup is refused"),
    (dict(max_model_len=65536, max_num_seqs=1), "--max-model-len 65536 is over the plugin's context "
     "of 32768 tokens"),
    (dict(max_model_len=8192, max_num_seqs=32), "--max-num-seqs 32 x --max-model-len 8192 = 262144 "
     "tokens of KV volume, over the plugin's limit of 131072 (batch x max context): give "
     "--max-num-seqs 16 or --max-model-len 4096 or less"),
])
def test_a_start_the_plugin_would_not_run_is_refused_with_the_numbers(kw, message):
    with pytest.raises(ValueError) as exc:
        compat_settings(**kw).with_numerics()
    assert message in str(exc.value)
    Settings(**kw).with_numerics()              # without --spyre-compat: served


def test_the_command_line_refuses_it_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_command(["serve", "--spyre-compat", "--max-num-batched-tokens", "96"])
    assert "give 64 or 128" in capsys.readouterr().err
    assert parse_command(["serve", "--spyre-compat"])[1].spyre_compat


def test_a_context_the_runner_resolved_is_checked_at_start_too():
    runner = SimpleNamespace(max_model_len=MAX_CONTEXT * 4, block_size=64)     # the model's 128K
    with pytest.raises(ValueError, match="the context .* 131072 is over the plugin's context of 32768"):
        for_engine(compat_settings(max_num_seqs=1), runner)
    runner.max_model_len = 8192
    with pytest.raises(ValueError, match="--max-num-seqs 32 x --max-model-len 8192 = 262144"):
        for_engine(compat_settings(), runner)
    assert for_engine(compat_settings(max_num_seqs=16), runner) == SpyreCompat(2048, 64)
    assert for_engine(Settings(), runner) is None
