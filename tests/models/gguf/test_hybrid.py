"""Granite 4.0 hybrids and Granite 3.x MoE from llama.cpp's GGUF (models/gguf/hybrid.py): small
random checkpoints written by transformers, converted as llama.cpp's converter converts them
(tests/models/gguf_files.py's write_hybrid_gguf), served from the GGUF file token-exact against
transformers on the original checkpoint (float32), prompts crossing the SSM chunks."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, load_model
from spyre_serve.models.gguf.checkpoint import GGUFError, gguf_config, load_gguf_checkpoint
from spyre_serve.models.gguf.file import read_gguf
from tests.models.gguf_files import write_hybrid_gguf
from tests.models.hf_checkpoints import write_hybrid_checkpoint, write_moe_checkpoint
from tests.models.test_hybrid import generate, greedy_on_card

VARIANTS = {
    # Granite 4.0-H-Tiny's kind: experts beside the shared MLP, attention without positions
    "moe": dict(layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                position_embedding_type="nope"),
    # Granite 4.0-H-Micro's kind: a dense MLP only (llama.cpp writes it as ffn_gate/up/down)
    "dense": dict(layer_types=["mamba", "mamba", "attention"], num_local_experts=0, position_embedding_type="nope"),
}


def reference(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, end-of-sequence included (the runner has no minimum length)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, ref(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def converted(where, name: str):
    if name.startswith("granitemoe"):
        hf, ref = write_moe_checkpoint(where / "hf", shared=name == "granitemoeshared")
    else:
        hf, ref = write_hybrid_checkpoint(where / "hf", **VARIANTS[name])
    path = where / "m.gguf"
    arch = write_hybrid_gguf(path, ref, hf)
    return path, ref, arch


@pytest.fixture(scope="module", params=[*VARIANTS, "granitemoe", "granitemoeshared"])
def served(request, tmp_path_factory):
    path, ref, arch = converted(tmp_path_factory.mktemp(request.param), request.param)
    card = Card(256 << 20)
    model = load_model(path, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                         num_kv_blocks=96, seed=1, compute_dtype="float32")
    yield runner, ref, arch, model
    runner.close()
    card.close()


def test_the_gguf_file_serves_the_checkpoint_it_was_converted_from(served):
    runner, ref, arch, model = served
    assert model.config.architecture == type(ref).__name__
    rng = np.random.default_rng(11)
    prompts = {i: rng.integers(0, 256, n).tolist() for i, n in enumerate((5, 70))}
    got = generate(runner, prompts, 8)
    for i, prompt in prompts.items():
        want = reference(ref, prompt, 8)
        assert len(set(want)) > 2, want
        assert got[i] == want, (arch, i, len(prompt))


def test_every_tensor_comes_back_in_hugging_faces_names_and_layout(tmp_path):
    from safetensors.numpy import load_file

    path, ref, _ = converted(tmp_path, "moe")
    ckpt = load_gguf_checkpoint(path)
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(ckpt.tensors) == set(sd)
    for name, want in sd.items():
        np.testing.assert_allclose(ckpt.tensors[name], want, rtol=2e-6, atol=1e-7, err_msg=name)
    c = ckpt.config
    assert (c.layer_kinds, c.rope, c.num_experts, c.num_experts_per_tok) == (
        ("mamba", "attention", "mamba", "mamba"), False, 4, 2)


def test_a_hybrid_with_rope_in_its_config_is_nope_in_gguf_as_llama_cpp_converts_it(tmp_path):
    """llama.cpp's converter writes rope.scaling.finetuned false for every hybrid with Mamba layers
    (only Bamba keeps RoPE): the file's attention has no positions, as llama.cpp runs it."""
    hf, ref = write_hybrid_checkpoint(tmp_path / "hf", layer_types=["mamba", "attention"], num_local_experts=0,
                                      position_embedding_type="rope")
    write_hybrid_gguf(tmp_path / "m.gguf", ref, hf)
    assert gguf_config(read_gguf(tmp_path / "m.gguf")).rope is False


