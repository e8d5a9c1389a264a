"""Engine + scheduler + block manager against the deterministic fake runner."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.models.step.interface import SeqWorkError
from spyre_serve.server.engine.core import (
    MAX_FAILED_STEPS_IN_A_ROW,
    Engine,
    EngineFatal,
    EngineStalled,
    EngineUnavailable,
    RequestRejected,
)
from spyre_serve.server.engine.watchdog import Fault
from spyre_serve.server.sched.sequence import GenerationParams
from tests.server.fakes import EOS, VOCAB, Collector, FakeRunner, FakeTokenizer, reference

TOK = FakeTokenizer()


def params(max_tokens=16, **kw) -> GenerationParams:
    sampling = SamplingParams(**{"temperature": 0.0, **kw.pop("sampling", {})})
    return GenerationParams(sampling=sampling, max_tokens=max_tokens, **kw)


@pytest.fixture
def make_engine():
    engines = []

    def make(runner=None, **kw):
        runner = runner or FakeRunner()
        engine = Engine(runner, TOK, **kw)
        engine.start()
        engines.append(engine)
        return engine, runner

    yield make
    for e in engines:
        e.shutdown()


def submit(engine, prompt, p=None, rid=None, n=1):
    c = Collector()
    p = p or params()
    engine.add_request(rid or f"r{id(c)}", TOK.encode(prompt), [p] * n, c)
    return c


def test_greedy_output_matches_the_model_run_alone(make_engine):
    engine, runner = make_engine()
    c = submit(engine, "hello world", params(max_tokens=12, ignore_eos=True)).wait()
    assert c.token_ids == reference(TOK.encode("hello world"), 12)
    assert c.text == TOK.decode(c.token_ids)
    assert c.last.finish_reason == "length"
    assert runner.violations == []


def test_many_concurrent_requests_of_mixed_lengths_each_match_their_reference(make_engine):
    runner = FakeRunner(num_kv_blocks=400, max_num_batched_tokens=24, max_num_seqs=8)
    engine, _ = make_engine(runner, max_num_seqs=8, max_num_batched_tokens=24)
    prompts = [("abc def ghi jkl mno pqr stu"[: 3 + i * 7 % 25]) or "a" for i in range(40)]
    lens = [1 + (i * 5) % 17 for i in range(40)]
    cs = [submit(engine, p, params(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, lens, strict=True)]
    for c, p, m in zip(cs, prompts, lens, strict=True):
        assert c.wait().token_ids == reference(TOK.encode(p), m)
    assert runner.violations == []
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget(make_engine):
    runner = FakeRunner(max_num_batched_tokens=8)
    engine, _ = make_engine(runner, max_num_batched_tokens=8)
    prompt = "the quick brown fox jumps"  # 25 tokens
    c = submit(engine, prompt, params(max_tokens=3, ignore_eos=True)).wait()
    assert c.token_ids == reference(TOK.encode(prompt), 3)
    chunk_sizes = [len(w.token_ids) for launch in runner.launches[:4] for w in launch]
    assert chunk_sizes == [8, 8, 8, 1]
    assert runner.violations == []


def test_decodes_read_the_previous_sample_on_the_device(make_engine):
    engine, runner = make_engine()
    submit(engine, "abc", params(max_tokens=8, ignore_eos=True)).wait()
    assert any(w.from_device for launch in runner.launches for w in launch)
    assert runner.violations == []


def test_step_n_plus_1_is_launched_before_step_n_is_read_back(make_engine):
    engine, runner = make_engine()
    submit(engine, "overlap", params(max_tokens=6, ignore_eos=True)).wait()
    events = runner.events
    for k in range(len(runner.launches) - 1):
        assert events.index(("launch", k + 1)) < events.index(("result", k))


def test_shutdown_fails_the_requests_still_running(make_engine):
    engine, _ = make_engine(FakeRunner(max_model_len=100_000, num_kv_blocks=30_000))
    c = submit(engine, "long", params(max_tokens=90_000, ignore_eos=True))
    while not c.updates:
        threading.Event().wait(0.001)
    engine.shutdown()
    c.wait()
    assert c.last.finish_reason == "error" and "shut down" in c.last.error
    assert not engine.alive


def test_penalties_send_the_prompt_length_and_no_token_history(make_engine):
    # the card counts the tokens it computes (models/step/penalty_slots.py): each chunk of a
    # penalized sequence says where its prompt ends, so presence and frequency count only
    # the output and repetition the prompt too (vLLM), with O(1) host work per step
    engine, runner = make_engine()
    for sampling in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.2}):
        submit(engine, "abc", params(max_tokens=5, ignore_eos=True, sampling=sampling)).wait()
        works = [w for launch in runner.launches for w in launch]
        assert works[-1].from_device and not hasattr(works[-1], "penalty_token_ids")
        assert {w.num_prompt for w in works} == {3}
        runner.launches.clear()
    submit(engine, "abc", params(max_tokens=3, ignore_eos=True)).wait()
    assert {w.num_prompt for launch in runner.launches for w in launch} == {None}


def test_preemption_with_a_cache_too_small_for_all_still_gives_every_reference_output(make_engine):
    runner = FakeRunner(num_kv_blocks=12, block_size=4, max_model_len=48)
    engine, _ = make_engine(runner, max_num_seqs=8)
    prompts = ["abcdefghij", "klmnopqrst", "uvwxyz abc", "hello there", "general k", "zyx wvu"]
    cs = [submit(engine, p, params(max_tokens=20, ignore_eos=True)) for p in prompts]
    for c, p in zip(cs, prompts, strict=True):
        assert c.wait().token_ids == reference(TOK.encode(p), 20)
    assert engine.scheduler.num_preemptions > 0
    assert runner.violations == []
    assert engine.blocks.num_free == 12


def test_a_stop_string_spanning_tokens_cuts_the_text_and_is_the_stop_reason(make_engine):
    engine, _ = make_engine()
    full = TOK.decode(reference(TOK.encode("stop me"), 16))
    stop = full[5:8]
    c = submit(engine, "stop me", params(max_tokens=16, ignore_eos=True, stop=["zzzzzzz", stop])).wait()
    assert c.text == full[: full.index(stop)]
    assert (c.last.finish_reason, c.last.stop_reason) == ("stop", stop)


def test_a_stop_token_id_ends_generation_without_its_text(make_engine):
    engine, _ = make_engine()
    ref = reference(TOK.encode("tokens"), 16)
    stop_id = ref[4]
    c = submit(engine, "tokens", params(max_tokens=16, stop_token_ids=[stop_id])).wait()
    cut = ref.index(stop_id)
    assert c.token_ids == ref[: cut + 1]
    assert c.text == TOK.decode(ref[:cut])
    assert (c.last.finish_reason, c.last.stop_reason) == ("stop", stop_id)


def test_eos_stops_generation_unless_ignore_eos(make_engine):
    runner = FakeRunner(eos_every=5)
    engine, _ = make_engine(runner)
    prompt = TOK.encode("find an eos")
    ref = reference(prompt, 40, eos_every=5, ignore_eos=True)
    assert EOS in ref, "pick a prompt whose greedy output holds an EOS"
    c = submit(engine, "find an eos", params(max_tokens=40)).wait()
    assert c.token_ids == ref[: ref.index(EOS) + 1]
    assert c.last.finish_reason == "stop" and c.last.stop_reason is None
    c2 = submit(engine, "find an eos", params(max_tokens=40, ignore_eos=True)).wait()
    assert c2.token_ids == ref and c2.last.finish_reason == "length"


def test_min_tokens_keeps_generating_past_an_early_eos(make_engine):
    runner = FakeRunner(eos_every=5)
    engine, _ = make_engine(runner)
    ref = reference(TOK.encode("find an eos"), 40, eos_every=5, ignore_eos=True)
    first = ref.index(EOS)
    n = first + 2
    c = submit(engine, "find an eos", params(max_tokens=40, min_tokens=n)).wait()
    assert len(c.token_ids) >= n
    assert EOS not in c.token_ids[:n]          # banned, not merely ignored as a stop
    assert c.token_ids == reference(TOK.encode("find an eos"), 40, eos_every=5, min_tokens=n)
    if EOS in c.token_ids:
        assert c.token_ids[-1] == EOS and c.last.finish_reason == "stop"
    else:
        assert len(c.token_ids) == 40 and c.last.finish_reason == "length"
    assert not runner.violations


def test_min_tokens_bans_eos_and_stop_token_ids_until_then_and_no_longer(make_engine):
    runner = FakeRunner(eos_every=5)
    engine, _ = make_engine(runner)
    prompt = TOK.encode("find an eos")
    ref = reference(prompt, 40, eos_every=5, ignore_eos=True)
    stop_id = ref[1]
    c = submit(engine, "find an eos", params(max_tokens=12, min_tokens=6,
                                               stop_token_ids=[stop_id, 99])).wait()
    assert c.token_ids == reference(prompt, 12, eos_every=5, min_tokens=6, stop_token_ids=[stop_id])
    assert not set(c.token_ids[:6]) & {EOS, stop_id}
    samples = [w for work in runner.launches for w in work if w.sample]
    assert len(samples) >= len(c.token_ids)
    for w in samples:
        # 99 is outside the fake's vocabulary: never sampled, so not banned either
        want = sorted({EOS, stop_id}) if w.num_generated < 6 else None
        assert w.banned_token_ids == want, (w.num_generated, w.banned_token_ids)
    assert not runner.violations


def test_min_tokens_with_ignore_eos_bans_only_the_stop_token_ids(make_engine):
    engine, runner = make_engine(FakeRunner(eos_every=5))
    submit(engine, "find an eos", params(max_tokens=8, min_tokens=4, ignore_eos=True,
                                         stop_token_ids=[7])).wait()
    bans = [w.banned_token_ids for work in runner.launches for w in work if w.sample]
    assert bans[:4] == [[7]] * 4 and all(b is None for b in bans[4:])
    engine, runner = make_engine(FakeRunner(eos_every=5))
    c = submit(engine, "find an eos", params(max_tokens=8, min_tokens=4, ignore_eos=True)).wait()
    assert all(w.banned_token_ids is None for work in runner.launches for w in work)
    assert len(c.token_ids) == 8 and c.last.finish_reason == "length"


def test_every_eos_id_of_the_model_config_and_the_tokenizer_stops_and_is_banned(make_engine):
    # config.json's eos_token_id may be a list (models.config keeps it one); the tokenizer's
    # EOS counts as well. 99 is outside the fake's vocabulary: never sampled, never banned.
    prompt = TOK.encode("many ends")
    ref = reference(prompt, 16, ignore_eos=True)
    k = next(i for i in range(2, 16) if ref[i] not in ref[:i] and ref[i] != EOS)
    end = ref[k]
    config = SimpleNamespace(vocab_size=VOCAB, eos_token_id=[end, 99])

    engine, runner = make_engine(FakeRunner(config=config))
    assert engine.eos_token_ids == {end, 99, EOS}
    c = submit(engine, "many ends", params(max_tokens=16)).wait()
    assert c.token_ids == ref[: k + 1] and c.text == TOK.decode(ref[:k])
    assert (c.last.finish_reason, c.last.stop_reason) == ("stop", None)

    c = submit(engine, "many ends", params(max_tokens=16, ignore_eos=True)).wait()
    assert c.token_ids == ref and c.last.finish_reason == "length"

    engine, runner = make_engine(FakeRunner(config=config))
    c = submit(engine, "many ends", params(max_tokens=16, min_tokens=k + 1)).wait()
    # banned like a stop token id while min_tokens is unmet, a stop again afterwards
    assert c.token_ids == reference(prompt, 16, min_tokens=k + 1, stop_token_ids=[end])
    assert c.token_ids[:k] == ref[:k] and c.token_ids[k] != end
    bans = [w.banned_token_ids for work in runner.launches for w in work if w.sample]
    assert bans[: k + 1] == [sorted({EOS, end})] * (k + 1) and all(b is None for b in bans[k + 1 :])
    assert not runner.violations


def test_a_token_sampled_after_the_stop_is_discarded(make_engine):
    engine, _ = make_engine()
    ref = reference(TOK.encode("tokens"), 16)
    c = submit(engine, "tokens", params(max_tokens=16, stop_token_ids=[ref[3]])).wait()
    assert len(c.token_ids) == ref.index(ref[3]) + 1
    assert engine.stats.tokens_discarded >= 1
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_n_choices_with_greedy_sampling_are_identical(make_engine):
    engine, _ = make_engine()
    c = submit(engine, "two", params(max_tokens=5, ignore_eos=True), n=2).wait()
    c.done.clear()
    by_index = {0: [], 1: []}
    for u in c.updates:
        by_index[u.index] += u.token_ids
    assert by_index[0] == by_index[1] == reference(TOK.encode("two"), 5)


def test_abort_frees_the_blocks_of_a_running_request(make_engine):
    engine, runner = make_engine(FakeRunner(max_model_len=4000, num_kv_blocks=1000))
    c = submit(engine, "abort me", params(max_tokens=3000, ignore_eos=True), rid="victim")
    while not c.updates:
        threading.Event().wait(0.001)
    assert engine.blocks.num_free < engine.blocks.num_blocks
    engine.abort("victim")
    for _ in range(2000):
        if engine.blocks.num_free == engine.blocks.num_blocks and engine.num_requests == 0:
            break
        threading.Event().wait(0.005)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.num_requests == 0


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(make_engine):
    bad = FakeTokenizer().encode("?")[0]
    engine, _ = make_engine(FakeRunner(fail_when_token=bad))
    c = submit(engine, "bad ?", params(max_tokens=4)).wait()
    assert c.last.finish_reason == "error" and "injected device fault" in c.last.error
    good = submit(engine, "good", params(max_tokens=4, ignore_eos=True)).wait()
    assert good.token_ids == reference(TOK.encode("good"), 4)
    assert engine.alive
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_dead_loop_fails_waiting_requests_and_reports_not_alive(make_engine):
    engine, _ = make_engine()

    def broken():
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken
    c = submit(engine, "x", params(max_tokens=4)).wait()
    assert c.last.finish_reason == "error" and "scheduler bug" in c.last.error
    engine._thread.join(5)
    assert not engine.alive


def test_a_request_longer_than_the_context_is_refused_with_the_numbers(make_engine):
    engine, _ = make_engine(FakeRunner(max_model_len=32))
    with pytest.raises(RequestRejected, match=r"32 tokens.*40 tokens \(10 in the prompt, 30"):
        engine.add_request("r", list(range(1, 11)), [params(max_tokens=30)], Collector())


def test_a_request_larger_than_the_whole_cache_is_refused_with_the_numbers(make_engine):
    engine, _ = make_engine(FakeRunner(num_kv_blocks=4, block_size=4, max_model_len=256))
    with pytest.raises(RequestRejected, match=r"holds 16 tokens \(4 blocks of 4\)"):
        engine.add_request("r", list(range(1, 11)), [params(max_tokens=10)], Collector())


def test_scoring_with_max_tokens_zero_returns_prompt_logprobs_and_no_tokens(make_engine):
    engine, _ = make_engine(FakeRunner(max_num_batched_tokens=4), max_num_batched_tokens=4)
    p = params(max_tokens=0, logprobs=1, prompt_logprobs=True)
    c = submit(engine, "score this", p).wait()
    assert c.token_ids == []
    assert c.last.finish_reason == "length"
    lps = [u.prompt_logprobs for u in c.updates if u.prompt_logprobs is not None][0]
    assert lps[0] is None
    ids = TOK.encode("score this")
    assert [lp.token_id for lp in lps[1:]] == ids[1:]
    assert [round(lp.logprob, 4) for lp in lps[1:]] == [round(-0.5 - 0.01 * t, 4) for t in ids[1:]]


def test_a_prefill_beside_decodes_is_not_cut_to_end_the_step_on_a_token_bucket(make_engine):
    import time

    runner = FakeRunner(num_kv_blocks=200)
    engine, _ = make_engine(runner)
    decoding = [submit(engine, "ab", params(max_tokens=200, ignore_eos=True)) for _ in range(3)]
    deadline = time.monotonic() + 20
    while not all(c.updates for c in decoding):           # all three are decoding
        assert time.monotonic() < deadline
        time.sleep(0.001)
    prompt = "the quick brown fox jumps over"               # 30 tokens
    c = submit(engine, prompt, params(max_tokens=4, ignore_eos=True))
    assert c.wait().token_ids == reference(TOK.encode(prompt), 4)
    ids = TOK.encode(prompt)
    n = len(ids)
    sid = next(w.seq_id for launch in runner.launches for w in launch
               if w.start_pos == 0 and len(w.token_ids) > 1 and w.token_ids == ids[:len(w.token_ids)])
    chunks = [(launch, w) for launch in runner.launches for w in launch
              if w.seq_id == sid and w.start_pos < n]
    # 3 decodes + 30 pad to 64, but the device computes only the step's 33 rows: the whole
    # prompt goes in one step beside the decodes
    assert [len(w.token_ids) for _, w in chunks] == [n]
    assert [sum(len(w.token_ids) for w in launch) for launch, _ in chunks] == [n + 3]
    for c in decoding:
        c.wait()
    assert runner.violations == []


def test_a_prefill_without_decodes_is_taken_whole_and_padded(make_engine):
    runner = FakeRunner()
    engine, _ = make_engine(runner)
    prompt = "the quick brown fox jumps over the lazy dog"  # 43 tokens: one step, bucket 64
    submit(engine, prompt, params(max_tokens=2, ignore_eos=True)).wait()
    assert [len(w.token_ids) for w in runner.launches[0]] == [len(TOK.encode(prompt))]


def test_a_second_start_is_refused_instead_of_running_two_loops(make_engine):
    engine, runner = make_engine()
    with pytest.raises(RuntimeError, match="already started"):
        engine.start()
    c = submit(engine, "hello", params(max_tokens=4, ignore_eos=True)).wait()
    assert c.token_ids == reference(TOK.encode("hello"), 4)
    assert runner.violations == []



def test_waiting_sequences_count_every_choice_of_every_queued_request():
    engine = Engine(FakeRunner(), TOK)          # not started: requests stay queued
    engine.add_request("a", TOK.encode("one"), [params()] * 3, Collector())
    engine.add_request("b", TOK.encode("two"), [params()], Collector())
    assert (engine.num_waiting_requests, engine.num_waiting_sequences) == (2, 4)
    engine._drain_inbox()                       # into the scheduler's waiting queue
    engine._publish_counts()
    assert (engine.num_waiting_requests, engine.num_waiting_sequences) == (2, 4)


# ---- one client cannot hurt another (issue 11) -------------------------------------------


@dataclass
class RefusingRunner(FakeRunner):
    """Refuses, as the real runner's launch checks do (SeqWorkError naming it), a work item
    whose sampling has top_k == REFUSED_TOP_K, and launches nothing of that step."""

    def launch(self, work):
        bad = {w.seq_id: f"seq {w.seq_id}: top_k {w.sampling.top_k} does not fit"
               for w in work if w.sampling.top_k == REFUSED_TOP_K}
        if bad:
            raise SeqWorkError(bad)
        return super().launch(work)


REFUSED_TOP_K = 77


@dataclass
class HookedRunner(FakeRunner):
    """The handle of launch number ``at`` (1-based) goes through ``hook`` (to fail or hang)."""

    at: int = 0
    hook: object = None

    def launch(self, work):
        handle = super().launch(work)
        if len(self.launches) == self.at:
            self.hook(handle)
        return handle


def submit_together(engine, *requests):
    """Queue every (prompt, params) before the loop starts, so they share their first step."""
    cs = [Collector() for _ in requests]
    for i, ((prompt, p), c) in enumerate(zip(requests, cs, strict=True)):
        engine.add_request(f"t{i}", TOK.encode(prompt), [p], c)
    engine.start()
    return cs


@pytest.mark.parametrize("field,value,param", [
    ("top_k", 2**31, "top_k"), ("top_k", -1, "top_k"), ("seed", 2**64, "seed"),
    ("seed", -(2**63) - 1, "seed"), ("temperature", float("inf"), "temperature"),
    ("temperature", 1e39, "temperature"), ("presence_penalty", 1e39, "presence_penalty"),
    ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("top_p", 0.0, "top_p"),
    ("top_p", 5e-324, "top_p"), ("repetition_penalty", 1e-46, "repetition_penalty"),  # 0 in float32
    ("min_p", 1.5, "min_p"), ("logprobs", 21, "logprobs"),
])
def test_a_sampling_value_the_step_cannot_hold_is_refused_with_its_field(field, value, param):
    engine = Engine(FakeRunner(), TOK)
    with pytest.raises(RequestRejected) as err:
        engine.add_request("r", TOK.encode("hi"), [params(sampling={field: value})], Collector())
    assert err.value.param == param and err.value.status == 400
    assert repr(value) in str(err.value) or str(value) in str(err.value)
    assert engine.num_waiting_sequences == 0


@pytest.mark.parametrize("prompt,kw,param", [
    ([1, VOCAB], {}, "prompt"), ([1, -1], {}, "prompt"), ([1, 2**40], {}, "prompt"),
    ([1], {"stop_token_ids": [2**31]}, "stop_token_ids"), ([1], {"stop_token_ids": [-3]}, "stop_token_ids"),
    ([1], {"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ([1], {"logprobs": 21}, "logprobs"),
    ([1], {"max_tokens": -1}, "max_tokens"),
])
def test_token_ids_and_lengths_the_step_cannot_hold_are_refused(prompt, kw, param):
    engine = Engine(FakeRunner(), TOK)
    with pytest.raises(RequestRejected) as err:
        engine.add_request("r", prompt, [params(**kw)], Collector())
    assert err.value.param == param


def test_check_request_with_params_refuses_what_add_request_would():
    engine = Engine(FakeRunner(), TOK)
    engine.check_request(2, 16, [params()], [1, 2])
    with pytest.raises(RequestRejected, match="top_k"):
        engine.check_request(2, 16, [params(), params(sampling={"top_k": 2**40})], [1, 2])


def test_a_sequence_the_runner_refuses_fails_alone_and_its_neighbour_completes(make_engine):
    runner = RefusingRunner()
    engine = Engine(runner, TOK)
    try:
        good, bad = submit_together(engine, ("hello world", params(max_tokens=10, ignore_eos=True)),
                                    ("refuse me", params(max_tokens=10, sampling={"top_k": REFUSED_TOP_K})))
        assert good.wait().token_ids == reference(TOK.encode("hello world"), 10)
        assert bad.wait().last.finish_reason == "error"
        assert f"top_k {REFUSED_TOP_K} does not fit" in bad.last.error
        assert engine.stats.failed_steps == 1 and engine.alive
    finally:
        engine.shutdown()
    assert runner.violations == []


def test_a_step_failing_without_a_culprit_fails_only_the_sequence_that_fails_alone():
    runner = FakeRunner(fail_when_token=TOK.encode("z")[0])   # in no good prompt nor its output
    engine = Engine(runner, TOK)
    try:
        cs = submit_together(engine, ("alpha", params(max_tokens=8, ignore_eos=True)),
                             ("bad z", params(max_tokens=8, ignore_eos=True)),
                             ("beta", params(max_tokens=8, ignore_eos=True)))
        for c, prompt in zip(cs, ("alpha", None, "beta"), strict=True):
            if prompt is not None:
                assert c.wait().token_ids == reference(TOK.encode(prompt), 8), prompt
        assert cs[1].wait().last.finish_reason == "error"
        assert "injected device fault" in cs[1].last.error
        assert engine.alive
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        engine.shutdown()
    assert runner.violations == []


def test_a_failed_step_drains_the_next_one_and_recomputes_the_suspects():
    # step N fails when read back while N+1 (with the same sequences, fed from the device)
    # is in flight: N+1's results for them are dropped, both recompute from 0, alone
    def fail(handle):
        handle._out, handle._error = None, RuntimeError("transient device fault")

    runner = HookedRunner(at=2, hook=fail)
    engine = Engine(runner, TOK)
    try:
        cs = submit_together(engine, ("alpha", params(max_tokens=6, ignore_eos=True)),
                             ("beta", params(max_tokens=6, ignore_eos=True)))
        assert cs[0].wait().token_ids == reference(TOK.encode("alpha"), 6)
        assert cs[1].wait().token_ids == reference(TOK.encode("beta"), 6)
    finally:
        engine.shutdown()
    assert runner.violations == []
    solo = [w for w in runner.launches[2:5] if len(w) == 1 and w[0].start_pos == 0]
    assert len(solo) == 2, "each suspect is recomputed from position 0 in a step of its own"


# ---- what the runner keeps per sequence is dropped however it ends (issue 11) ----------


@dataclass
class StashingRunner(FakeRunner):
    """Keeps state per sequence as the real runner does (a prompt-logprob row after a chunk
    that does not sample; a penalty slot from the chunk at position 0) until ``forget``."""

    rows: set = field(default_factory=set)
    slots: set = field(default_factory=set)

    def launch(self, work):
        for w in work:
            if w.prompt_logprobs:
                (self.rows.discard if w.sample else self.rows.add)(w.seq_id)
            if w.sampling.uses_penalties:
                if w.start_pos == 0:
                    self.slots.add(w.seq_id)
                self._check(w.seq_id in self.slots, f"seq {w.seq_id} has penalties and no slot")
        return super().launch(work)

    def forget(self, seq_id):
        self.rows.discard(seq_id)
        self.slots.discard(seq_id)


def test_scoring_requests_that_never_sample_leave_nothing_in_the_runner(make_engine):
    runner = StashingRunner(max_num_batched_tokens=6)
    engine, _ = make_engine(runner, max_num_batched_tokens=6)
    score = params(max_tokens=0, logprobs=1, prompt_logprobs=True)
    cs = [submit(engine, "score " + "abcdefg"[i % 7] * (1 + i % 9), score) for i in range(30)]
    for c in cs:
        assert c.wait().last.finish_reason == "length"
    assert (runner.rows, runner.slots) == (set(), set())
    assert runner.violations == []


def test_aborted_failed_and_preempted_sequences_leave_nothing_in_the_runner(make_engine):
    runner = StashingRunner(num_kv_blocks=12, block_size=4, max_model_len=48, max_num_batched_tokens=8,
                            fail_when_token=TOK.encode("0")[0])   # in no crowd prompt nor output
    engine, _ = make_engine(runner, max_num_seqs=8, max_num_batched_tokens=8)
    pen = {"presence_penalty": 0.5}
    echo = dict(logprobs=1, prompt_logprobs=True)
    aborted = submit(engine, "a long prompt to abort in prefill", params(max_tokens=5, **echo), rid="gone")
    engine.abort("gone")
    failed = submit(engine, "fails 0", params(max_tokens=5, sampling=pen, **echo))
    crowd = [submit(engine, p, params(max_tokens=20, ignore_eos=True, sampling=pen, **echo))
             for p in ["abcdefghij", "klmnopqrst", "uvwxyz abc", "hello there", "general k"]]
    for c, p in zip(crowd, ["abcdefghij", "klmnopqrst", "uvwxyz abc", "hello there", "general k"], strict=True):
        assert c.wait().token_ids == reference(TOK.encode(p), 20)
    assert failed.wait().last.finish_reason == "error"
    assert not aborted.updates                 # an abort is not answered: the client left
    assert engine.scheduler.num_preemptions > 0
    deadline = time.monotonic() + 10
    while engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (runner.rows, runner.slots) == (set(), set())
    assert runner.violations == []


# ---- a dead engine: every request answered, no new one queued, death reported (issue 11)


class Deaths:
    """An engine's ``on_death``: records each call."""

    def __init__(self) -> None:
        self.calls: list[BaseException] = []
        self.event = threading.Event()

    def __call__(self, exc: BaseException) -> None:
        self.calls.append(exc)
        self.event.set()


