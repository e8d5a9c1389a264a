"""The GGUF reader fuzzed (issue 38): a small valid llama file, its bytes flipped, cut short or
grown, read as the server reads a file it is given (the header, the config, every tensor's values):
each either loads or is refused with a GGUFError, never another exception, and in bounded time.
Hypothesis draws the damage from a fixed seed, so the run is the same every time."""

from __future__ import annotations

import struct
import time

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from spyre_serve.models.gguf.checkpoint import gguf_config
from spyre_serve.models.gguf.file import GGUFError, dequantize_tensor, read_gguf
from tests.models.gguf.test_file import ARRAY, BLOCK, STRING, U32, _file, _kv, _str, _u32, _u64

F32_KIND = 6   # a GGUF metadata value of type float32


def _seed_bytes(tmp_path) -> bytes:
    tokens = [f"t{i}" for i in range(120)]
    meta = [
        _kv("general.architecture", STRING, _str("llama")), _kv("llama.embedding_length", U32, _u32(16)),
        _kv("llama.block_count", U32, _u32(1)), _kv("llama.feed_forward_length", U32, _u32(32)),
        _kv("llama.attention.head_count", U32, _u32(2)), _kv("llama.context_length", U32, _u32(64)),
        _kv("llama.attention.layer_norm_rms_epsilon", F32_KIND, struct.pack("<f", 1e-5)),
        _kv("tokenizer.ggml.tokens", ARRAY, _u32(STRING) + _u64(len(tokens)) + b"".join(map(_str, tokens))),
    ]
    shapes = {"attn_q": (16, 16), "attn_k": (16, 16), "attn_v": (16, 16), "attn_output": (16, 16),
              "ffn_gate": (16, 32), "ffn_up": (16, 32), "ffn_down": (32, 16), "attn_norm": (16,), "ffn_norm": (16,)}
    tensors = [("token_embd.weight", (16, 120)), ("output_norm.weight", (16,))]
    tensors += [(f"blk.0.{name}.weight", shapes[name]) for name in BLOCK]
    return _file(tmp_path / "seed.gguf", meta, tensors).read_bytes()


def damaged(seed: bytes, flips: list[tuple[float, int]], cut: float | None, grow: bytes, keep: int = 4) -> bytes:
    """``seed`` with bytes set (each flip: where, as a fraction of the bytes after the first ``keep``,
    and the new value), cut at a fraction of its length, then ``grow`` appended. The first
    ``keep`` bytes (the magic) stay: a file without them is refused before anything is read."""
    data = bytearray(seed)
    for where, value in flips:
        data[keep + int(where * (len(data) - keep - 1))] = value
    if cut is not None:
        del data[keep + int(cut * (len(data) - keep)):]
    return bytes(data) + grow


def read_as_the_server_does(path) -> None:
    f = read_gguf(path)
    gguf_config(f)
    for t in f.tensors.values():
        values = dequantize_tensor(f, t)
        assert isinstance(values, np.ndarray)


# flips in the header (the first 1.5 KB) mostly: where the lengths, counts, kinds and offsets are
FLIPS = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=6)


@settings(max_examples=400, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(flips=FLIPS, cut=st.none() | st.floats(0, 1), grow=st.binary(max_size=64),
       header_only=st.booleans())
def test_a_damaged_file_loads_or_is_a_gguf_error(tmp_path, flips, cut, grow, header_only):
    seed = _seed_bytes(tmp_path)
    if header_only:       # aim the flips at the header's 1,500 bytes, where a byte means most
        flips = [(where * 1500 / len(seed), value) for where, value in flips]
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(damaged(seed, flips, cut, grow))
    t0 = time.monotonic()
    try:
        read_as_the_server_does(path)
        event("loaded")
    except GGUFError as exc:
        event(f"refused: {str(exc).partition(': ')[2][:28]}")
    assert time.monotonic() - t0 < 2.0


def test_the_undamaged_seed_loads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_seed_bytes(tmp_path))
    read_as_the_server_does(path)
