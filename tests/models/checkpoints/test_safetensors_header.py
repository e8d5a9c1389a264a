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