def test_what_the_file_gets_wrong_is_a_gguf_error(tmp_path):
    from gguf import GGUFReader

    path, _, _ = converted(tmp_path, "dense")
    data = bytearray(path.read_bytes())
    reader = GGUFReader(path)
    a = reader.get_tensor([t.name for t in reader.tensors].index("blk.0.ssm_a"))
    start = a.data_offset
    data[start:start + 4] = np.float32(0.5).tobytes()          # A must be negative: -exp(A_log)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="blk.0.ssm_a holds A = -exp"):
        load_gguf_checkpoint(bad)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_quantized_file_is_served_at_its_width_as_its_dequantized_weights(tmp_path, qtype):
    """A Q8_0 / Q4_1 file (the matrices quantized as `--outtype q8_0` does, experts included):
    its matrices stay at their width on the card (the experts' stacks one matrix an expert,
    q/k rows put back in order), and in float32 compute the model is exactly its dequantized
    weights: transformers on them, written as a checkpoint, gives the same greedy tokens."""
    import shutil

    import torch
    from gguf import GGMLQuantizationType
    from safetensors.numpy import save_file

    from spyre_serve.device.kernels.formats import FORMATS
    from spyre_serve.device.layout import QuantizedWeight

    hf, ref = write_hybrid_checkpoint(tmp_path / "hf", **VARIANTS["moe"])
    path = tmp_path / f"m.{qtype}.gguf"
    write_hybrid_gguf(path, ref, hf, qtype=GGMLQuantizationType[qtype])
    at_width = load_gguf_checkpoint(path).tensors
    assert isinstance(at_width["model.layers.0.mamba.in_proj.weight"], QuantizedWeight)
    assert isinstance(at_width["model.layers.1.self_attn.q_proj.weight"], QuantizedWeight)
    experts = at_width["model.layers.0.block_sparse_moe.input_linear.weight"]
    assert isinstance(experts, list) and len(experts) == 4 and experts[0].name == qtype
    twin = tmp_path / "twin"                                          # what the file holds, in float32
    twin.mkdir()
    shutil.copyfile(hf / "config.json", twin / "config.json")
    held = load_gguf_checkpoint(path, quantized=False).tensors
    save_file({n: np.ascontiguousarray(t, np.float32) for n, t in held.items()}, str(twin / "model.safetensors"))
    twin_ref = type(ref).from_pretrained(twin, dtype=torch.float32).eval()
    card = Card(256 << 20)
    try:
        model = load_model(path, card, tokenizer=False)
        assert model.weights.layers[0].mamba.in_proj.fmt == FORMATS[qtype]
        for prompt, got in greedy_on_card(model, card, (6, 70)):
            assert got == reference(twin_ref, prompt, 8), (qtype, len(prompt))
    finally:
        card.close()


def test_a_gate_and_up_of_two_types_are_fused_at_a_width_that_holds_both():
    """GraniteMoe's fused gate/up (and each expert's) from halves of two quantized types: in
    one format that holds both exactly (Q4_1 beside Q4_K: Q5_K), else float32 (Q8_0 beside
    Q6_K), the values the halves hold either way."""
    from spyre_serve.device.kernels.formats import FMT_Q4_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q8_0
    from spyre_serve.device.layout import QuantizedWeight
    from spyre_serve.models.gguf.hybrid import _stack
    from tests.device.kernels.gemm.test_quantized import random_weight

    gate, up = random_weight(FMT_Q4_1, 6, 64, seed=1), random_weight(FMT_Q4_K, 6, 64, seed=2)
    want = np.concatenate([gate.dequantize(), up.dequantize()])
    fused = _stack(gate, up, axis=0)
    assert isinstance(fused, QuantizedWeight) and fused.fmt == FMT_Q5_K
    np.testing.assert_array_equal(fused.dequantize(), want)
    experts = _stack([gate, gate], [up, up], axis=1)
    assert [e.fmt for e in experts] == [FMT_Q5_K] * 2
    eight, six = random_weight(FMT_Q8_0, 6, 64), random_weight(FMT_Q6_K, 6, 64)
    widened = _stack(eight, six, axis=0)
    np.testing.assert_array_equal(widened, np.concatenate([eight.dequantize(), six.dequantize()]))
