"""GGUF files written by gguf's own writer, as llama.cpp's converter writes them, read back:
the same weights and the same model on the card as their safetensors twin; the header as
gguf's reader sees it; llama.cpp's q/k row permutation undone; what cannot be served
refused by name."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import gguf
import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.device.layout import QuantizedWeight
from spyre_serve.models import ModelRunner, load_model
from spyre_serve.models.checkpoints.hf import CheckpointError, load_checkpoint
from spyre_serve.models.checkpoints.profiles import ASSETS, TINY, InitStds, init_tensors
from spyre_serve.models.gguf.checkpoint import (
    GGUFError,
    gguf_config,
    load_gguf_checkpoint,
    read_gguf,
    unpermute_rope_rows,
)
from tests.models.gguf_files import Q, llama_cpp_permute, write_gguf, write_numpy_checkpoint
from tests.models.hf_checkpoints import granite_config, runner_greedy

# Models whose greedy output is varied (docs/design.md, "Testing with random weights").
KINDS = {
    "llama-untied": dict(llama=True, tie=False, kv_heads=2, std=0.2),
    "llama-tied": dict(llama=True, tie=True, kv_heads=2, std=1.0, layers=4),
    "granite-untied": dict(llama=False, tie=False, kv_heads=1, std=0.2),
    "granite-tied": dict(llama=False, tie=True, kv_heads=2, std=1.0, layers=4),
}
PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [250, 1, 1, 64], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
N_NEW = 8


def model_of(kind: str, vocab: int = 256, hidden: int = 128, intermediate: int = 384):
    """(config, HF tensors) of a seeded model of ``kind`` (rows in whole blocks of 32)."""
    k = KINDS[kind]
    config = granite_config(vocab=vocab, hidden=hidden, layers=k.get("layers", 2), heads=4,
                            kv_heads=k["kv_heads"], tie=k["tie"], llama=k["llama"],
                            intermediate=intermediate, max_positions=512)
    std = k["std"]
    tensors = dict(init_tensors(config, InitStds(std, std, std, std, std, 0.1), seed=7))
    return config, tensors


def gguf_and_twin(tmp_path, kind, qtype, **model):
    """A GGUF file of ``kind`` in ``qtype`` and a safetensors directory holding the same
    (dequantized) weights, in the same width as the file's (16-bit, else float32)."""
    config, tensors = model_of(kind, **model)
    path = tmp_path / f"{kind}-{qtype.name}.gguf"
    held = write_gguf(path, config, tensors, qtype=qtype)
    dtype = {Q.BF16: "bfloat16", Q.F16: "float16"}.get(qtype, "float32")
    twin = write_numpy_checkpoint(tmp_path / f"{kind}-{qtype.name}", config, held, dtype)
    return path, twin


def run(path, compute_dtype="float32"):
    """Prefill logits and greedy tokens of PROMPTS on the project's runner (float32
    activations: a quantized file computes on exactly its dequantized weights)."""
    card = Card(64 << 20)
    model = load_model(path, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                         num_kv_blocks=16, seed=0, compute_dtype=compute_dtype)
    try:
        return runner_greedy(runner, PROMPTS, N_NEW)
    finally:
        runner.close()
        card.close()


def assert_same_model_run(path, twin):
    logits, tokens = run(path)
    want_logits, want_tokens = run(twin)
    assert tokens == want_tokens
    assert len({t for seq in want_tokens for t in seq}) > N_NEW   # varied, so parity means something
    for i in want_logits:
        np.testing.assert_allclose(logits[i], want_logits[i], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the model on the card


@pytest.mark.parametrize("kind,qtype", [("llama-untied", Q.Q8_0), ("llama-tied", Q.Q4_1),
                                        ("granite-untied", Q.Q4_0), ("granite-tied", Q.BF16)])
def test_gguf_runs_as_its_safetensors_twin(tmp_path, kind, qtype):
    path, twin = gguf_and_twin(tmp_path, kind, qtype)
    assert_same_model_run(path, twin)


def k_quant_file(tmp_path):
    """A Q4_K_M-like file: Q4_K matrices with Q6_K for v_proj, down_proj and the LM head
    (rows of 256: hidden 256, MLP 512), and its safetensors twin."""
    config, tensors = model_of("llama-untied", hidden=256, intermediate=512)
    six = {n: Q.Q6_K for n in tensors if n.endswith(("v_proj.weight", "down_proj.weight"))
           or n == "lm_head.weight"}
    held = write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.Q4_K, types=six)
    types = {t.type_name for t in read_gguf(tmp_path / "m.gguf").tensors.values()}
    assert types == {"F32", "Q4_K", "Q6_K"}
    return tmp_path / "m.gguf", write_numpy_checkpoint(tmp_path / "twin", config, held)


