"""Penalties through the whole model, from the state the card keeps per sequence: every
greedy token of a penalized sequence is the argmax of vLLM's penalized logits of its row
(prompt counted for the repetition penalty only, generated tokens for all three), through
chunked prefill, device-fed decodes, a recompute from position 0 and a slot handed on; the
host sends a slot number and the prompt length, never the history."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.models import SamplingParams, SeqWork
from spyre_serve.models.step.interface import SeqWorkError
from tests.device.kernels.sampling.test_sampling import vllm_apply_penalties
from tests.models.step.test_sampling_model import setup  # noqa: F401 (the runner and its model)
from tests.models.test_parity import BlockPool, prompts_of

PENALIZED = SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.5,
                           repetition_penalty=1.3)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(setup):  # noqa: F811 (the imported fixture)
    return setup[0]


def check_greedy_penalized(token: int, row: np.ndarray, prompt: list[int], out: list[int],
                           sp: SamplingParams) -> None:
    """`token` is the argmax of vLLM's penalties applied to `row` (up to the float noise
    between the step's sampling row and the same row read back)."""
    z = vllm_apply_penalties(row[None], [prompt], [out], [sp.presence_penalty],
                             [sp.frequency_penalty], [sp.repetition_penalty])[0]
    assert z[token] >= z.max() - 1e-4, (token, int(z.argmax()), float(z[token]), float(z.max()))


def test_penalized_greedy_tokens_are_vllms_through_chunks_decodes_and_a_recompute(runner):
    pool = BlockPool(runner.num_kv_blocks)
    pa, pb = prompts_of([20, 9], seed=21)
    ta, tb = [], []
    pool.grow(ta, 20 + 40)
    pool.grow(tb, 9 + 40)
    # A: prompt in two chunks (12 + 8, the second samples); B, unpenalized, alongside
    runner.launch([SeqWork(0, pa[:12], 0, ta, False, PENALIZED, num_prompt=20)]).result()
    res = runner.launch([SeqWork(0, pa[12:], 12, ta, True, PENALIZED, num_prompt=20),
                         SeqWork(1, pb, 0, tb, True, GREEDY)], return_logits=True).result()
    check_greedy_penalized(int(res.token_ids[0]), res.logits[0][-1], pa, [], PENALIZED)
    outa, outb = [int(res.token_ids[0])], [int(res.token_ids[1])]
    plain = []
    for i in range(14):
        res = runner.launch([
            SeqWork(0, [-1], 20 + i, ta, True, PENALIZED, num_generated=i + 1, from_device=True,
                    num_prompt=20),
            SeqWork(1, [-1], 9 + i, tb, True, GREEDY, num_generated=i + 1, from_device=True),
        ], return_logits=True).result()
        check_greedy_penalized(int(res.token_ids[0]), res.logits[0][-1], pa, outa, PENALIZED)
        plain.append(int(res.logits[0][-1].argmax()))
        assert int(res.token_ids[1]) == int(res.logits[1][-1].argmax())   # B: no penalty
        outa.append(int(res.token_ids[0]))
        outb.append(int(res.token_ids[1]))
    assert plain != outa[1:], "the penalties should have changed some token"
    assert len(set(outa)) > len(set(plain))

    # preempted: A is forgotten, then recomputed from position 0 as one prefill of prompt +
    # output; the device rebuilds its slot (outputs counted once, not on top of the old counts)
    runner.forget(0)
    res = runner.launch([SeqWork(0, pa + outa, 0, ta, True, PENALIZED, num_generated=len(outa),
                                 num_prompt=20)], return_logits=True).result()
    check_greedy_penalized(int(res.token_ids[0]), res.logits[0][-1], pa, outa, PENALIZED)

    # a new sequence in the slot A held starts clean: only its own tokens count
    runner.forget(0)
    pc = prompts_of([7], seed=22)[0]
    tc: list[int] = []
    pool.grow(tc, 7 + 4)
    res = runner.launch([SeqWork(2, pc, 0, tc, True, PENALIZED, num_prompt=7)],
                        return_logits=True).result()
    check_greedy_penalized(int(res.token_ids[0]), res.logits[2][-1], pc, [], PENALIZED)
    runner.forget(1)
    runner.forget(2)
    assert runner.held() == {"prompt_logprob_rows": 0, "penalty_slots": 0}


def test_a_penalized_chunk_past_position_0_without_a_slot_is_refused_alone(runner):
    pool = BlockPool(runner.num_kv_blocks)
    ta, tb = [], []
    pool.grow(ta, 16)
    pool.grow(tb, 16)
    with pytest.raises(SeqWorkError) as err:
        runner.launch([SeqWork(7, [1, 2], 3, ta, True, PENALIZED, num_prompt=3),
                       SeqWork(8, [1, 2, 3], 0, tb, True, GREEDY)])
    assert err.value.seq_ids == (7,)
    assert "holds no penalty slot" in str(err.value)
    assert runner.held()["penalty_slots"] == 0


def test_penalties_without_the_prompt_length_are_refused_alone(runner):
    with pytest.raises(SeqWorkError, match="num_prompt") as err:
        runner.launch([SeqWork(3, [1, 2], 0, [0], True, PENALIZED),
                       SeqWork(4, [1, 2], 0, [1], True, GREEDY)])
    assert err.value.seq_ids == (3,)


def test_when_every_penalty_slot_is_held_the_next_sequence_is_refused_alone(runner):
    n = runner.limits.num_penalty_slots
    for i in range(n):
        runner.launch([SeqWork(100 + i, [1, 2], 0, [i % 8], False, PENALIZED, num_prompt=2)]).result()
    with pytest.raises(SeqWorkError, match=f"all {n} penalty slots") as err:
        runner.launch([SeqWork(999, [1, 2], 0, [9], True, PENALIZED, num_prompt=2)])
    assert err.value.seq_ids == (999,)
    for i in range(n):
        runner.forget(100 + i)
    assert runner.held()["penalty_slots"] == 0
