"""Embedded profiles: granite-tiny written once, the same bytes, varied greedy output."""

import dataclasses
import hashlib
import multiprocessing as mp
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spyre_serve.models.checkpoints import profiles  # noqa: E402
from spyre_serve.models.checkpoints.hf import expected_shapes, load_checkpoint  # noqa: E402
from spyre_serve.models.checkpoints.profiles import (  # noqa: E402
    EIGHT_B_LAYERS,
    FORMAT_VERSION,
    TINY,
    ProfileError,
    ensure_profile,
    init_tensors,
    resolve_model,
    to_bf16_bits,
    write_profile,
)
from spyre_serve.models.config import GraniteConfig  # noqa: E402

PROMPTS = ["The weather today is", "def compute_total(items):",
           "User: What is a paged KV cache?\nAssistant:", "Once upon a time, in a quiet village,",
           "東京は", "1, 2, 3,"]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def n_params(config):
    return sum(int(np.prod(s)) for s in expected_shapes(config).values())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return ensure_profile(TINY, root)


def test_tiny_has_granite_8b_proportions():
    c = TINY.config
    assert c.num_attention_heads // c.num_key_value_heads == 4
    assert c.head_dim == 64
    assert c.intermediate_size / c.hidden_size == 12800 / 4096
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (12.0, 0.22, 16.0)
    assert c.attention_multiplier == 1 / 64
    assert c.tie_word_embeddings
    assert 20e6 < n_params(c) < 30e6


def test_8b_layers_has_granite_8b_widths():
    c = EIGHT_B_LAYERS.config
    shapes = expected_shapes(c)
    assert shapes["model.embed_tokens.weight"] == (49159, 4096)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (4096, 12800)
    assert "model.layers.2.input_layernorm.weight" not in shapes
    assert c.attention_multiplier == 1 / 128 and EIGHT_B_LAYERS.dtype == "bfloat16"


def test_8b_layers_rows_past_the_tokenizer_are_zero():
    assert EIGHT_B_LAYERS.used_vocab == 8192
    small = dataclasses.replace(TINY.config, vocab_size=300, num_hidden_layers=1)
    emb = dict(init_tensors(small, TINY.stds, 7, used_vocab=256))["model.embed_tokens.weight"]
    assert not emb[256:].any() and (emb[:256] != 0).all()


def test_chunked_generation_equals_whole(monkeypatch):
    small = dataclasses.replace(TINY.config, vocab_size=300, num_hidden_layers=1)
    whole = dict(init_tensors(small, TINY.stds, 7, used_vocab=256))
    monkeypatch.setattr(profiles, "CHUNK_ELEMENTS", 1000)   # ~2 rows of 512 per chunk
    chunked = dict(init_tensors(small, TINY.stds, 7, used_vocab=256))
    for name, arr in whole.items():
        np.testing.assert_array_equal(chunked[name], arr, err_msg=name)


def test_tiny_written_in_hf_format(tiny_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / f).is_file()
    assert GraniteConfig.from_file(tiny_dir) == TINY.config


def test_tiny_loads_with_checkpoint_loader(tiny_dir):
    ckpt = load_checkpoint(tiny_dir)
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (8192, 512)
    assert set(ckpt.stored_dtypes.values()) == {"F32"}


def test_tiny_same_bytes_every_time(tiny_dir, tmp_path):
    write_profile(TINY, tmp_path)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert sha256(tmp_path / f) == sha256(tiny_dir / f), f


def test_resolve_uses_cache_env_and_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPYRE_SERVE_CACHE", str(tmp_path))
    path = resolve_model("granite-tiny")
    assert path.parent == tmp_path
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("granite-tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def _resolve_in_child(cache, queue):
    os.environ["SPYRE_SERVE_CACHE"] = cache
    queue.put(str(resolve_model("granite-tiny")))


def test_two_processes_racing_get_one_complete_checkpoint(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    paths = {queue.get(timeout=5), queue.get(timeout=5)}
    assert len(paths) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{TINY.name}-v{FORMAT_VERSION}"]  # no temp dirs
    assert load_checkpoint(paths.pop()).config == TINY.config


def test_directory_with_config_resolves_to_itself(tiny_dir):
    assert resolve_model(str(tiny_dir)) == tiny_dir


def test_unknown_name_is_refused_with_its_name():
    with pytest.raises(ProfileError, match="granite-nope"):
        resolve_model("granite-nope")


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_bf16_profile_written_and_read_back_rounded(tmp_path):
    small = dataclasses.replace(TINY.config, num_hidden_layers=1, torch_dtype="bfloat16")
    prof = dataclasses.replace(TINY, config=small, dtype="bfloat16")
    write_profile(prof, tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert set(ckpt.stored_dtypes.values()) == {"BF16"}
    for name, ref in init_tensors(small, prof.stds, prof.seed):
        want = (to_bf16_bits(ref).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(ckpt.tensors[name], want, err_msg=name)


def test_bf16_file_readable_by_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    small = dataclasses.replace(TINY.config, num_hidden_layers=1, torch_dtype="bfloat16")
    write_profile(dataclasses.replace(TINY, config=small, dtype="bfloat16"), tmp_path)
    ckpt = load_checkpoint(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype == torch.bfloat16
    np.testing.assert_array_equal(q.float().numpy(),
                                  ckpt.tensors["model.layers.0.self_attn.q_proj.weight"])


def test_tiny_greedy_output_is_varied_with_clear_margins(tiny_dir):
    """Measured (transformers, fp32, 24 greedy tokens per prompt): distinct tokens
    [24, 21, 24, 24, 24, 24], smallest relative top-1/top-2 gap 4.2e-4."""
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, GraniteForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = GraniteForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    distinct, gaps = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        distinct.append(len(set(out.sequences[0, ids.shape[1]:].tolist())))
        for row in out.logits:
            top = torch.topk(row[0], 2).values
            gaps.append(float((top[0] - top[1]) / row[0].abs().max()))
    assert min(distinct) >= 12, distinct
    assert min(gaps) > 1e-4, min(gaps)
