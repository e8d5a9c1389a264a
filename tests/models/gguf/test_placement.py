"""A GGUF file sized from its header (models/gguf/placement.py, ``spyre-serve plan``): each fused
GEMM weight's format decided on one block of each part's type is the format the placer gives
the file's real blocks, and the plan's weights are the bytes the loaded model holds."""

from __future__ import annotations

import io
import itertools

import pytest
from gguf import GGUFWriter

from spyre_serve.device import Card
from spyre_serve.device.layout import QuantizedWeight
from spyre_serve.models import file_gemm_formats, load_model, model_config
from spyre_serve.models.gguf.file import quantized_tensor, read_gguf
from spyre_serve.models.gguf.placement import placed_format
from spyre_serve.models.sizing.fit import plan_fit, weight_bytes
from spyre_serve.server.launch.cli import parse_command
from spyre_serve.server.launch.plan import plan
from tests.models.gguf.test_checkpoint import k_quant_file, model_of
from tests.models.gguf.test_kquants import KEPT, random_blocks
from tests.models.gguf_files import Q, write_gguf

TYPES = KEPT      # every quantized type the loader keeps at its width


@pytest.fixture(scope="module")
def real_blocks(tmp_path_factory):
    """Each type's random blocks (every quant and scale pattern) as the loader reads them."""
    path = tmp_path_factory.mktemp("types") / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    for t in TYPES:
        w.add_tensor(f"{t.name}.weight", random_blocks(t, 4, 512, seed=int(t)), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_gguf(path)
    return {t: quantized_tensor(f, f.tensors[f"{t.name}.weight"]) for t in TYPES}


def test_the_header_decides_each_fused_format_as_the_placer_does_on_real_blocks(real_blocks):
    """Every group of one to three parts (q, k, v; gate, up): the format from the types alone
    is in_one_format's on the file's real blocks, or the float width where it gives none."""
    assert len(set(TYPES)) == 8
    for n in (1, 2, 3):
        for types in itertools.product(TYPES, repeat=n):
            real = QuantizedWeight.in_one_format([real_blocks[t] for t in types])
            want = "bfloat16" if real is None else real[0].name
            assert placed_format(list(types), "bfloat16") == want, [t.name for t in types]
    assert placed_format([Q.Q5_0, Q.Q5_0, Q.Q8_0], "float32") == "Q8_0"      # SmolLM2's Q4_K_M
    assert placed_format([Q.Q4_K, Q.Q4_K, Q.Q6_K], "float32") == "Q6_K_MIN"  # a larger model's
    assert placed_format([Q.Q8_0, Q.Q6_K], "float32") == "float32"
    assert placed_format([Q.Q4_K, Q.F16], "bfloat16") == "bfloat16"           # a float part


def q5_file(tmp_path):
    """SmolLM2's Q4_K_M as llama.cpp makes it at rows of 576: Q5_0, a Q8_0 v_proj and LM head."""
    config, tensors = model_of("llama-untied")
    eight = {n: Q.Q8_0 for n in tensors if n.endswith("v_proj.weight") or n == "lm_head.weight"}
    write_gguf(tmp_path / "q5.gguf", config, tensors, qtype=Q.Q5_0, types=eight)
    return tmp_path / "q5.gguf"


@pytest.mark.parametrize("make", [k_quant_file, q5_file])
def test_the_plans_weights_are_what_the_loaded_file_holds(tmp_path, make):
    made = make(tmp_path)
    path = str(made[0] if isinstance(made, tuple) else made)
    cfg = model_config(path)
    formats = file_gemm_formats(path, "float32")
    with Card(64 << 20) as card:
        model = load_model(path, card, tokenizer=False)
        assert weight_bytes(cfg, "float32", formats=formats) == model.weights.nbytes
        layer = model.weights.layers[0]
        assert [formats[m][0] for m in ("qkv", "o", "gate_up", "down")] == \
            [layer.qkv.format_name, layer.o.format_name, layer.gate_up.format_name, layer.down.format_name]
        assert (formats["embed"], formats["lm_head"]) == \
            (model.weights.embed.format_name, model.weights.lm_head.format_name)
    command, s = parse_command(["plan", "--model", path, "--max-model-len", "256", "--max-num-seqs", "4"])
    out = io.StringIO()
    assert plan(s, out) == 0, out.getvalue()
    text = out.getvalue()
    assert "KV cache bfloat16" in text          # beside int8 inputs, as the server keeps it
    assert ("Q6_K_MIN x " in text and "Q4_K x " in text) if make is k_quant_file else \
        ("Q8_0 x " in text and "Q5_K x " in text)
    fit = plan_fit(cfg, dtype="float32", kv_dtype="bfloat16", tp=1, max_num_seqs=4,
                   max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=256, block_size=64,
                   formats=formats)
    assert fit.weights == model.weights.nbytes and f"{fit.left / 1e9:.2f} GB left" in text


def test_a_quantized_file_is_not_planned_over_several_cards_nor_a_quantized_hybrid(tmp_path):
    """Refused as the server refuses them (one line, exit 1); a hybrid file of float matrices
    is sized as its float checkpoint is."""
    from tests.models.gguf.test_hybrid import VARIANTS
    from tests.models.gguf_files import write_hybrid_gguf
    from tests.models.hf_checkpoints import write_hybrid_checkpoint

    hf, ref = write_hybrid_checkpoint(tmp_path / "hf", **VARIANTS["dense"])
    for qtype in (Q.Q8_0, Q.F32):
        write_hybrid_gguf(tmp_path / f"h.{qtype.name}.gguf", ref, hf, qtype=qtype)
    for path, tp, why in ((q5_file(tmp_path), 2, "tensor parallelism takes float checkpoints"),
                          (tmp_path / "h.Q8_0.gguf", 1, "a quantized granitehybrid file (Mamba-2 layers or experts)"),
                          (tmp_path / "h.F32.gguf", 1, None)):
        command, s = parse_command(["plan", "--model", str(path), "--tensor-parallel-size", str(tp),
                                    "--max-model-len", "256"])
        out = io.StringIO()
        if why is None:
            assert plan(s, out) == 0 and "weights float32, KV cache float32" in out.getvalue(), out.getvalue()
            with Card(64 << 20) as card:
                cfg = model_config(str(path))
                assert cfg.mamba_layers
                assert weight_bytes(cfg, "float32") == load_model(path, card, tokenizer=False).weights.nbytes
            continue
        assert plan(s, out) == 1
        assert why in out.getvalue() and len(out.getvalue().splitlines()) == 1, out.getvalue()