def test_k_quant_file_runs_as_its_safetensors_twin(tmp_path, caplog):
    """Its matrices at their width on the card (Q4_K q and k beside a Q6_K v as Q6_K_MIN,
    which holds both exactly, with a log line), computing on exactly its dequantized weights
    (float32 inputs)."""
    path, twin = k_quant_file(tmp_path)
    with caplog.at_level("INFO", logger="spyre_serve.models"), Card(64 << 20) as card:
        model = load_model(path, card, tokenizer=False)
        assert set(model.weights.formats) == {"Q4_K", "Q6_K", "Q6_K_MIN"}     # none widened
    assert "parts of formats Q4_K, Q6_K are placed as Q6_K_MIN" in caplog.text
    assert_same_model_run(path, twin)


def test_a_fused_projection_of_two_types_takes_the_width_that_holds_both(tmp_path, caplog):
    """A small model's Q4_K_M file as llama.cpp makes it (rows of 576 are not super-blocks:
    Q5_0 for Q4_K, Q8_0 for Q6_K): a Q8_0 v_proj beside Q5_0 q and k is placed as Q8_0,
    exactly (Q5_0's d (q - 16)); the model runs as its twin."""
    config, tensors = model_of("llama-untied")
    eight = {n: Q.Q8_0 for n in tensors if n.endswith("v_proj.weight") or n == "lm_head.weight"}
    held = write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.Q5_0, types=eight)
    twin = write_numpy_checkpoint(tmp_path / "twin", config, held)
    with caplog.at_level("INFO", logger="spyre_serve.models"), Card(64 << 20) as card:
        model = load_model(tmp_path / "m.gguf", card, tokenizer=False)
        assert set(model.weights.formats) == {"Q5_K", "Q8_0"}      # none widened
    assert "parts of formats Q5_K, Q8_0 are placed as Q8_0" in caplog.text
    assert_same_model_run(tmp_path / "m.gguf", twin)


def test_k_quant_file_with_int8_inputs_stays_near_its_twin(tmp_path):
    """With int8 activations (the default for a quantized file, as llama.cpp's), the logits
    differ from the float32 twin's by the activations' rounding only: on average by 0.5-1.1%
    of their range on this random model (whose activations grow layer by layer), at most 11%."""
    path, twin = k_quant_file(tmp_path)
    logits, _ = run(path, compute_dtype="int8")
    want, _ = run(twin)
    for i in want:
        scale = np.abs(want[i]).max()
        diff = np.abs(logits[i] - want[i])
        assert 0 < diff.mean() < 0.03 * scale and diff.max() < 0.15 * scale


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_every_tensor_reads_back_as_written(tmp_path, qtype):
    config, tensors = model_of("granite-untied")
    held = write_gguf(tmp_path / "m.gguf", config, tensors, qtype=qtype)
    ckpt = load_gguf_checkpoint(tmp_path / "m.gguf")
    widened = load_gguf_checkpoint(tmp_path / "m.gguf", quantized=False)
    assert ckpt.tensors.keys() == held.keys() == widened.tensors.keys()
    kept = qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)    # served at their width
    card_format = {Q.Q5_0: "Q5_K", Q.Q5_1: "Q5_K"}.get(qtype, qtype.name)   # Q5_x in Q5_K's records
    for name, want in held.items():
        t = ckpt.tensors[name]
        if kept and t.__class__ is QuantizedWeight:
            assert t.name == card_format
            t = t.dequantize()
        np.testing.assert_array_equal(t, want, err_msg=name)
        assert t.dtype == np.float32
        np.testing.assert_array_equal(widened.tensors[name], want, err_msg=name)
    n_kept = sum(isinstance(t, QuantizedWeight) for t in ckpt.tensors.values())
    assert n_kept == (sum(t.ndim == 2 for t in held.values()) if kept else 0)
    assert ckpt.stored_dtypes["model.layers.0.mlp.up_proj.weight"] == qtype.name
    assert ckpt.stored_dtypes["model.norm.weight"] == "F32"
    if qtype != Q.F32:   # quantized, but close to what was quantized (Q4_0: half of amax/8)
        w = tensors["model.layers.1.mlp.down_proj.weight"]
        err = np.abs(held["model.layers.1.mlp.down_proj.weight"] - w).max()
        assert 0 < err < 0.1 * np.abs(w).max()


