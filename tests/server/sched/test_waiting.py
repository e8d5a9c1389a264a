"""Scheduling policies (``server/sched/waiting.py``) with the real scheduler and block manager: the
order sequences are admitted in, whom a preemption takes, and a high-priority sequence taking
the slot of a low-priority one when every slot is taken."""

from __future__ import annotations

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import GenerationParams, SeqStatus, Sequence
from spyre_serve.server.sched.waiting import WaitingQueue


def seq(seq_id: int, priority: int = 0, arrival: float | None = None, prompt: int = 3) -> Sequence:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=8, priority=priority)
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(1, prompt + 1)), params,
                    float(seq_id) if arrival is None else arrival)


def scheduler(policy: str, max_num_seqs: int = 8, num_blocks: int = 32, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     policy=policy)


def admitted(chunks) -> list[int]:
    return [c.seq.seq_id for c in chunks]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    s = scheduler("fcfs", max_num_seqs=2)
    for sq in (seq(0, 5), seq(1, 9), seq(2, -3)):
        s.add(sq)
    assert admitted(s.schedule()) == [0, 1]


def test_priority_admits_lower_values_first_then_by_arrival():
    s = scheduler("priority", max_num_seqs=3)
    for sq in (seq(0, 5), seq(1, 9), seq(2, -3), seq(3, 5)):
        s.add(sq)
    assert [q.seq_id for q in s.waiting] == [2, 0, 3, 1]
    assert admitted(s.schedule()) == [2, 0, 3]


def test_a_waiting_sequence_of_higher_priority_takes_the_slot_of_the_lowest_running():
    s = scheduler("priority", max_num_seqs=2)
    low = [seq(0, 10), seq(1, 5)]
    for sq in low:
        s.add(sq)
    for c in s.schedule():
        s.collected(c, 7)
    urgent = seq(2, 1)
    s.add(urgent)
    chunks = s.schedule()
    assert low[0].status is SeqStatus.WAITING and s.num_preemptions == 1   # priority 10 left
    assert urgent.status is SeqStatus.RUNNING and 2 in admitted(chunks)
    assert [q.seq_id for q in s.waiting] == [0]
    equal = seq(3, 5)                       # not strictly higher than the lowest running (5): waits
    s.add(equal)
    for c in chunks:
        s.collected(c, 7)
    s.schedule()
    assert equal.status is SeqStatus.WAITING and s.num_preemptions == 1


@pytest.mark.parametrize(("policy", "left"), [("fcfs", 2), ("priority", 1)])
def test_out_of_blocks_fcfs_preempts_the_latest_and_priority_the_lowest(policy, left):
    s = scheduler(policy, max_num_seqs=4, num_blocks=4, budget=64)
    a, b, c = seq(0, 0, prompt=4), seq(1, 7, prompt=4), seq(2, 0, prompt=4)   # b: the lowest priority
    for sq in (a, b, c):
        s.add(sq)
    for ch in s.schedule():                     # a block each, one block free
        s.collected(ch, 7)
    s.schedule()                                # each decode needs a second block: one preemption
    waiting = [q.seq_id for q in s.waiting]
    assert waiting == [left] and s.num_preemptions == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_preempted_sequence_goes_back_where_its_policy_puts_it(policy):
    q = WaitingQueue(policy)
    early, late, back = seq(0, 1), seq(1, 0), seq(2, 2, arrival=-1.0)
    q.push(early)
    q.push(late)
    q.push_preempted(back)
    expect = {"fcfs": [2, 0, 1], "priority": [1, 0, 2]}[policy]
    assert [s.seq_id for s in q] == expect


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        WaitingQueue("lifo")
