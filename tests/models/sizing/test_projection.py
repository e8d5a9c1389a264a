"""The real card's clock for a step (models/sizing/projection.py): a whole decode step of a tiny model
computed by hand, kernel by kernel; the all-reduces and the shards at tp 2; a request's chunked
prefill and decode steps; the shape of a launch's work; and Granite 3.3 8B's decode, which
must be the time to read its weights once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spyre_serve.models.checkpoints.profiles import PROFILES
from spyre_serve.models.config import GraniteConfig, MambaShape
from spyre_serve.models.sizing.projection import (
    KERNELS,
    LORA_MODULES,
    AdapterRows,
    StepProjector,
    StepShape,
    decode_step,
    prefill_steps,
    project_request,
    project_step,
    shard,
    step_of_work,
)
from spyre_serve.models.step.interface import SamplingParams, SeqWork

GB = 1e9
TURN = 2 / (105 * GB) - 2 / (150 * GB)
GRANITE_8B = replace(PROFILES["granite-8b-layers"].config, num_hidden_layers=40)


def mem(read: float, written: float) -> float:
    """Seconds to read and write device memory: 150 GB/s one way, 105 GB/s balanced."""
    return (read + written) / (150 * GB) + TURN * min(read, written)


def tiny(layers: int = 1, **fields) -> GraniteConfig:
    """H 128, 2 query heads and 1 KV head of 64, MLP 256, vocab 1000 (1024 padded)."""
    base = dict(architecture="GraniteForCausalLM", vocab_size=1000, hidden_size=128,
                intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=1e4, tie_word_embeddings=True, embedding_multiplier=1.0,
                attention_multiplier=1 / 64, residual_multiplier=1.0, logits_scaling=1.0,
                bos_token_id=0, eos_token_id=[0], pad_token_id=0, torch_dtype="float32")
    return GraniteConfig(**{**base, **fields})


def test_a_decode_step_of_a_tiny_model_by_hand():
    cost = project_step(tiny(), decode_step(1, 100))      # one sequence, 100 tokens after the step
    # fp16 rows in whole 64-value sticks: [H] 256 bytes, [Hq D] 256, [Hkv D] 128, [QKV] 512,
    # [2I] 1024, [I] 512, [V] 1024 values = 2048 bytes
    expected = {
        "embedding": mem(256, 256),                       # its row of the table, written
        "rmsnorm": 2 * mem(256 + 256, 256)                # two a layer: weights + row in, row out
                   + mem(256 + 256, 256),                 # the final one, on the logit row
        "qkv": mem(128 * 512 + 256, 512),                 # W [128, 256] + row in, [256] out
        "rope": mem(256 + 128, 256 + 128),                # q and k in and out
        "write_kv": mem(2 * 128, 2 * 128),                # k and v rows into the cache
        # the context's 100 tokens read as two whole 64-token blocks: 128 x (K + V) x 64 x 2
        # bytes; q in, out written
        "attention": mem(128 * 2 * 64 * 2 + 256, 256),
        "o_proj": mem(128 * 256 + 256, 256),
        "residual": 2 * mem(2 * 256, 256),
        "gate_up": mem(128 * 1024 + 256, 1024),
        "swiglu": mem(1024, 512),
        "down": mem(256 * 256 + 512, 256),
        "lm_head": mem(128 * 2048 + 256, 2048),
        "sampling": mem(2 * 2048, 8),                     # two passes over the logits, id + logprob back
        "all_reduce": 0.0, "logits_gather": 0.0,          # one card
        "lora": 0.0,                                      # no adapter
        # a dense model: no Mamba-2 layer, no experts
        "mamba_in": 0.0, "mamba_conv": 0.0, "ssm_scan": 0.0, "mamba_norm": 0.0, "mamba_out": 0.0,
        "router": 0.0, "experts": 0.0,
        # token, position, slot, source, LoRA slot (20) + the sequence's fields (88) + 2 blocks (8)
        # + 8 back
        "pcie": 124 / (64 * GB),
        "launch": 50e-6,
    }
    assert set(cost.by_kernel) == set(KERNELS) == set(expected)
    for name, seconds in expected.items():
        assert cost.by_kernel[name] == pytest.approx(seconds, rel=1e-12, abs=1e-18), name
    assert cost.seconds == pytest.approx(sum(expected.values()))
    # every GEMM here is bandwidth-bound: its FLOPs take a fraction of its bytes' time
    assert 2 * 128 * 256 / 72.96e12 < expected["qkv"] / 100


def test_the_all_reduces_and_shards_at_tp_2():
    config = tiny(layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    step = StepShape((4,), (4,), 1)                       # a 4-token prefill
    one, two = project_step(config, step, tp=1), project_step(config, step, tp=2)
    # 2 per layer and the vocabulary-sharded embedding's: 7 ring all-reduces of [4, 256] fp16
    ring = 2 * (10e-6 + 4 * 256 * 2 / 2 / (64 * GB))
    assert two.by_kernel["all_reduce"] == pytest.approx(7 * ring) and one.by_kernel["all_reduce"] == 0
    # the logits: each card's [1, 500 -> 512] fp16, gathered in one ring step
    assert two.by_kernel["logits_gather"] == pytest.approx(10e-6 + 512 * 2 / (64 * GB))
    # each card reads half of each projection: QKV's columns [256, (2 + 2) 64], down's rows [128, 256]
    assert two.by_kernel["qkv"] == pytest.approx(3 * mem(256 * 256 * 2 + 4 * 512, 4 * 512))
    assert two.by_kernel["down"] == pytest.approx(3 * mem(128 * 512 + 4 * 256, 4 * 512))
    assert shard(config, 2) == (2, 1, 128, 500) and shard(config, 4) == (1, 1, 64, 250)  # KV replicated


def test_shards_that_do_not_split_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="tensor parallel 3 does not split 32 query heads, 8 KV heads"):
        shard(GRANITE_8B, 3)
    with pytest.raises(ValueError, match="unknown matrices \\['attn'\\]"):
        project_step(tiny(), decode_step(1, 1), formats={"attn": "fp16"})
    with pytest.raises(ValueError, match="1 <= queries <= context"):
        StepShape((5,), (4,), 1)


def test_a_request_is_its_prefill_chunks_then_its_decode_steps():
    config = tiny(layers=2)
    ttft, tpot = project_request(config, prompt_tokens=200, output_tokens=3, batch=4, chunk=128)
    chunks = [StepShape((128,), (128,), 0), StepShape((72,), (200,), 1)]   # the last samples
    assert ttft == pytest.approx(sum(project_step(config, s).seconds for s in chunks))
    decodes = [project_step(config, decode_step(4, c)).seconds for c in (201, 202)]
    assert tpot == pytest.approx(sum(decodes) / 2)
    assert project_request(config, 200, 1, 1, chunk=128)[1] == 0.0        # no later token
    assert prefill_steps(200, 128) == chunks and prefill_steps(64, 512) == [StepShape((64,), (64,), 1)]
    with pytest.raises(ValueError, match="chunks of 100: .* a positive multiple of the 64-token block"):
        project_request(config, 200, 3, 1, chunk=100)


def test_formats_and_the_kv_cache_width_change_the_bytes():
    step = decode_step(1, 100)
    fp16 = project_step(tiny(), step)
    int8 = project_step(tiny(), step, formats={"qkv": "int8"}, kv_bytes=1)
    assert int8.by_kernel["qkv"] == pytest.approx(mem(128 * 256 + 256, 512))   # 1-byte weight rows
    assert int8.by_kernel["attention"] == pytest.approx(mem(128 * 2 * 64 + 256, 256))
    assert int8.by_kernel["gate_up"] == fp16.by_kernel["gate_up"]


def test_the_shape_of_a_launchs_work():
    greedy = SamplingParams(temperature=0)
    work = [SeqWork(1, list(range(64)), 128, [0, 1, 2], True, greedy),        # a prefill's last chunk
            SeqWork(2, [5], 40, [3], True, greedy, num_generated=3),         # a decode
            SeqWork(3, list(range(10)), 0, [4], False, greedy, prompt_logprobs=True)]
    step = step_of_work(work)
    assert (step.queries, step.contexts, step.logit_rows) == ((64, 1, 10), (192, 41, 10), 12)
    assert (step.tokens, step.seqs) == (75, 3)
    assert StepProjector(tiny()).seconds(step_of_work([])) == 0.0                 # nothing launched


def test_lora_adapters_by_hand():
    # tiny: H 128, q 128 wide, k and v 64, MLP 256; rank 16: an [r] fp16 row is one 128-byte stick
    projector = StepProjector(tiny(layers=2))
    one = StepShape((1,), (100,), 1, (AdapterRows(1, ("q_proj", "down_proj"), 16),))
    # per module: A [16, K] and B^T [16, N] once; per row x [K] in, the [16] product out and in,
    # y [N] in and out
    q = mem(16 * (256 + 256) + 256 + 128 + 256, 128 + 256)
    down = mem(16 * (512 + 256) + 512 + 128 + 256, 128 + 256)
    assert projector.project(one).by_kernel["lora"] == pytest.approx(2 * (q + down), rel=1e-12)
    base = projector.project(StepShape((1,), (100,), 1))
    assert projector.seconds(one) == pytest.approx(base.seconds + 2 * (q + down))
    # two adapters read their weights each; three rows of one adapter read them once; an
    # adapter of rank 4 reads its own 4 rows of A and B
    two = StepShape((2, 1), (50, 60), 2, (AdapterRows(2, ("q_proj",), 16), AdapterRows(1, ("q_proj",), 4)))
    q2 = mem(16 * 512 + 2 * 640, 2 * 384)
    q4 = mem(4 * 512 + 640, 384)
    assert projector.project(two).by_kernel["lora"] == pytest.approx(2 * (q2 + q4), rel=1e-12)
    greedy = SamplingParams(temperature=0)
    work = [SeqWork(1, [5], 40, [3], True, greedy, lora="a"), SeqWork(2, [6, 7], 9, [4], True, greedy),
            SeqWork(3, [8], 20, [5], True, greedy, lora="a")]
    step = step_of_work(work, {1: (0, ("q_proj",), 8), 3: (0, ("q_proj",), 8)})
    assert step.adapters == (AdapterRows(2, ("q_proj",), 8),)
    with pytest.raises(ValueError, match="unknown: \\['lm_head'\\]"):
        StepShape((1,), (1,), 1, (AdapterRows(1, ("lm_head",), 8),))
    with pytest.raises(ValueError, match="3 rows in all at most the 1 tokens"):
        StepShape((1,), (1,), 1, (AdapterRows(3, ("q_proj",), 8),))


def test_the_lora_modules_priced_are_the_arenas():
    from spyre_serve.models.lora.layout import MODULES

    assert LORA_MODULES == MODULES


def test_granite_8b_decode_reads_its_weights_once_and_tp_divides_it():
    weights = 40 * (4096 * 6144 + 4096 * 4096 + 4096 * 25600 + 12800 * 4096) * 2 + 4096 * 49216 * 2
    one = project_step(GRANITE_8B, decode_step(1, 1024))
    assert one.seconds == pytest.approx(weights / (150 * GB), rel=0.02)        # 109 ms of 16.3 GB
    four = project_step(GRANITE_8B, decode_step(1, 1024), tp=4)
    assert four.seconds < one.seconds / 3 and four.by_kernel["all_reduce"] > 81 * 60e-6
    prefill = project_step(GRANITE_8B, StepShape((512,), (512,), 1))
    # at 512 rows the MLP's GEMMs are about as long in FLOPs as in bytes
    assert prefill.by_kernel["gate_up"] == pytest.approx(40 * 2 * 512 * 4096 * 25600 / 72.96e12, rel=0.2)


def tiny_encoder(layers: int = 1):
    """H 128, 2 heads of 64, MLP 256, vocab 1000: RoBERTa's shape, small."""
    from spyre_serve.models.encoder.config import EncoderConfig

    return EncoderConfig(architecture="XLMRobertaModel", vocab_size=1000, hidden_size=128,
                         num_hidden_layers=layers, num_attention_heads=2, intermediate_size=256,
                         max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5,
                         pad_token_id=1, bos_token_id=0, eos_token_id=[2], torch_dtype="float32")


