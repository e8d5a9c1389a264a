"""The scheduler with a real block manager: what one step counts on a sequence, and
what reading the step back (or its failure) undoes."""

from __future__ import annotations

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.prefill_budget import FLOWING_TOKENS
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import GenerationParams, SeqStatus, Sequence


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 16) -> Sequence:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens)
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), params, 0.0)


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=8,
                     max_num_batched_tokens=budget)


def counting_frees(sched: Scheduler) -> list[int]:
    """The seq ids whose blocks ``sched`` hands back, one entry per free."""
    frees: list[int] = []
    free = sched.blocks.free

    def counted(seq: Sequence) -> None:
        frees.append(seq.seq_id)
        free(seq)

    sched.blocks.free = counted
    return frees


def test_a_scheduled_prompt_is_computed_with_one_token_pending_in_one_step():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (chunk,) = sched.schedule()
    assert (chunk.start, chunk.num_new, chunk.sample) == (0, 3, True)
    assert (seq.num_computed, seq.num_pending, seq.num_inflight) == (3, 1, 1)
    assert seq.status is SeqStatus.RUNNING and len(seq.block_table) == 1


def test_collecting_a_sample_makes_the_token_known_on_the_host():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (chunk,) = sched.schedule()
    assert sched.collected(chunk, 9) is True
    assert seq.token_ids == [5, 6, 7, 9]
    assert (seq.num_pending, seq.num_inflight, seq.num_tokens) == (0, 0, 4)


def test_collecting_a_chunk_without_a_sample_adds_no_token():
    sched = make(budget=2)
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (chunk,) = sched.schedule()                    # the first 2 of 3 prompt tokens
    assert not chunk.sample
    assert sched.collected(chunk, None) is False
    assert seq.token_ids == [5, 6, 7] and (seq.num_pending, seq.num_inflight) == (0, 0)


def test_a_token_collected_with_a_chunk_that_did_not_sample_is_refused():
    sched = make(budget=2)
    sched.add(make_seq(0, [5, 6, 7]))
    (chunk,) = sched.schedule()
    with pytest.raises(ValueError, match=r"sample=False was collected with token 9"):
        sched.collected(chunk, 9)


def test_finishing_a_sequence_with_no_step_in_flight_frees_its_blocks_at_once():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (chunk,) = sched.schedule()
    sched.collected(chunk, 9)
    sched.finish(seq, "stop")
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.running == [] and sched.deferred_free == []
    assert (seq.status, seq.finish_reason) == (SeqStatus.FINISHED, "stop")


def test_a_sequence_finished_while_in_flight_keeps_its_blocks_until_collected():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (chunk,) = sched.schedule()
    sched.finish(seq, "abort")
    assert sched.blocks.num_free == sched.blocks.num_blocks - 1
    assert sched.deferred_free == [seq]
    assert sched.collected(chunk, 9) is False          # the token is discarded
    assert seq.token_ids == [5, 6, 7] and seq.num_pending == 0
    assert sched.blocks.num_free == sched.blocks.num_blocks and sched.deferred_free == []


def test_a_failed_step_undoes_its_counts_and_adds_no_token():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    sched.step_failed(sched.schedule())
    assert seq.token_ids == [5, 6, 7] and (seq.num_pending, seq.num_inflight) == (0, 0)
    assert seq.status is SeqStatus.RUNNING          # the engine decides what a failure ends


def test_a_failed_step_frees_the_blocks_of_a_finished_sequence_exactly_once():
    sched = make()
    frees = counting_frees(sched)
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (prefill,) = sched.schedule()                   # step N
    (decode,) = sched.schedule()                    # step N+1, launched before N is read
    assert decode.from_device and seq.num_inflight == 2
    sched.finish(seq, "abort")
    sched.collected(prefill, 9)                     # N read back: N+1 still writes its blocks
    assert frees == [] and sched.deferred_free == [seq]
    sched.step_failed([decode])                     # N+1 raised
    assert frees == [0]
    assert sched.blocks.num_free == sched.blocks.num_blocks and sched.deferred_free == []
    sched.finish(seq, "error")                      # the engine failing the request again
    assert frees == [0]