def test_an_injected_fatal_fault_fails_every_request_and_reports_the_death():
    deaths = Deaths()
    engine = Engine(FakeRunner(), TOK, on_death=deaths, fault=Fault("die", 3))
    cs = submit_together(engine, *[("long " + "abc"[i], params(max_tokens=50, ignore_eos=True)) for i in range(3)])
    assert deaths.event.wait(10)
    for c in cs:
        assert c.wait(5).last.finish_reason == "error"
        assert "injected fault at step 3" in c.last.error
    assert len(deaths.calls) == 1 and isinstance(deaths.calls[0], EngineFatal)
    assert not engine.alive
    with pytest.raises(EngineUnavailable, match="injected fault"):
        engine.add_request("late", TOK.encode("late"), [params()], Collector())
    engine.shutdown()


def test_a_step_that_does_not_return_within_the_step_timeout_is_a_dead_engine():
    deaths = Deaths()
    late: list = []

    def on_death(exc):
        # a request added while the engine dies is refused at once, never left to hang
        try:
            engine.add_request("late", TOK.encode("late"), [params()], Collector())
        except EngineUnavailable as refused:
            late.append(refused)
        deaths(exc)

    def hang(handle):
        handle.result = lambda: threading.Event().wait() or None

    engine = Engine(HookedRunner(at=3, hook=hang), TOK, step_timeout=0.5, on_death=on_death)
    t0 = time.monotonic()
    cs = submit_together(engine, ("one", params(max_tokens=50, ignore_eos=True)),
                         ("two", params(max_tokens=50, ignore_eos=True)))
    assert deaths.event.wait(10)
    assert time.monotonic() - t0 < 5
    assert isinstance(deaths.calls[0], EngineStalled) and "0.5 s" in str(deaths.calls[0])
    for c in cs:
        assert c.wait(2).last.finish_reason == "error" and "has not returned" in c.last.error
    assert len(late) == 1 and not engine.alive
    engine.shutdown(timeout=0.1)