def test_loaded_model_reports_the_file(tmp_path):
    path, _ = gguf_and_twin(tmp_path, "llama-tied", Q.Q4_1)
    with Card(64 << 20) as card:
        model = load_model(path, card, tokenizer=False)
    assert model.name == path.name and model.path == path
    assert model.stored_dtype == "float32"       # the float tensors' width (norms)
    assert set(model.weights.formats) == {"Q4_1"}  # every matrix at the file's width
    held = sum(t.nbytes for t in read_gguf(path).tensors.values() if t.type_name == "Q4_1")
    # the card's panels hold the file's bytes: the same quants and scales, the last panel of
    # each matrix padded to 16 columns
    assert held <= model.weights.formats["Q4_1"] < 1.1 * held


# ---------------------------------------------------------------- llama.cpp's row permutation


def test_q_and_k_rows_come_back_in_hf_order(tmp_path):
    config, tensors = model_of("llama-untied")     # 4 query heads, 2 KV heads (GQA)
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.F32)
    raw = read_gguf(tmp_path / "m.gguf")
    ckpt = load_gguf_checkpoint(tmp_path / "m.gguf")
    for name, gname in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                        ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight")):
        t = raw.tensors[gname]
        stored = np.frombuffer(raw.data, np.float32, math.prod(t.shape), t.offset).reshape(t.shape)
        assert not np.array_equal(stored, tensors[name])      # the file holds permuted rows
        np.testing.assert_array_equal(ckpt.tensors[name], tensors[name])


@pytest.mark.parametrize("heads,head_dim", [(1, 2), (4, 64), (3, 6)])
def test_unpermute_inverts_llama_cpp_permute(heads, head_dim):
    w = np.random.default_rng(0).standard_normal((heads * head_dim, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)


def test_a_file_without_the_permutation_computes_another_model(tmp_path):
    """The permutation matters: rows left in GGML's order give other logits."""
    config, tensors = model_of("llama-untied")
    write_gguf(tmp_path / "right.gguf", config, tensors)
    write_gguf(tmp_path / "wrong.gguf", config, tensors, permute=False)
    right, _ = run(tmp_path / "right.gguf")
    wrong, _ = run(tmp_path / "wrong.gguf")
    assert not np.allclose(right[0], wrong[0], atol=1e-3)


# ---------------------------------------------------------------- config from the metadata


def test_granite_multipliers_and_shape_come_from_the_metadata(tmp_path):
    config, tensors = model_of("granite-tied")
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.Q8_0)
    got = gguf_config(read_gguf(tmp_path / "m.gguf"))
    for field in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                  "logits_scaling", "rms_norm_eps"):        # float32 in the file
        assert getattr(got, field) == pytest.approx(getattr(config, field), rel=1e-6), field
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "rope_theta", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(got, field) == getattr(config, field), field


