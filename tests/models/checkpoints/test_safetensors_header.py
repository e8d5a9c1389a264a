"""hf.py's safetensors header, checked for its types before anything is read by it (issue 38,
finding 4): a malformed header is a CheckpointError naming the file and the problem, never a
TypeError, RecursionError or ValueError of what tried to use it, and never a tensor of a
length the header does not give (shape [-1] read the whole data section)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from spyre_serve.models.checkpoints.hf import CheckpointError, _map_file


def _write(path, header, data: bytes = b"\0" * 16, raw: bytes | None = None):
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _tensor(**changes) -> dict:
    return {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], **changes}}


def test_a_well_formed_header_maps_its_tensor(tmp_path):
    data = np.arange(4, dtype="<f4").tobytes()
    out = _map_file(_write(tmp_path / "a.safetensors", {"__metadata__": {"format": "pt"}, **_tensor()}, data))
    assert out["t"][0] == "F32" and out["t"][1].tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(("header", "words"), [
    ([], "the header is not a JSON object"),
    ({"t": 1}, "tensor 't': its entry is not an object"),
    (_tensor(dtype=5), "tensor 't' has dtype 5; supported: ['BF16', 'F16', 'F32', 'F8_E4M3']"),
    (_tensor(dtype="X9"), "tensor 't' has dtype X9; supported"),
    (_tensor(dtype="F32" * 100), "tensor 't' has dtype 'F32F32F32"),
    (_tensor(shape=3), "tensor 't': shape 3 is not a list of non-negative integers"),
    (_tensor(shape=[-1]), "tensor 't': shape [-1] is not a list of non-negative integers"),
    (_tensor(shape=[4, -1]), "tensor 't': shape [4, -1] is not a list of non-negative integers"),
    (_tensor(shape=[1.5]), "is not a list of non-negative integers"),
    (_tensor(shape=[True, 4]), "is not a list of non-negative integers"),
    (_tensor(shape=[[4]]), "is not a list of non-negative integers"),
    (_tensor(shape=[2 ** 62, 2 ** 62, 4]), "needs"),                     # no int64 wrap-around
    (_tensor(data_offsets=[0]), "data_offsets [0] is not two integers"),
    (_tensor(data_offsets=["0", "16"]), "is not two integers"),
    (_tensor(data_offsets=[16, 0]), "needs 16 bytes"),
    (_tensor(data_offsets=[-16, 0]), "needs 16 bytes"),
    (_tensor(data_offsets=[8, 24]), "in a data section of 16 bytes"),
    ({**_tensor(), "u": {"dtype": "F32", "data_offsets": [0, 4]}}, "tensor 'u': its entry is not an object"),
])
def test_a_malformed_header_is_a_checkpoint_error_naming_the_problem(tmp_path, header, words):
    path = _write(tmp_path / "bad.safetensors", header)
    with pytest.raises(CheckpointError) as e:
        _map_file(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize(("raw", "words"), [
    (b"[" * 100_000, "header is not JSON"),                       # RecursionError in json.loads
    (b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}", "header is not JSON"),  # int() limit
    (b"\xff\xfe{}", "header is not JSON"),
])
def test_a_header_json_cannot_read_is_a_checkpoint_error(tmp_path, raw, words):
    with pytest.raises(CheckpointError, match=words):
        _map_file(_write(tmp_path / "bad.safetensors", None, raw=raw))


# ---- fuzzed (issue 38): damaged files load or are a CheckpointError, nothing else -------------

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.models.gguf.test_fuzz import damaged  # noqa: E402


def _seed(path):
    tensors = {"a": np.arange(12, dtype="<f4").reshape(3, 4), "b": np.ones(5, dtype="<f2")}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        raw = value.tobytes()
        header[name] = {"dtype": {"<f4": "F32", "<f2": "F16"}[value.dtype.str], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    return _write(path, header, b"".join(blobs)).read_bytes()


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.none() | st.floats(0, 1), grow=st.binary(max_size=32))
def test_a_damaged_file_maps_or_is_a_checkpoint_error(tmp_path, flips, cut, grow):
    path = tmp_path / "fuzzed.safetensors"
    seed = _seed(tmp_path / "seed.safetensors")
    # the flips land in the 8-byte length and the JSON header, where a byte means most
    header_end = 8 + struct.unpack("<Q", seed[:8])[0]
    flips = [(where * header_end / len(seed), value) for where, value in flips]
    path.write_bytes(damaged(seed, flips, cut, grow, keep=0))
    try:
        out = _map_file(path)
        event("mapped")
        for _, array in out.values():
            assert array.nbytes <= path.stat().st_size
    except CheckpointError as exc:
        event(f"refused: {str(exc).partition(': ')[2][:24]}")