def test_a_sequence_preempted_in_flight_then_finished_leaves_nothing_deferred():
    sched = make(num_blocks=2, block_size=4)
    a, b = make_seq(0, [1, 2, 3, 4]), make_seq(1, [5, 6, 7, 8])
    sched.add(a)
    sched.add(b)
    first = sched.schedule()                        # both prompts: one block each, all blocks
    second = sched.schedule()                       # a's decode needs a block: b is preempted
    assert [c.seq for c in second] == [a] and sched.num_preemptions == 1
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_inflight == 1
    sched.finish(b, "abort")
    assert sched.deferred_free == []                # no blocks of b's for the step to write
    for chunk in first:
        sched.collected(chunk, 9)
    assert sched.deferred_free == [] and b.num_inflight == 0


def test_abandon_marks_finished_and_leaves_the_queues_and_blocks_alone():
    sched = make()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    sched.schedule()
    sched.abandon(seq, "error")
    assert (seq.status, seq.finish_reason) == (SeqStatus.FINISHED, "error")
    assert sched.running == [seq] and seq.block_table != []


def test_a_prefill_beside_decodes_takes_what_it_wants_uncut():
    def first_step(decodes, prompt_len):
        """Tokens each chunk gets in the first step after `decodes` sequences are decoding
        and a prompt of `prompt_len` tokens arrives (budget 512): the device computes only a
        step's own rows, so no chunk is cut to end the step on a bucket."""
        sched = Scheduler(BlockManager(400, 16), 64, 512)
        for i in range(decodes):
            sched.add(make_seq(i, [5, 6]))
        for chunk in sched.schedule():              # their prompts, read back: one token to decode each
            sched.collected(chunk, 7)
        sched.add(make_seq(decodes, list(range(prompt_len))))
        return sorted(c.num_new for c in sched.schedule())

    assert first_step(31, 128) == [1] * 31 + [128]
    assert first_step(31, 60) == [1] * 31 + [60]
    assert first_step(31, 600) == [1] * 31 + [481]       # the budget's rest: 512 - 31
    assert first_step(0, 100) == [100]


def test_a_burst_of_prompts_beside_decodes_is_not_cut_into_a_tail_of_steps():
    """17 sequences decode while 14 prompts of 128 tokens wait, budget 2,048: the step takes all
    1,792 prompt tokens, not some and the rest over more steps that stall every decode again."""
    sched = Scheduler(BlockManager(800, 16), 64, 2048, max_prefill_with_decodes=None)
    for i in range(17):
        sched.add(make_seq(i, [5, 6]))
    for chunk in sched.schedule():
        sched.collected(chunk, 7)
    for i in range(14):
        sched.add(make_seq(17 + i, list(range(1000 * i, 1000 * i + 128))))   # no prefix shared
    assert sorted(c.num_new for c in sched.schedule()) == [1] * 17 + [128] * 14


def test_a_prefill_beside_flowing_streams_takes_at_most_max_prefill_with_decodes():
    def first_step(decodes, prompt_len, cap, streamed=FLOWING_TOKENS):
        """The first step after `decodes` sequences have streamed `streamed` tokens each and
        a prompt of `prompt_len` tokens arrives."""
        sched = Scheduler(BlockManager(400, 16), 64, 512, max_prefill_with_decodes=cap)
        for i in range(decodes):
            sched.add(make_seq(i, [5, 6], max_tokens=64))
        for _ in range(streamed):
            for chunk in sched.schedule():
                sched.collected(chunk, 7)
        sched.add(make_seq(decodes, list(range(prompt_len))))
        return sorted(c.num_new for c in sched.schedule())

    assert first_step(8, 300, 64) == [1] * 8 + [64]
    assert first_step(8, 300, None) == [1] * 8 + [300]   # no cap: the whole prompt
    assert first_step(0, 300, 64) == [300]               # no decodes to protect: no cap
    # streams of the same burst, not yet flowing, do not cap it
    assert first_step(8, 300, 64, streamed=FLOWING_TOKENS - 1) == [1] * 8 + [300]


# ---- release (the runner's per-sequence state), undo, rewind, solo steps ---------------

def releasing(**kw) -> tuple[Scheduler, list[int]]:
    released: list[int] = []
    sched = Scheduler(BlockManager(kw.pop("num_blocks", 16), kw.pop("block_size", 4)), max_num_seqs=8,
                      max_num_batched_tokens=kw.pop("budget", 64), on_release=lambda s: released.append(s.seq_id))
    return sched, released


