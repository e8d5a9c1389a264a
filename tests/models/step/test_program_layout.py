"""The step program's buffers, declared once (models/step/program.py: INPUTS, OUTPUTS,
WORKSPACE): the slots the entry reads match the tables, the host packs exactly what the
tables size, a reordered table gives the same step, and a view never runs past its field."""

from __future__ import annotations

import numpy as np
import pytest

import spyre_serve.models.step.memory_plan as memory_plan
import spyre_serve.models.step.program as sp
from spyre_serve.device import Card, DeviceCommandError
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from spyre_serve.models.step.buffer_layout import Field, Layout, length_slot
from spyre_serve.models.step.inputs import pack_step
from spyre_serve.models.step.memory_plan import workspace_dims
from tests.models.hf_checkpoints import write_granite_checkpoint

BLOCK = 16
TABLES = (sp.INPUTS, sp.OUTPUTS, sp.WORKSPACE)
SLOT_NAMES = [name for name, _ in sp.SLOTS]


# ---- (ii) slots: every field has its slots, the entry reads every field through Slot ------

def test_every_field_has_an_address_slot_then_its_length_slot():
    for layout in TABLES:
        for f in layout.fields:
            i = SLOT_NAMES.index(f.name)
            assert sp.SLOTS[i] == (f.name, "address")
            assert sp.SLOTS[i + 1] == (length_slot(f.name), "dim")
            assert sp.Slot[f.name] == i and sp.Slot[f.name + "_len"] == i + 1
    assert len(set(SLOT_NAMES)) == len(SLOT_NAMES) == len(sp.Slot)


def test_the_entry_reads_every_field():
    code = [sp.step_entry.py_func.__code__, sp._sample_rows.py_func.__code__]
    read = {n for c in code for n in c.co_names} & set(sp.Slot.__members__)
    fields = {f.name for layout in TABLES for f in layout.fields}
    assert fields <= read, sorted(fields - read)


def test_a_sample_row_is_a_whole_number_of_words_with_its_defaults():
    assert sp.SAMPLE_ROW.dtype.itemsize == 8 * sp.SAMPLE_ROW.words
    assert sp.SAMPLE_ROW.dtype.names == tuple(f.name for f in sp.SAMPLE_ROW.fields)
    assert sp.SAMPLE_ROW.defaults["top_p"] == 1.0 and sp.SAMPLE_ROW.defaults["pen_slot"] == -1


# ---- (iii) sizes: what the tables size is what the host packs and the card holds ----------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("layout"), vocab=256, hidden=128,
                                    layers=2, heads=4, kv_heads=1, tie=False, init_std=0.2)


def make_runner(model_dir):
    card = Card(128 << 20)
    model = load_model(model_dir, card, tokenizer=False)
    return ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK,
                       num_kv_blocks=16, seed=0)


@pytest.fixture()
def runner(model_dir):
    r = make_runner(model_dir)
    yield r
    r.close()
    r.card.close()


def allow(tokens, vocab=256):
    """A grammar bitmask (int32[ceil(V/32)]) allowing only `tokens`."""
    bits = np.zeros(vocab, np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def work_with_everything():
    """Two prefills (penalties, a ban, a logit bias, a grammar mask, prompt logprobs, top
    logprobs) and a non-sampling chunk."""
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=3, presence_penalty=0.5,
                              repetition_penalty=1.2, logprobs=3, logit_bias={40: 5.0, 41: -2.0})
    return [
        SeqWork(0, [5, 6, 7, 8, 9], 0, [0], True, sampling, prompt_logprobs=True,
                num_prompt=5, banned_token_ids=[11, 3]),
        SeqWork(1, [1, 2, 3], 0, [1], True, SamplingParams(temperature=0.0, logprobs=2),
                token_mask=allow([17, 99, 200])),
        SeqWork(2, list(range(20, 30)), 0, [2], False, SamplingParams(), prompt_logprobs=True),
    ]


