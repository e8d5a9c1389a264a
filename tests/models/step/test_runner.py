"""ModelRunner mechanics: buckets, warm-up, launches that never compile, device-fed decode,
padding, and the errors a caller gets."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model
from tests.models.hf_checkpoints import write_granite_checkpoint

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_granite_checkpoint(tmp_path_factory.mktemp("runner"), vocab=256, hidden=128,
                                    layers=2, heads=4, kv_heads=1, tie=False, init_std=0.2)


@pytest.fixture()
def runner(model_dir):
    card = Card(128 << 20)
    model = load_model(model_dir, card, tokenizer=False)
    r = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK,
                    num_kv_blocks=16, seed=0)
    yield r
    r.close()
    card.close()


def prefill(seq_id, ids, blocks, sample=True, start=0):
    return SeqWork(seq_id=seq_id, token_ids=ids, start_pos=start, block_table=blocks,
                   sample=sample, sampling=GREEDY)


def test_buckets_are_powers_of_two_up_to_the_limits(runner):
    assert runner.t_buckets == [1, 2, 4, 8, 16, 32]
    assert runner.s_buckets == [1, 2, 4]
    assert all(s <= t for t, s in runner.bucket_shapes())
    assert len(runner.bucket_shapes()) == 1 + 2 + 3 * 4


def test_a_step_runs_in_the_smallest_bucket_that_fits(runner):
    h = runner.launch([prefill(0, [1, 2, 3], [0]), prefill(1, [4, 5], [1])])
    h.result()
    assert h.bucket == (8, 2)


def test_after_warmup_launches_of_any_shape_never_compile(runner):
    runner.warmup(progress=False)
    assert len(runner.programs) == len(runner.bucket_shapes())
    before = runner.card.counters.snapshot()
    rng = np.random.default_rng(0)
    for _ in range(40):
        n_seq = int(rng.integers(1, 5))
        work = []
        for i in range(n_seq):
            n = int(rng.integers(1, 32 // n_seq + 1))
            work.append(prefill(i, rng.integers(0, 256, n).tolist(), [4 * i, 4 * i + 1],
                                sample=bool(rng.integers(0, 2)) or i == 0))
        runner.launch(work).result()
    after = runner.card.counters.snapshot()
    assert after["compiles"] == before["compiles"]
    assert after.get("cache_loads", 0) == before.get("cache_loads", 0)
    assert after["prepares"] == before["prepares"]
    assert after["launches"] == before["launches"] + 40


def test_device_fed_decode_launched_ahead_equals_host_fed_decode(runner):
    prompt = [7, 8, 9, 10, 11]
    # host-fed: read each token back, feed it in
    first = runner.launch([prefill(0, prompt, [0])]).result().token_ids[0]
    host = [int(first)]
    for i in range(6):
        w = SeqWork(0, [host[-1]], len(prompt) + i, [0], True, GREEDY)
        host.append(int(runner.launch([w]).result().token_ids[0]))
    # device-fed: all launches enqueued before any result is read
    handles = [runner.launch([prefill(0, prompt, [1])])]
    for i in range(6):
        w = SeqWork(0, [-1], len(prompt) + i, [1], True, GREEDY, from_device=True)
        handles.append(runner.launch([w]))
    device = [int(h.result().token_ids[0]) for h in handles]
    assert device == host


def test_padding_rows_are_not_computed_and_write_nothing(runner):
    for t in runner.kv.k + runner.kv.v:
        t.numpy()[...] = 0
    runner.launch([prefill(0, [1, 2, 3], [5])]).result()          # 3 tokens in bucket 4
    for layer in runner.kv.v:
        v = layer.numpy()                                          # [NB + 1, Hkv, BS, D]
        written = np.flatnonzero(np.abs(v).sum(axis=(1, 3)).ravel())  # slot = block * BS + offset
        assert written.tolist() == [5 * BLOCK, 5 * BLOCK + 1, 5 * BLOCK + 2]   # not the trash block


def test_too_many_tokens_is_refused_with_the_numbers(runner):
    with pytest.raises(ValueError, match="33 tokens exceed max_num_batched_tokens 32"):
        runner.launch([prefill(0, list(range(33)), [0, 1, 2])])


def test_short_block_table_is_refused(runner):
    with pytest.raises(ValueError, match="block table has 1 blocks, 17 tokens need 2"):
        runner.launch([prefill(0, list(range(17)), [0])])


def test_device_decode_without_a_previous_sample_is_refused(runner):
    runner.launch([prefill(0, [1, 2], [0])]).result()
    with pytest.raises(ValueError, match="seq 9: from_device, but it did not sample"):
        runner.launch([SeqWork(9, [-1], 2, [1], True, GREEDY, from_device=True)])


def test_token_outside_the_vocabulary_is_refused(runner):
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        runner.launch([prefill(0, [1, 256], [0])])


def test_kv_blocks_come_from_the_memory_left(model_dir):
    card = Card(64 << 20)
    model = load_model(model_dir, card, tokenizer=False)
    r = ModelRunner(model, card, max_num_seqs=2, max_num_batched_tokens=16, block_size=BLOCK,
                    kv_cache_fraction=0.5)
    left = card.allocator.stats().largest_free
    assert r.num_kv_blocks > 100
    assert r.kv.nbytes <= 0.5 * (left + r.kv.nbytes) + 1
    r.close()
    card.close()


def test_eager_baseline_computes_the_same_greedy_tokens(runner):
    from spyre_serve.models.eager import EagerModel

    eager = EagerModel(runner.model, runner.card, block_size=BLOCK, num_kv_blocks=8)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    work = [prefill(i, p, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    want = runner.launch(work).result().token_ids
    got = eager.step(work)
    eager.close()
    assert got.tolist() == want.tolist()


def test_block_id_outside_the_cache_is_refused(runner):
    with pytest.raises(ValueError, match=r"block ids must be in 0..15, got 3..16"):
        runner.launch([prefill(0, list(range(20)), [3, 16])])


def banned(w: SeqWork, ids) -> SeqWork:
    w.banned_token_ids = [int(t) for t in ids]
    return w


def test_a_banned_top_token_makes_greedy_pick_the_second(runner):
    prompt = [3, 1, 4, 1, 5]
    out = runner.launch([prefill(0, prompt, [0])], return_logits=True).result()
    row = out.logits[0][-1].astype(np.float64)
    order = np.argsort(-row)
    assert row[order[0]] - row[order[1]] > 1e-4 and row[order[1]] - row[order[2]] > 1e-4
    assert out.token_ids[0] == order[0]
    work = [banned(prefill(1, prompt, [1]), [order[0]]),
            prefill(2, prompt, [2]),
            banned(prefill(3, prompt, [3]), [order[0], order[1], order[0]])]
    got = runner.launch(work).result()
    assert got.token_ids.tolist() == [order[1], order[0], order[2]]
    # the logprob is still the one of the raw distribution
    lsm = row - row.max() - np.log(np.exp(row - row.max()).sum())
    np.testing.assert_allclose(got.logprobs, lsm[[order[1], order[0], order[2]]], rtol=1e-4, atol=1e-5)


def test_a_ban_applies_to_a_device_fed_decode(runner):
    prompt = [7, 8, 9]
    first = runner.launch([prefill(0, prompt, [0])]).result().token_ids[0]
    h = runner.launch([SeqWork(0, [int(first)], 3, [0], True, GREEDY)], return_logits=True)
    free = h.result()
    row = free.logits[0][0]
    order = np.argsort(-row)
    # the same decode, launched ahead with the token read on the device and the top one banned
    runner.launch([prefill(1, prompt, [1])])
    w = banned(SeqWork(1, [-1], 3, [1], True, GREEDY, from_device=True), [order[0]])
    assert runner.launch([w]).result().token_ids[0] == order[1]


def test_a_banned_token_outside_the_vocabulary_is_refused(runner):
    with pytest.raises(ValueError, match="seq 0: banned token id 256 is outside the vocabulary"):
        runner.launch([banned(prefill(0, [1, 2], [0]), [0, 256])])


def test_the_memory_plan_adds_up_to_scratch_bytes_and_the_kv_cache(runner):
    plan = runner.memory_plan
    assert set(plan) == {"workspace", "io", "layer_table", "kv_cache"}
    assert plan["workspace"] + plan["io"] + plan["layer_table"] == runner.scratch_bytes
    assert plan["kv_cache"] == runner.kv.nbytes and min(plan.values()) > 0


def test_the_compute_stream_runs_its_kernels_on_every_core_and_blas_on_one(runner):
    from threadpoolctl import threadpool_info

    seen = []
    runner.launch([prefill(0, [3, 1, 4, 1, 5], [0])]).result()
    runner.stream.enqueue(lambda: seen.append(numba.get_num_threads()), compute=False,
                          label="probe")
    runner.stream.synchronize()
    assert seen == [numba.config.NUMBA_NUM_THREADS]
    # the OpenBLAS Numba's np.dot calls: scipy's bundled one (numpy has its own, unused here)
    blas = [p for p in threadpool_info()
            if p["internal_api"] == "openblas" and "scipy.libs" in p["filepath"]]
    assert blas and all(p["num_threads"] == 1 for p in blas)


def test_warmup_progress_to_a_log_file_is_a_start_and_an_end_not_a_redraw_per_program(
        runner, capsys):
    runner.warmup(progress=True)                  # pytest's captured stderr is not a terminal
    err = capsys.readouterr().err
    draws = err.replace("\r", "\n").split("\n")
    bars = [d for d in draws if d.startswith("preparing step programs")]
    assert 1 <= len(bars) <= 3, bars
    assert f"{len(runner.bucket_shapes())}/{len(runner.bucket_shapes())}" in bars[-1]
