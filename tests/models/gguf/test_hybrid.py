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
from tests.models.test_hybrid import generate

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