def test_the_packed_inputs_are_the_table_placed_for_the_launch_dims(runner):
    work = work_with_everything()
    step = pack_step(sp.INPUTS, work, 32, 4, True, runner.limits, {}, {0: 3})
    placement = sp.INPUTS.place(step.dims)
    assert step.host.nbytes == placement.nbytes == step.placement.nbytes
    views = placement.views(step.host)
    assert views["block_tables"].shape == (4, step.dims["MB"])
    assert views["tokens"][:5].tolist() == [5, 6, 7, 8, 9]
    assert views["query_start"].tolist() == [0, 5, 8, 18, 18]
    assert views["count_slot"].tolist() == [3, -1, -1, -1] and views["prompt_lens"][0] == 5
    rows = views["sample_rows"]
    assert rows["pen_slot"].tolist() == [3, -1, -1, -1]
    assert views["ban_ids"].tolist() == [3, 11]
    assert rows["seed"][0] == 3 and rows["top_k"][:2].tolist() == [20, 0]
    assert rows["mask_row"].tolist() == [-1, 0, -1, -1]
    assert rows["temperature"][:2].tolist() == [np.float32(0.8), 0.0]
    assert rows["repetition"].tolist() == [np.float32(1.2), 1.0, 1.0, 1.0]     # padding: off
    assert views["mask_words"].tolist() == allow([17, 99, 200]).tolist()
    assert views["bias_start"].tolist() == [0, 2, 2, 2, 2]
    assert views["bias_ids"].tolist() == [40, 41] and views["bias"].tolist() == [5.0, -2.0]
    assert step.placement.nbytes <= runner.memory.inputs.nbytes


def test_only_the_rows_that_score_their_prompt_are_read_back(runner):
    """Without return_rows a step adds log-softmax rows for the prompt-logprob items alone
    (items 0 and 2: 5 + 10 rows after the 4 sampling rows), not for every token row."""
    work = work_with_everything()
    step = pack_step(sp.INPUTS, work, 32, 4, False, runner.limits, {}, {0: 3})
    assert step.dims["R"] == 4 + 5 + 10 and step.scored_rows == {0: 0, 2: 5}
    rows = sp.INPUTS.place(step.dims).views(step.host)["logit_rows"]
    assert rows[4:].tolist() == [0, 1, 2, 3, 4, *range(8, 18)]     # item 2's tokens are rows 8..17
    plain = pack_step(sp.INPUTS, [w for w in work if not w.prompt_logprobs], 32, 4, False,
                      runner.limits, {}, {})
    assert plain.dims["R"] == plain.dims["SR"] == plain.dims["S"] and plain.scored_rows == {}


def test_the_buffers_on_the_card_are_the_tables_placed_at_capacity(runner):
    # 32 tokens, 4 seqs, 4096 positions in blocks of 16, vocabulary 256
    cap = memory_plan.Capacity(tmax=32, smax=4, rmax=32 + 4, srmax=32 + 4, mbmax=4096 // BLOCK,
                               nban_max=4 * 256, nmw_max=4 * 8, nbias_max=4 * 256)
    assert runner.memory.inputs.nbytes == sp.INPUTS.place(cap.input_dims()).nbytes
    assert all(t.nbytes == sp.OUTPUTS.place({"SR": 36, "K": sp.KMAX, "P": 4, "H": runner.config.hidden_size}).nbytes
               for t in runner.memory.outputs)
    ws = sp.WORKSPACE.place(workspace_dims(cap, runner.config))
    assert runner.memory_plan["workspace"] == ws.nbytes
    assert ws.shapes["qkv"] == (32, runner.config.q_size + 2 * runner.config.kv_size)


# ---- (i) a reordered table: the same step ----------------------------------------------------

def reordered(layout: Layout) -> Layout:
    """The same fields, in another order (reversed, then odd-even interleaved)."""
    fields = list(reversed(layout.fields))
    return Layout(layout.name, fields[1::2] + fields[0::2])


def run_steps(runner):
    """A mixed prefill with everything asked for, then three device-fed decodes."""
    outs = [runner.launch(work_with_everything(), return_logits=True).result()]
    for i in range(3):
        work = [SeqWork(0, [-1], 5 + i, [0], True, SamplingParams(temperature=0.7, seed=3,
                        presence_penalty=0.5, logprobs=3), num_generated=1 + i,
                        from_device=True, num_prompt=5),
                SeqWork(1, [-1], 3 + i, [1], True, SamplingParams(temperature=0.0),
                        from_device=True)]
        outs.append(runner.launch(work).result())
    return outs