def test_an_encoder_step_by_hand():
    from spyre_serve.models.encoder.projection import ENCODER_KERNELS, EncoderProjector

    work = [SeqWork(i, list(range(5, 5 + n)), 0, [i], False, SamplingParams(), pool=True)
            for i, n in enumerate((3, 5))]
    step = step_of_work(work)                             # two whole prompts: T 8, S 2
    assert (step.queries, step.contexts, step.logit_rows) == ((3, 5), (3, 5), 0)
    projector = EncoderProjector(tiny_encoder(), {"embed": "fp32"}, "CLS")   # GEMMs fp16
    cost = projector.project(step)
    # fp16 rows in whole 64-value sticks: [H] 256 bytes, [3H] 768, [I] 512; an fp32 [H] row 512
    expected = {
        "embedding": mem(512 + 8 * 2 * 512, 8 * 256),     # type row once; word + position rows in
        "layernorm": 3 * mem(2 * 256 + 8 * 256, 8 * 256), # the embeddings' and two a layer
        "qkv": mem(128 * 768 + 8 * 256, 8 * 768),         # W [128, 384] + rows in, rows out
        "bias": mem(768 + 8 * 768, 8 * 768) + mem(512 + 8 * 512, 8 * 512)     # qkv, up,
                + 2 * mem(256 + 8 * 256, 8 * 256),                              # o and down
        # each prompt's q, k, v rows in, out rows written; 4 H (3 x 3 + 5 x 5) FLOPs: not the bound
        "attention": mem(3 * 8 * 256, 8 * 256),
        "o_proj": mem(128 * 256 + 8 * 256, 8 * 256),
        "residual": 2 * mem(2 * 8 * 256, 8 * 256),
        "up": mem(128 * 512 + 8 * 256, 8 * 512),
        "gelu": mem(8 * 512, 8 * 512),
        "down": mem(256 * 256 + 8 * 512, 8 * 256),
        "pooling": mem(2 * 256, 2 * 256),                 # CLS: one row of each prompt in, one out
        # tokens and positions (8 a row) + query_start (3 x 4) in, two float32 [128] rows back
        "pcie": (8 * 8 + 3 * 4 + 2 * 128 * 4) / (64 * GB),
        "launch": 50e-6,
    }
    assert set(cost.by_kernel) == set(ENCODER_KERNELS) == set(expected)
    for name, seconds in expected.items():
        assert cost.by_kernel[name] == pytest.approx(seconds, rel=1e-12, abs=1e-18), name
    assert cost.seconds == pytest.approx(sum(expected.values()))
    assert 4 * 128 * (9 + 25) / 72.96e12 < expected["attention"] / 10
    mean = EncoderProjector(tiny_encoder(), {"embed": "fp32"}, "MEAN").project(step)
    assert mean.by_kernel["pooling"] == pytest.approx(mem(8 * 256, 2 * 256))   # every row in
    two = EncoderProjector(tiny_encoder(layers=2), {"embed": "fp32"}, "CLS").project(step)
    assert two.by_kernel["layernorm"] == pytest.approx(5 * mem(2 * 256 + 8 * 256, 8 * 256))
    assert two.by_kernel["qkv"] == pytest.approx(2 * expected["qkv"])
    with pytest.raises(ValueError, match="unknown matrices \\['gate_up'\\]"):
        EncoderProjector(tiny_encoder(), {"gate_up": "fp16"})