def test_steps_failing_in_a_row_are_the_cards_fault_and_kill_the_engine():
    @dataclass
    class Broken(FakeRunner):
        def launch(self, work):
            raise RuntimeError("the card is gone")

    deaths = Deaths()
    engine = Engine(Broken(), TOK, on_death=deaths)
    cs = submit_together(engine, *[(p, params(max_tokens=4)) for p in ("a", "b", "c", "d", "e", "f",
                                                                          "g", "h", "i", "j")])
    assert deaths.event.wait(10)
    errors = [c.wait(5).last.error for c in cs]
    assert all(e is not None for e in errors)
    assert any(f"{MAX_FAILED_STEPS_IN_A_ROW} steps failed in a row" in e for e in errors)
    assert isinstance(deaths.calls[0], EngineFatal) and not engine.alive
    engine.shutdown()


def test_a_request_added_after_shutdown_is_refused_instead_of_hanging(make_engine):
    engine, _ = make_engine()
    engine.shutdown()
    with pytest.raises(EngineUnavailable, match="shut down"):
        engine.add_request("late", TOK.encode("late"), [params()], Collector())


def test_a_client_sending_poison_requests_one_by_one_fails_only_its_own_and_never_kills_the_engine():
    """Each poison request's step fails alone (blamed by elimination); the canary that follows
    passes, so none counts toward the card's fatal run: twice that run of them later, the
    engine is alive and a good request is answered."""
    runner = FakeRunner(fail_when_token=TOK.encode("z")[0])
    deaths = Deaths()
    engine = Engine(runner, TOK, on_death=deaths)
    engine.start()
    try:
        for i in range(2 * MAX_FAILED_STEPS_IN_A_ROW):
            c = Collector()
            engine.add_request(f"poison{i}", TOK.encode("zz"), [params(max_tokens=2)], c)
            assert c.wait(10).last.finish_reason == "error"
        assert engine.alive and not deaths.calls
        good = Collector()
        engine.add_request("good", TOK.encode("ab"), [params(max_tokens=3)], good)
        assert good.wait(10).last.finish_reason == "length"
        assert engine.blocks.num_free == engine.blocks.num_blocks       # the canaries' block given back
    finally:
        engine.shutdown()
