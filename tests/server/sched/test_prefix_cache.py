"""Prefix caching in the scheduler and the engine, against the fake runner (its KV cache holds
token ids, so a wrong shared block changes the output): hits give the output of a full
prefill, n > 1 prefills the prompt's full blocks once, prompt logprobs and penalties never
skip a token, and preemption, aborts and failed steps leave every reference count right."""

from __future__ import annotations

import random
import time

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.engine.core import Engine
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import GenerationParams, SeqStatus, Sequence
from tests.server.fakes import Collector, FakeRunner, FakeTokenizer, reference

TOK = FakeTokenizer()
SYSTEM = "you are a helpful assistant. answer briefly, and be kind to every user!"   # 71 tokens


def params(max_tokens=8, **kw) -> GenerationParams:
    sampling = SamplingParams(**{"temperature": 0.0, **kw.pop("sampling", {})})
    return GenerationParams(sampling=sampling, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture
def engine_with():
    """``engine_with(runner, caching=True)``: a started engine over ``runner``, shut down after."""
    engines = []

    def make(runner: FakeRunner, caching: bool = True) -> Engine:
        engine = Engine(runner, TOK, max_num_seqs=8, max_num_batched_tokens=runner.max_num_batched_tokens,
                        enable_prefix_caching=caching)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def submit(engine, prompt: str, p=None, rid=None, n=1) -> Collector:
    c = Collector()
    engine.add_request(rid or f"r{id(c)}", TOK.encode(prompt), [p or params()] * n, c)
    return c


def wait_idle(engine, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while engine.num_requests or engine.blocks.num_used:
        assert time.monotonic() < deadline, (engine.num_requests, engine.blocks.num_used)
        time.sleep(0.005)


def first_starts(runner: FakeRunner) -> dict[int, int]:
    """seq id -> start_pos of its first work item."""
    out: dict[int, int] = {}
    for work in runner.launches:
        for w in work:
            out.setdefault(w.seq_id, w.start_pos)
    return out


def computed(runner: FakeRunner, seq_ids) -> int:
    """Tokens the runner computed for ``seq_ids``."""
    return sum(len(w.token_ids) for work in runner.launches for w in work if w.seq_id in seq_ids)


def test_a_second_request_starts_from_the_cached_system_prompt_with_the_same_output(engine_with):
    runner = FakeRunner(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    engine = engine_with(runner)
    prompts = [SYSTEM + " q1?", SYSTEM + " what now?"]
    a = submit(engine, prompts[0]).wait()
    b = submit(engine, prompts[1]).wait()
    assert a.token_ids == reference(TOK.encode(prompts[0]), 8)
    assert b.token_ids == reference(TOK.encode(prompts[1]), 8)
    starts = first_starts(runner)
    assert starts[0] == 0 and starts[1] == 72              # 18 full blocks: SYSTEM + " "
    stats = engine.blocks.stats
    assert stats.hits == 72 and stats.queries == len(prompts[0]) + len(prompts[1])
    wait_idle(engine)
    assert runner.violations == []


def test_the_hit_leaves_the_last_prompt_token_to_compute(engine_with):
    runner = FakeRunner(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    engine = engine_with(runner)
    prompt = SYSTEM                                        # 71 tokens: 18 full blocks
    first = submit(engine, prompt).wait()
    again = submit(engine, prompt).wait()
    assert again.token_ids == first.token_ids == reference(TOK.encode(prompt), 8)
    assert first_starts(runner)[1] == 68                   # (71 - 1) // 4 blocks


def test_n_choices_prefill_the_prompts_full_blocks_once(engine_with):
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)
    engine = engine_with(runner)
    prompt = SYSTEM + " go"                                # 74 tokens: 3 steps of 32
    p = params(8, sampling={"temperature": 1.0, "seed": 5})
    c = submit(engine, prompt, p, n=4).wait()
    wait_idle(engine)                                      # every choice, not the first
    assert sorted(u.index for u in c.updates if u.finish_reason) == [0, 1, 2, 3]
    ids = set(first_starts(runner))
    prefill = computed(runner, ids) - 4 * 7                # the 7 decodes of each choice
    assert prefill == 74 + 3 * 2                           # each other choice: 74 - 72 tokens


def test_n_choices_without_caching_prefill_n_times(engine_with):
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)
    engine = engine_with(runner, caching=False)
    submit(engine, SYSTEM + " go", params(8), n=4).wait()
    wait_idle(engine)
    assert computed(runner, set(first_starts(runner))) - 4 * 7 == 4 * 74
    assert engine.blocks.stats.queries == 0


def test_prompt_logprobs_and_penalties_never_start_from_the_cache(engine_with):
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)
    engine = engine_with(runner)
    prompt = SYSTEM + " hi"
    submit(engine, prompt).wait()
    scored = submit(engine, prompt, params(4, logprobs=0, prompt_logprobs=True)).wait()
    penal = submit(engine, prompt, params(4, sampling={"repetition_penalty": 1.3})).wait()
    assert set(first_starts(runner).values()) == {0}
    lps = scored.updates[-1].prompt_logprobs or next(u.prompt_logprobs for u in scored.updates
                                                      if u.prompt_logprobs)
    assert lps[0] is None and all(lp is not None for lp in lps[1:])
    assert penal.last.finish_reason == "length"
    assert engine.blocks.stats.queries == len(TOK.encode(prompt))   # only the first looked up


def test_a_storm_of_shared_prefixes_with_aborts_and_preemption_leaks_no_block(engine_with):
    # 28 blocks of 4 tokens: eight requests of up to 105 tokens at once do not fit even with
    # their prefix shared, so sequences are preempted (and find their own blocks in the cache
    # when readmitted); a third are aborted
    runner = FakeRunner(num_kv_blocks=28, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    engine = engine_with(runner)
    rng = random.Random(3)
    jobs = []
    for i in range(60):
        prompt = SYSTEM[: rng.choice([40, 56, 72])] + " " + "abcdefgh"[: rng.randint(1, 8)]
        n = rng.choice([1, 1, 2])
        p = params(rng.randint(4, 24), sampling={"temperature": 0.0})
        rid = f"s{i}"
        aborted = i % 3 == 1
        jobs.append((rid, prompt, p.max_tokens, n, aborted, submit(engine, prompt, p, rid=rid, n=n)))
        if aborted:                                 # an aborted request is told nothing
            time.sleep(rng.random() * 0.002)
            engine.abort(rid)
    wait_idle(engine)
    for rid, prompt, max_tokens, n, aborted, c in jobs:
        if aborted:
            continue
        assert sorted(u.index for u in c.updates if u.finish_reason) == list(range(n)), rid
        for index in range(n):
            ids = [t for u in c.updates if u.index == index for t in u.token_ids]
            assert ids == reference(TOK.encode(prompt), max_tokens), rid
    wait_idle(engine)
    assert runner.violations == []
    blocks = engine.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.usage == 0
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.stats.hits > 0
    assert engine.scheduler.num_preemptions > 0


# ---- the scheduler: what a failed step does to blocks it put in the cache ----------------

def make_seq(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), params(4), 0.0)


def test_a_failed_step_takes_its_blocks_out_of_the_cache_and_recomputes_who_read_them():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    writer, reader = make_seq(0, list(range(1, 11))), make_seq(1, list(range(1, 11)))
    sched.add(writer)
    sched.add(reader)
    chunks = sched.schedule()                         # writer fills 2 blocks, reader shares them
    assert [(c.seq, c.start, c.num_new) for c in chunks] == [(writer, 0, 10), (reader, 8, 2)]
    assert reader.block_table[:2] == writer.block_table[:2]
    assert sched.blocks.ref_count(writer.block_table[0]) == 2
    sched.step_failed(chunks)
    for s in (writer, reader):                        # both start again, in blocks of their own
        assert (s.num_computed, s.block_table, s.kv_suspect) == (0, [], False)
    assert sched.blocks.num_cached == 0 and sched.blocks.num_free == 16
    again = sched.schedule()
    assert [(c.seq, c.start) for c in again] == [(writer, 0), (reader, 0)]   # nothing cached now
    assert again[1].seq.block_table[0] != again[0].seq.block_table[0]


def test_a_reader_in_flight_drops_its_sample_when_the_step_it_read_from_fails():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    writer = make_seq(0, list(range(1, 11)))
    sched.add(writer)
    step1 = sched.schedule()                          # writer fills blocks 0-1 (in flight)
    reader = make_seq(1, list(range(1, 11)))
    sched.add(reader)
    step2 = sched.schedule()                          # reader starts from them
    (r,) = [c for c in step2 if c.seq is reader]
    assert r.start == 8
    sched.step_failed(step1)                          # step 1 failed: what reader read is unknown
    assert reader.kv_suspect and reader.num_inflight == 1
    for c in step2:
        sched.collected(c, 7 if c.sample else None)
    assert reader.token_ids == list(range(1, 11))     # its sample is dropped...
    assert (reader.num_computed, reader.block_table, reader.kv_suspect) == (0, [], False)
    assert reader.status is SeqStatus.RUNNING         # ...and it is recomputed from 0
    (c,) = [c for c in sched.schedule() if c.seq is reader]
    assert (c.start, c.num_new, c.sample) == (0, 10, True)


def test_an_undone_launch_uncaches_its_blocks_and_the_reader_starts_over():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    writer, reader = make_seq(0, list(range(1, 11))), make_seq(1, list(range(1, 11)))
    sched.add(writer)
    sched.add(reader)
    chunks = sched.schedule()
    sched.undo_launch(chunks)
    assert writer.num_computed == 0 and len(writer.block_table) == 3   # as if never scheduled
    assert (reader.num_computed, reader.block_table) == (0, [])         # its hit is gone
    assert sched.blocks.num_cached == 0
    assert sched.blocks.num_used == 3


def test_a_failed_step_of_requests_sharing_blocks_fails_only_the_culprit(engine_with):
    bad = TOK.encode("?")[0]
    runner = FakeRunner(num_kv_blocks=64, block_size=4, max_num_batched_tokens=256, fail_when_token=bad)
    engine = engine_with(runner)
    good = [submit(engine, SYSTEM + f" q{i}") for i in range(3)]
    culprit = submit(engine, SYSTEM[:-1] + " why?")
    for i, c in enumerate(good):
        assert c.wait().token_ids == reference(TOK.encode(SYSTEM + f" q{i}"), 8)
    assert culprit.wait().last.finish_reason == "error"
    wait_idle(engine)
    assert runner.violations == [] and engine.stats.failed_steps >= 1
    assert all(engine.blocks.ref_count(b) == 0 for b in range(engine.blocks.num_blocks))