def hybrid(kinds=("mamba", "attention"), experts: int = 0) -> GraniteConfig:
    """tiny() with Granite 4.0's layers: Mamba-2 mixers of 2 heads of 64 (state 16, one group,
    conv 4: 160 channels, in_proj 290 wide) and `experts` experts of 64, 2 a token."""
    m = MambaShape(n_heads=2, head_dim=64, d_state=16, n_groups=1, d_conv=4, conv_bias=True, dt_min=0.0,
                   dt_max=float("inf"), chunk_size=256)
    return tiny(layers=len(kinds), architecture="GraniteMoeHybridForCausalLM", layer_kinds=tuple(kinds),
                rope=False, mamba=m, num_experts=experts, num_experts_per_tok=2 if experts else 0,
                expert_intermediate_size=64 if experts else 0)


def test_a_hybrids_attention_is_its_attention_layers_and_its_mamba_layers_are_priced_by_hand():
    step = decode_step(3, 100)
    dense, mixed = project_step(tiny(layers=2), step), project_step(hybrid(), step)
    for name in ("qkv", "rope", "write_kv", "attention", "o_proj"):           # one layer of two
        assert mixed.by_kernel[name] == pytest.approx(dense.by_kernel[name] / 2), name
    for name in ("rmsnorm", "residual", "gate_up", "swiglu", "down", "lm_head"):  # every layer's
        assert mixed.by_kernel[name] == pytest.approx(dense.by_kernel[name]), name
    # three rows through one Mamba layer: fp16 rows in whole 64-value sticks (in_proj 290 -> 320
    # values, 640 bytes; the conv's 160 -> 192, 384; x B C dt 162 -> 192; y [128] 256)
    rows = 3
    assert mixed.by_kernel["mamba_in"] == pytest.approx(mem(128 * 640 + rows * 256, rows * 640))
    assert mixed.by_kernel["mamba_conv"] == pytest.approx(mem(rows * 384, rows * 384))
    assert mixed.by_kernel["mamba_out"] == pytest.approx(mem(128 * 256 + rows * 256, rows * 256))
    # the scan: its rows, then each sequence's float32 states read and written once
    states = 3 * 2 * 4 * (3 * 160 + 2 * 64 * 16)
    assert mixed.by_kernel["ssm_scan"] == pytest.approx(mem(rows * 384, rows * 256) + states / (150 * GB))


def test_experts_read_the_matrices_of_the_experts_the_rows_choose():
    one = project_step(hybrid(("attention",), experts=8), decode_step(1, 10)).by_kernel["experts"]
    # one row, 2 experts: their gate/up [128, 128] and down [64, 128] in fp16 (256 bytes a row), and
    # the row through them: x in twice, [2I] and [I] out and back in, y out twice
    weight = 128 * 256 + 64 * 256
    row_in, row_out = 2 * (2 * 256 + 256 + 2 * 128), 2 * 256
    assert one == pytest.approx(mem(2 * weight + row_in, row_out))
    # a wide prefill chooses nearly every expert: the weights read approach all eight once
    wide = project_step(hybrid(("attention",), experts=8), StepShape((512,), (512,), 1)).by_kernel["experts"]
    assert 7.9 * weight / (150 * GB) < wide < 8 * weight / (150 * GB) + 512 * 2 * (row_in + row_out) / (105 * GB)