def test_a_finished_sequence_is_released_once_no_step_holds_it():
    sched, released = releasing()
    seq = make_seq(0, [5, 6, 7])
    sched.add(seq)
    (prefill,) = sched.schedule()
    (decode,) = sched.schedule()                    # two steps in flight
    sched.finish(seq, "abort")
    assert released == []
    sched.collected(prefill, 9)
    assert released == []                           # the decode may still stash state for it
    sched.collected(decode, 4)
    assert released == [0]
    sched.finish(seq, "error")
    assert released == [0]


def test_a_sequence_that_never_ran_or_is_idle_is_released_when_it_ends():
    sched, released = releasing()
    waiting, idle = make_seq(0, [5]), make_seq(1, [6, 7])
    sched.add(idle)
    (chunk,) = sched.schedule()
    sched.collected(chunk, 3)
    sched.add(waiting)
    sched.finish(waiting, "abort")
    sched.finish(idle, "stop")
    assert released == [0, 1]


def test_a_preempted_sequence_is_released_after_its_step_and_not_if_readmitted_first():
    sched, released = releasing(num_blocks=2, block_size=4)
    a, b = make_seq(0, [1, 2, 3, 4]), make_seq(1, [5, 6, 7, 8])
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    sched.schedule()                                # b preempted while its prefill is in flight
    assert b.status is SeqStatus.WAITING and released == []
    for chunk in first:
        sched.collected(chunk, 9)
    assert released == [1]                          # recomputed from 0: the runner's state goes

    sched, released = releasing(num_blocks=2, block_size=4)
    a, b = make_seq(0, [1, 2, 3, 4]), make_seq(1, [5, 6, 7, 8])
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    sched.schedule()
    b.status = SeqStatus.RUNNING                     # as if readmitted before the collect
    for chunk in first:
        sched.collected(chunk, 9)
    assert released == []


def test_undo_launch_takes_a_step_back_as_if_never_planned():
    sched = make(budget=2)
    seq = make_seq(0, [5, 6, 7, 8])
    sched.add(seq)
    (first,) = sched.schedule()
    (second,) = sched.schedule()                    # launch raised before it ran
    sched.undo_launch([second])
    assert (seq.num_computed, seq.num_inflight, seq.num_pending) == (2, 1, 0)
    sched.collected(first, None)
    (again,) = sched.schedule()
    assert (again.start, again.num_new, again.sample) == (2, 2, True)


def test_rewind_recomputes_from_zero_and_schedule_solo_plans_that_sequence_alone():
    sched = make()
    a, b = make_seq(0, [5, 6, 7]), make_seq(1, [8, 9])
    sched.add(a)
    sched.add(b)
    chunks = sched.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        sched.rewind(a)
    sched.step_failed(chunks)
    sched.rewind(a)
    (solo,) = sched.schedule_solo(a)
    assert (solo.seq, solo.start, solo.num_new, solo.sample) == (a, 0, 3, True)
    assert sched.schedule_solo(make_seq(2, [1])) == []   # not running: nothing


def test_freed_blocks_are_handed_out_again_first():
    # LIFO: the cache's working set stays what the load needs at its peak (host pages on the
    # emulated card), instead of cycling through every block
    blocks = BlockManager(8, 4)
    a, b = make_seq(0, [1] * 8), make_seq(1, [2] * 4)
    blocks.grow(a, 8)
    blocks.free(a)
    blocks.grow(b, 4)
    assert b.block_table == [1]
    assert blocks.num_free == 7


def test_a_step_scores_at_most_its_budget_of_prompt_tokens():
    """Prompt-logprob chunks are cut to max_scored_tokens_per_step (each scored token is a
    vocabulary row read back); other sequences keep the step's token budget."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_scored_tokens_per_step=10)
    scored = [make_seq(i, list(range(1, 25))) for i in range(2)]
    for s in scored:
        s.params.prompt_logprobs = True
        s.prompt_logprobs = [None] * 24
    plain = make_seq(2, list(range(100, 124)))
    for s in (*scored, plain):
        sched.add(s)
    chunks = sched.schedule()
    assert [(c.seq.seq_id, c.num_new) for c in chunks] == [(0, 10)]   # FCFS: the head waits
    sched.collected(chunks[0], None)
    second = sched.schedule()
    assert [(c.seq.seq_id, c.num_new) for c in second] == [(0, 10)]
    sched.collected(second[0], None)
    third = sched.schedule()        # 4 left of seq 0, 6 of seq 1, and the rest of the budget
    assert [(c.seq.seq_id, c.num_new) for c in third] == [(0, 4), (1, 6), (2, 24)]
