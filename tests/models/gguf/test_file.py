"""file.py's reader (and the config checkpoint.py makes of its metadata) against hostile files
(issue 38, finding 5): every failure a GGUFError naming the problem, raised before anything is
allocated in proportion to a count the file gives (nesting, alignment, head and block counts,
entry counts), not a RecursionError, ZeroDivisionError or a MemoryError."""

from __future__ import annotations

import struct

import pytest

from spyre_serve.models.gguf.checkpoint import gguf_config
from spyre_serve.models.gguf.file import GGUFError, read_gguf

U32, I32, STRING, ARRAY, U64 = 4, 5, 8, 9, 10


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _str(text: str) -> bytes:
    raw = text.encode()
    return _u64(len(raw)) + raw


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _str(key) + _u32(kind) + payload


def _file(path, kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...]]] = (), n_kv: int | None = None,
          n_tensors: int | None = None, alignment: int = 32):
    """A little-endian GGUF v3 file: the metadata ``kvs``, F32 ``tensors`` (name, GGML dims) and
    their data (zeros), aligned to ``alignment``."""
    infos, offset = b"", 0
    for name, dims in tensors:
        infos += _str(name) + _u32(len(dims)) + b"".join(_u64(d) for d in dims) + _u32(0) + _u64(offset)
        count = 1
        for d in dims:
            count *= d
        offset += -(-count * 4 // alignment) * alignment
    head = (b"GGUF" + _u32(3) + _u64(len(tensors) if n_tensors is None else n_tensors)
            + _u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + infos)
    path.write_bytes(head + b"\0" * (-len(head) % alignment) + b"\0" * offset)
    return path


def _nested(depth: int) -> bytes:
    value = _u32(U32) + _u64(0)                      # the innermost: an empty array of uint32
    for _ in range(depth):
        value = _u32(ARRAY) + _u64(1) + value
    return value


def test_arrays_nested_past_the_limit_are_refused(tmp_path):
    path = _file(tmp_path / "a.gguf", [_kv("deep", ARRAY, _nested(20_000))])
    with pytest.raises(GGUFError, match="arrays nested deeper than 8"):
        read_gguf(path)


def test_arrays_nested_within_the_limit_are_read(tmp_path):
    f = read_gguf(_file(tmp_path / "a.gguf", [_kv("deep", ARRAY, _nested(7))]))
    assert f.metadata["deep"] == [[[[[[[[]]]]]]]]


@pytest.mark.parametrize(("kind", "payload", "words"), [
    (U32, _u32(0), "general.alignment 0 is not a power of two"),
    (U32, _u32(48), "general.alignment 48 is not a power of two"),
    (STRING, _str("32"), "general.alignment '32' is not a power of two"),
    (ARRAY, _u32(U32) + _u64(1) + _u32(32), "general.alignment [32] is not a power of two"),
])
def test_a_bad_alignment_is_refused(tmp_path, kind, payload, words):
    path = _file(tmp_path / "a.gguf", [_kv("general.alignment", kind, payload)])
    with pytest.raises(GGUFError, match=words.replace("[", r"\[").replace("]", r"\]")):
        read_gguf(path)


@pytest.mark.parametrize(("n_kv", "n_tensors", "words"), [
    (2 ** 60, 0, "metadata entries"),
    (0, 2 ** 60, "tensor entries"),
])
def test_entry_counts_the_file_cannot_hold_are_refused_before_reading(tmp_path, n_kv, n_tensors, words):
    with pytest.raises(GGUFError, match=f"{2 ** 60} {words}"):
        read_gguf(_file(tmp_path / "a.gguf", [], n_kv=n_kv, n_tensors=n_tensors))


@pytest.mark.parametrize(("kind", "size"), [(STRING, 8), (ARRAY, 12)])
def test_an_array_longer_than_the_file_can_hold_is_refused_before_reading(tmp_path, kind, size):
    path = _file(tmp_path / "a.gguf", [_kv("many", ARRAY, _u32(kind) + _u64(2 ** 40))])
    with pytest.raises(GGUFError, match=f"an array of {2 ** 40} values"):
        read_gguf(path)


def test_a_tensor_of_more_than_four_dims_is_refused(tmp_path):
    path = _file(tmp_path / "a.gguf", [], [("t", (1, 1, 1, 1, 1))])
    with pytest.raises(GGUFError, match="tensor 't' has 5 dimensions"):
        read_gguf(path)


BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def _llama(tmp_path, **changes):
    """An ~8.5 KB llama file: the required metadata (``changes`` replacing a value: (type,
    payload)), a token embedding of 120 x 16 and one block's tensors (of one value each:
    the config is read before the shapes are checked)."""
    meta = {"general.architecture": (STRING, _str("llama")), "llama.embedding_length": (U32, _u32(16)),
            "llama.block_count": (U32, _u32(1)), "llama.feed_forward_length": (U32, _u32(32)),
            "llama.attention.head_count": (U32, _u32(2)), "llama.context_length": (U32, _u32(64))}
    meta.update(changes)
    return read_gguf(_file(tmp_path / "m.gguf", [_kv(k, t, p) for k, (t, p) in meta.items()],
                           [("token_embd.weight", (16, 120))] + [(f"blk.0.{t}.weight", (1,)) for t in BLOCK]))


@pytest.mark.parametrize(("changes", "words"), [
    ({"llama.attention.head_count": (U32, _u32(0))}, "'llama.attention.head_count' is 0, not a positive"),
    ({"llama.attention.head_count_kv": (I32, struct.pack("<i", -2))}, "'llama.attention.head_count_kv' is -2"),
    ({"llama.embedding_length": (STRING, _str("16"))}, "'llama.embedding_length' is '16', not a positive"),
    ({"llama.block_count": (U64, _u64(10 ** 12))}, "'llama.block_count' is 1000000000000: the file holds 10 "
                                                   "tensors, and each block has 9"),
    ({"llama.attention.layer_norm_rms_epsilon": (STRING, _str("x"))}, "layer_norm_rms_epsilon' is 'x', not a "
                                                                      "number"),
    ({"general.architecture": (U32, _u32(7))}, "architecture 7 is not supported"),
])
def test_metadata_the_config_cannot_take_is_a_gguf_error(tmp_path, changes, words):
    f = _llama(tmp_path, **changes)
    with pytest.raises(GGUFError) as e:
        gguf_config(f)
    assert words in str(e.value), str(e.value)
    assert (tmp_path / "m.gguf").stat().st_size < 9000


def test_a_block_count_of_a_trillion_in_an_8_5_kb_file_is_refused_before_any_allocation(tmp_path):
    """The audit's file: loading it made the expected tensors of 10^12 layers until MemoryError."""
    from spyre_serve.models.gguf.checkpoint import load_gguf_checkpoint

    _llama(tmp_path, **{"llama.block_count": (U64, _u64(10 ** 12))})
    with pytest.raises(GGUFError, match="'llama.block_count' is 1000000000000"):
        load_gguf_checkpoint(tmp_path / "m.gguf")