def test_granite_without_multipliers_gets_llama_cpp_defaults(tmp_path):
    config, tensors = model_of("granite-untied")
    gone = {f"{{arch}}.{k}": None for k in
            ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")}
    write_gguf(tmp_path / "m.gguf", config, tensors, metadata=gone)
    got = gguf_config(read_gguf(tmp_path / "m.gguf"))
    assert got.attention_multiplier == pytest.approx(1 / math.sqrt(config.head_dim))
    assert (got.embedding_multiplier, got.residual_multiplier, got.logits_scaling) == (1, 1, 1)


def test_llama_has_neutral_multipliers_and_eot_ends_generation(tmp_path):
    config, tensors = model_of("llama-untied")
    write_gguf(tmp_path / "m.gguf", config, tensors, metadata={
        "tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 100000})
    got = gguf_config(read_gguf(tmp_path / "m.gguf"))
    assert got.architecture == "LlamaForCausalLM"
    assert got.attention_multiplier == pytest.approx(1 / math.sqrt(config.head_dim))
    assert got.eos_token_id == [0, 9]          # eos, end of turn; an id past the vocab is left out


def test_tied_exactly_when_there_is_no_output_tensor(tmp_path):
    config, tensors = model_of("llama-untied")
    write_gguf(tmp_path / "untied.gguf", config, tensors)
    write_gguf(tmp_path / "tied.gguf", dataclasses.replace(config, tie_word_embeddings=True),
               tensors)
    untied = load_gguf_checkpoint(tmp_path / "untied.gguf")
    tied = load_gguf_checkpoint(tmp_path / "tied.gguf")
    assert not untied.config.tie_word_embeddings and "lm_head.weight" in untied.tensors
    assert tied.config.tie_word_embeddings and "lm_head.weight" not in tied.tensors


def test_header_reads_as_gguf_packages_reader_reads_it(tmp_path):
    config, tensors = model_of("granite-untied", vocab=8192)
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.Q4_1, tokenizer_dir=ASSETS)
    ours = read_gguf(tmp_path / "m.gguf")
    theirs = gguf.GGUFReader(tmp_path / "m.gguf")
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            assert ours.metadata[key] == (pytest.approx(want) if isinstance(want, float) else want)
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.ggml_type, mine.offset, mine.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert mine.shape == tuple(reversed(t.shape.tolist()))


# ---------------------------------------------------------------- refusals, by name


_Q3K = np.zeros((256, 512 // 256 * 110), np.uint8)   # a Q3_K down_proj: [rows, 110 B per 256]
REFUSALS = {   # what is written -> what the error says
    "an architecture": (dict(), dict(arch="qwen2"),
                        "GGUF architecture 'qwen2' is not supported; supported: granite, llama"),
    "a tensor type": (dict(hidden=256, intermediate=512),
                      dict(qtype=Q.Q8_0, drop=("model.layers.0.mlp.down_proj.weight",),
                           extra={"blk.0.ffn_down.weight": (_Q3K, Q.Q3_K)}),
                      r"tensor 'blk.0.ffn_down.weight' has type Q3_K, which this server does "
                      r"not dequantize; supported: F32, F16"),
    "a tensor": (dict(), dict(extra={"rope_freqs.weight": np.ones(16)}),
                 r"tensor 'rope_freqs.weight' \(F32\[16\]\) is not part of a llama model "
                 r"this server runs"),
    "a bias": (dict(), dict(extra={"blk.1.attn_q.bias": np.ones(128)}),
               r"tensor 'blk.1.attn_q.bias' \(F32\[128\]\)"),
    "a missing tensor": (dict(), dict(drop=("model.layers.1.mlp.up_proj.weight",)),
                         r"missing tensor 'blk.1.ffn_up.weight' \(expected shape \[384, 128\]\)"),
    "a shape the metadata contradicts": (
        dict(), dict(metadata={"{arch}.feed_forward_length": 512}),
        r"tensor 'blk.0.ffn_gate.weight' has shape \[384, 128\], config expects \[512, 128\]"),
    "rope scaling": (dict(), dict(metadata={"{arch}.rope.scaling.type": "yarn"}),
                     "'llama.rope.scaling.type' is 'yarn'; only no rope scaling is supported"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_what_we_cannot_serve_is_refused_by_name(tmp_path, what):
    model, write, message = REFUSALS[what]
    config, tensors = model_of("llama-untied", **model)
    write_gguf(tmp_path / "m.gguf", config, tensors, **write)
    with pytest.raises(CheckpointError, match=message) as refused:   # GGUFError is one
        with Card(16 << 20) as card:
            load_model(tmp_path / "m.gguf", card, tokenizer=False)
    assert str(tmp_path / "m.gguf") in str(refused.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf_checkpoint(tmp_path / "x.gguf")


def test_a_truncated_file_is_refused(tmp_path):
    config, tensors = model_of("llama-untied")
    write_gguf(tmp_path / "m.gguf", config, tensors)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"tensor 'output.weight' F32\[256, 128\] needs bytes"):
        load_gguf_checkpoint(tmp_path / "cut.gguf")


def test_a_safetensors_directory_still_loads_as_before(tmp_path):
    config, tensors = model_of("llama-untied")
    twin = write_numpy_checkpoint(tmp_path / "twin", config, tensors)
    assert load_checkpoint(twin).tensors.keys() == tensors.keys()


# ---------------------------------------------------------------- no torch at serving time


def test_gguf_loading_and_tokenizer_need_no_torch(tmp_path):
    """The Docker image has no torch: read a GGUF with its tokenizer with torch unimportable."""
    config = dataclasses.replace(TINY.config, num_hidden_layers=1, vocab_size=8192)
    tensors = dict(init_tensors(config, TINY.stds, seed=1))
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype=Q.Q8_0, tokenizer_dir=ASSETS)
    code = f"""
import importlib.util
import sys

def hidden(name):
    return name == "torch" or name.startswith("torch.")

class NoTorch:                      # `import torch` fails as when it is not installed
    def find_spec(self, name, path=None, target=None):
        if hidden(name):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

find = importlib.util.find_spec     # and availability checks do not find it
importlib.util.find_spec = lambda name, package=None: None if hidden(name) else find(name, package)
sys.meta_path.insert(0, NoTorch())
from spyre_serve.models.gguf.checkpoint import load_gguf_checkpoint
from spyre_serve.models.gguf.tokenizer import load_gguf_tokenizer
ckpt = load_gguf_checkpoint({str(tmp_path / "m.gguf")!r})
tok = load_gguf_tokenizer({str(tmp_path / "m.gguf")!r})
assert tok.decode(tok.encode("no torch", add_special_tokens=False)) == "no torch"
assert "torch" not in sys.modules
print(len(ckpt.tensors))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(2 + 9 * 1)
