"""Checkpoint loading without torch: dtypes, sharding, tied embeddings, errors."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from spyre_serve.models.checkpoints.hf import CheckpointError, expected_shapes, load_checkpoint
from spyre_serve.models.config import GraniteConfig
from tests.models.hf_checkpoints import load_reference_model, write_granite_checkpoint


def reference_state(path):
    """transformers' fp32 parameters for the checkpoint, by HF name."""
    model = load_reference_model(path)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def assert_matches_reference(path):
    ckpt = load_checkpoint(path)
    ref = reference_state(path)
    for name, arr in ckpt.tensors.items():
        assert arr.dtype == np.float32, name
        np.testing.assert_array_equal(arr, ref[name], err_msg=name)
    return ckpt


def copy_with_tensors(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with its tensors changed by ``edit(dict)``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_float32_matches_transformers(small_granite_dir):
    assert_matches_reference(small_granite_dir)


def test_bfloat16_widened_exactly(tmp_path):
    ckpt = assert_matches_reference(write_granite_checkpoint(tmp_path, dtype="bfloat16"))
    assert set(ckpt.stored_dtypes.values()) == {"BF16"}


def test_float16_widened_exactly(tmp_path):
    ckpt = assert_matches_reference(write_granite_checkpoint(tmp_path, dtype="float16"))
    assert set(ckpt.stored_dtypes.values()) == {"F16"}


def test_bf16_bit_patterns(small_granite_dir, tmp_path):
    cfg = GraniteConfig.from_file(small_granite_dir)
    tensors = load_file(str(small_granite_dir / "model.safetensors"))
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x8000], dtype=np.uint16)
    norm = np.resize(bits, cfg.hidden_size)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    # rewrite one norm weight as BF16 by patching the header dtype and bytes
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_len])
    name = "model.norm.weight"
    lo, _ = header[name]["data_offsets"]
    header[name]["dtype"] = "BF16"
    header[name]["data_offsets"] = [lo, lo + norm.nbytes]
    _rewrite(path, header, {name: norm.tobytes()})
    shutil.copy(small_granite_dir / "config.json", tmp_path / "config.json")
    got = load_checkpoint(tmp_path).tensors[name][:5]
    np.testing.assert_array_equal(got, np.array([1.0, -2.0, np.inf, 9.18355e-41, -0.0],
                                                dtype=np.float32))
    assert np.signbit(got[4])


def _rewrite(path, header, replace):
    """Rewrite a safetensors file with a new header; tensors in ``replace`` get new bytes."""
    data = path.read_bytes()
    old_len = int.from_bytes(data[:8], "little")
    old = json.loads(data[8:8 + old_len])
    body = data[8 + old_len:]
    names = [n for n in header if n != "__metadata__"]
    offset, chunks = 0, []
    for n in sorted(names, key=lambda n: old[n]["data_offsets"][0]):
        raw = replace.get(n, body[old[n]["data_offsets"][0]:old[n]["data_offsets"][1]])
        header[n]["data_offsets"] = [offset, offset + len(raw)]
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + b"".join(chunks))


def test_sharded_equals_single(tmp_path):
    single = load_checkpoint(write_granite_checkpoint(tmp_path / "a", seed=3))
    path = write_granite_checkpoint(tmp_path / "b", seed=3, sharded=True)
    assert (path / "model.safetensors.index.json").is_file()
    sharded = load_checkpoint(path)
    assert sharded.tensors.keys() == single.tensors.keys()
    for name in single.tensors:
        np.testing.assert_array_equal(sharded.tensors[name], single.tensors[name])


def test_tied_has_no_lm_head_untied_has_one(small_granite_dir, tmp_path):
    assert "lm_head.weight" not in load_checkpoint(small_granite_dir).tensors
    untied = load_checkpoint(write_granite_checkpoint(tmp_path, tie=False))
    assert untied.tensors["lm_head.weight"].shape == (256, 128)


def test_llama_checkpoint_loads(tmp_path):
    ckpt = assert_matches_reference(write_granite_checkpoint(tmp_path, llama=True))
    assert ckpt.config.architecture == "LlamaForCausalLM"


def test_float32_tensors_are_views_not_copies(small_granite_dir):
    t = load_checkpoint(small_granite_dir).tensors["model.layers.0.mlp.up_proj.weight"]
    assert not t.flags.owndata and not t.flags.writeable


def test_missing_tensor_named_with_shape(small_granite_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = copy_with_tensors(small_granite_dir, tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}' \(expected shape \[32, 128\]\)"):
        load_checkpoint(path)


def test_unexpected_tensor_named_with_shape(small_granite_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
    path = copy_with_tensors(small_granite_dir, tmp_path / "c", add)
    with pytest.raises(CheckpointError,
                       match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias' with shape \[128\]"):
        load_checkpoint(path)


def test_misshaped_tensor_gives_both_shapes(small_granite_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    def cut(t):
        t[name] = t[name][:, :-2].copy()
    path = copy_with_tensors(small_granite_dir, tmp_path / "c", cut)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[128, 398\], config expects \[128, 400\]"):
        load_checkpoint(path)


def test_tied_checkpoint_with_stored_lm_head_drops_it(small_granite_dir, tmp_path):
    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    path = copy_with_tensors(small_granite_dir, tmp_path / "c", add)
    assert "lm_head.weight" not in load_checkpoint(path).tensors


def test_unsupported_dtype_named(small_granite_dir, tmp_path):
    def f64(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float64)
    path = copy_with_tensors(small_granite_dir, tmp_path / "c", f64)
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype F64"):
        load_checkpoint(path)


def test_truncated_file_refused(small_granite_dir, tmp_path):
    shutil.copytree(small_granite_dir, tmp_path / "c")
    f = tmp_path / "c" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="bytes"):
        load_checkpoint(tmp_path / "c")


def test_shards_without_index_refused(tmp_path):
    path = write_granite_checkpoint(tmp_path / "c", sharded=True)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load_checkpoint(path)


def test_index_naming_absent_shard_refused(tmp_path):
    path = write_granite_checkpoint(tmp_path / "c", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(path)


def test_no_weights_refused(tmp_path, small_granite_dir):
    shutil.copy(small_granite_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


def test_expected_shapes_cover_every_layer(small_granite_dir):
    cfg = GraniteConfig.from_file(small_granite_dir)
    shapes = expected_shapes(cfg)
    assert len(shapes) == 1 + 9 * cfg.num_hidden_layers + 1
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (128, 128)


def test_widen_false_returns_stored_bf16_bits(tmp_path):
    path = write_granite_checkpoint(tmp_path, dtype="bfloat16")
    raw = load_checkpoint(path, widen=False).tensors["model.layers.0.self_attn.q_proj.weight"]
    wide = load_checkpoint(path).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert raw.dtype == np.uint16 and not raw.flags.owndata
    np.testing.assert_array_equal((raw.astype(np.uint32) << 16).view(np.float32), wide)