def test_reordered_tables_give_identical_steps(model_dir, monkeypatch):
    normal = make_runner(model_dir)
    want = run_steps(normal)
    normal_offsets = normal.memory.workspace_placement.offsets
    normal.close()
    normal.card.close()
    for name in ("INPUTS", "OUTPUTS", "WORKSPACE"):
        monkeypatch.setattr(memory_plan, name, reordered(getattr(sp, name)))
    permuted = make_runner(model_dir)
    assert permuted.memory.workspace_placement.offsets != normal_offsets
    assert permuted.memory.inputs_layout.fields != sp.INPUTS.fields
    got = run_steps(permuted)
    permuted.close()
    permuted.card.close()
    assert len(want[0].prompt_logprobs) == 2 and want[0].top_ids.shape == (2, 3)
    assert want[0].token_ids[1] in (17, 99, 200)          # the grammar mask held
    for a, b in zip(want, got, strict=True):
        assert a.seq_ids == b.seq_ids
        for key in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
        for seq_id, arrays in a.prompt_logprobs.items():
            for x, y in zip(arrays, b.prompt_logprobs[seq_id], strict=True):
                np.testing.assert_array_equal(x, y)
    for seq_id, rows in want[0].logits.items():
        np.testing.assert_array_equal(rows, got[0].logits[seq_id])


# ---- the device view of a field is bounded by the field ---------------------------------

def test_a_field_shorter_than_the_entry_reads_stops_the_launch(model_dir, monkeypatch):
    short = [Field("tokens", np.int32, ("S",)) if f.name == "tokens" else f
             for f in sp.INPUTS.fields]
    monkeypatch.setattr(memory_plan, "INPUTS", Layout("inputs", short))
    r = make_runner(model_dir)
    try:
        with pytest.raises(DeviceCommandError) as err:
            r._launch(4, 1, [], False, False).result()      # 4 token rows, a 1-element field
        assert "view longer than its field" in str(err.value.__cause__)
    finally:
        r.close()
        r.card.close()


# ---- grammar masks and logit bias reach the card ------------------------------------------

def test_a_mask_and_a_logit_bias_steer_greedy_decoding_on_the_card(runner):
    greedy = SamplingParams(temperature=0.0)
    free = runner.launch([SeqWork(0, [5, 6, 7], 0, [0], True, greedy)]).result()
    free_token = int(free.token_ids[0])
    pick = (free_token + 123) % 256
    steered = runner.launch([
        SeqWork(1, [5, 6, 7], 0, [1], True, greedy, token_mask=allow([pick, 250])),
        SeqWork(2, [5, 6, 7], 0, [2], True, SamplingParams(temperature=0.0,
                                                           logit_bias={pick: 100.0})),
        SeqWork(3, [5, 6, 7], 0, [3], True, SamplingParams(temperature=0.0,
                                                           logit_bias={free_token: -100.0})),
        SeqWork(4, [5, 6, 7], 0, [4], True, greedy),
    ]).result()
    assert int(steered.token_ids[0]) in (pick, 250)
    assert int(steered.token_ids[1]) == pick
    assert int(steered.token_ids[2]) != free_token
    assert int(steered.token_ids[3]) == free_token        # a row without either is unchanged
    # the logprobs stay the raw distribution's
    np.testing.assert_allclose(steered.logprobs[3], free.logprobs[0], rtol=1e-6)


def test_bad_masks_and_biases_are_named_before_launch(runner):
    from spyre_serve.models.step.interface import SeqWorkError
    greedy = SamplingParams(temperature=0.0)
    with pytest.raises(SeqWorkError, match="token_mask must be int32"):
        runner.launch([SeqWork(0, [5], 0, [0], True, greedy, token_mask=np.zeros(3, np.int32))])
    with pytest.raises(SeqWorkError, match="logit_bias token id 256"):
        runner.launch([SeqWork(0, [5], 0, [0], True, SamplingParams(logit_bias={256: 1.0}))])
    with pytest.raises(SeqWorkError, match="logit_bias"):
        runner.launch([SeqWork(0, [5], 0, [0], True, SamplingParams(logit_bias={3: 101.0}))])
