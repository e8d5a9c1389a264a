"""Checkpoints in Hugging Face format, read without torch.

A checkpoint directory holds config.json and either ``model.safetensors`` or shards
``model-XXXXX-of-YYYYY.safetensors`` listed in ``model.safetensors.index.json``.
Tensors may be float32, bfloat16 or float16; all come back as float32 numpy arrays
with the Hugging Face names and shapes (``[out_features, in_features]`` for linears). An FP8
checkpoint in the compressed-tensors format (config.json's quantization_config) gives its
E4M3 weights with their scales as FP8 `QuantizedWeight`s (models/checkpoints/compressed_tensors.py).

Memory: files are memory-mapped. float32 tensors are returned as read-only views of
the mapping (no copy); bfloat16 is widened by a 16-bit shift and float16 by
``astype``, one allocation per tensor either way.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spyre_serve.models.checkpoints.compressed_tensors import (
    FP8_CODE,
    fp8_weight_scheme,
    take_fp8_weights,
)
from spyre_serve.models.config import GraniteConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype code -> (numpy dtype of the stored bits, bytes per element)
_STORED = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"),
           FP8_CODE: np.dtype("u1")}

# safetensors' own limit on a header's length (its Rust reader's MAX_HEADER_SIZE)
MAX_HEADER_BYTES = 100_000_000

# Tensors some exporters write that the model does not use.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


STORED_WIDTHS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_width(codes, declared: str) -> str:
    """The float width a checkpoint stores (its safetensors codes, e.g. {"BF16"}): one code's
    width, else the width its config declares (mixed widths)."""
    codes = set(codes)
    return STORED_WIDTHS.get(next(iter(codes)), "float32") if len(codes) == 1 else declared


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or a file that is not safetensors."""


@dataclass(slots=True)
class Checkpoint:
    config: GraniteConfig
    tensors: dict[str, np.ndarray]   # HF name -> float32 array of expected_shapes(config)[name]
                                     # (a GGUF file's quantized matrix: device.layout.QuantizedWeight)
                                     # (stored bits if loaded with widen=False)
    path: Path                       # the checkpoint directory
    stored_dtypes: dict[str, str] = field(default_factory=dict)  # HF name -> "F32" | "BF16" | "F16"


def expected_shapes(config: GraniteConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (HF layout: [out, in])."""
    c = config
    H, V, I = c.hidden_size, c.vocab_size, c.intermediate_size  # noqa: E741
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        if c.kind_of(i) == "mamba":
            shapes.update(_mamba_shapes(p + "mamba.", c))
        else:
            shapes[p + "self_attn.q_proj.weight"] = (c.q_size, H)
            shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, H)
            shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, H)
            shapes[p + "self_attn.o_proj.weight"] = (H, c.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if c.mlp_names == "shared_mlp":      # Granite 4.0's and 3.x MoE's: gate and up fused
            shapes[p + "shared_mlp.input_linear.weight"] = (2 * I, H)
            shapes[p + "shared_mlp.output_linear.weight"] = (H, I)
        elif c.mlp_names == "mlp":
            shapes[p + "mlp.gate_proj.weight"] = (I, H)
            shapes[p + "mlp.up_proj.weight"] = (I, H)
            shapes[p + "mlp.down_proj.weight"] = (H, I)
        if c.num_experts:
            e, ie = c.num_experts, c.expert_intermediate_size
            shapes[p + "block_sparse_moe.router.layer.weight"] = (e, H)
            shapes[p + "block_sparse_moe.input_linear.weight"] = (e, 2 * ie, H)
            shapes[p + "block_sparse_moe.output_linear.weight"] = (e, H, ie)
    shapes["model.norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _mamba_shapes(p: str, c: GraniteConfig) -> dict[str, tuple[int, ...]]:
    """A Mamba-2 mixer's tensors (transformers' GraniteMoeHybridMambaLayer)."""
    m = c.mamba
    shapes = {p + "in_proj.weight": (m.proj, c.hidden_size), p + "conv1d.weight": (m.conv_dim, 1, m.d_conv),
              p + "dt_bias": (m.n_heads,), p + "A_log": (m.n_heads,), p + "D": (m.n_heads,),
              p + "norm.weight": (m.d_inner,), p + "out_proj.weight": (c.hidden_size, m.d_inner)}
    if m.conv_bias:
        shapes[p + "conv1d.bias"] = (m.conv_dim,)
    return shapes


def open_regular(path: Path, max_bytes: int | None = None, what: str = ""):
    """(the file at ``path`` open for reading in binary, its size): a regular file of at most
    ``max_bytes`` (CheckpointError otherwise, ``what`` saying what the limit is for; a missing
    file is the OSError of open). Opened without blocking and checked on the open descriptor,
    so a FIFO is refused rather than waited on for a writer, and a device (a symlink to
    /dev/zero) rather than read without end; the caller closes it."""
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb")
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        f.close()
        raise CheckpointError(f"{path}: not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        f.close()
        raise CheckpointError(f"{path}: {info.st_size} bytes, over the limit of {max_bytes} bytes{what}")
    return f, info.st_size


def _header(f, size: int, path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts) of the open file:
    a JSON object of at most ``MAX_HEADER_BYTES``, every entry's types checked (``_entry``)."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: {len(head)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise CheckpointError(f"{path}: header length {n} exceeds file size {size}")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {n} is over safetensors' limit of {MAX_HEADER_BYTES}")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UTF-8, an int over 4300 digits, nesting
        why = e if isinstance(e, ValueError) else "nested too deep"
        raise CheckpointError(f"{path}: header is not JSON: {why}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _entry(path, name, info, size - 8 - n)
    return header, 8 + n


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(path: Path, name: str, info, data_bytes: int) -> None:
    """One tensor's entry, checked as safetensors' reader checks it before anything uses it
    (a file may come from a client: /v1/load_lora_adapter): an object with a known ``dtype``,
    a ``shape`` of non-negative ints and ``data_offsets`` of two ints in order, within the data
    section and exactly the shape's bytes (Python ints: no int64 wrap-around). CheckpointError
    naming the tensor and the problem otherwise; a TypeError, or shape [-1] read as the whole
    data section, is what an unchecked header gave (issue 38)."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: tensor {name!r}: its entry is not an object with dtype, shape and "
                              "data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _STORED:
        shown = code if isinstance(code, (str, int)) and len(str(code)) <= 20 else repr(code)[:40]
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {shown}; supported: {sorted(_STORED)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: shape {json.dumps(shape)[:80]} is not a list of "
                              "non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {json.dumps(offsets)[:80]} is not two "
                              "integers")
    (lo, hi), need = offsets, math.prod(shape) * _STORED[code].itemsize
    if not 0 <= lo <= hi <= data_bytes or hi - lo != need:
        raise CheckpointError(f"{path}: tensor {name!r} {code}{shape} needs {need} bytes, header gives "
                              f"offsets [{lo}, {hi}) in a data section of {data_bytes} bytes")


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts)."""
    f, size = open_regular(path)
    with f:
        return _header(f, size, path)


def _map_file(path: Path, max_bytes: int | None = None, what: str = "") -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype code, stored-bits view into a read-only mapping of the file); the file a
    regular one of at most ``max_bytes`` (``open_regular``)."""
    f, size = open_regular(path, max_bytes, what)
    with f:
        header, start = _header(f, size, path)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    buf = memoryview(mm)
    out = {}
    for name, info in header.items():       # each entry checked by _header
        code, shape, lo = info["dtype"], tuple(info["shape"]), info["data_offsets"][0]
        dt = _STORED[code]
        arr = np.frombuffer(buf, dtype=dt, count=math.prod(shape), offset=start + lo).reshape(shape)
        out[name] = (code, arr)
    return out


def widen_stored(code: str, stored: np.ndarray) -> np.ndarray:
    """A stored float tensor (F32, BF16, F16 bits) as float32."""
    if code == "F32":
        return stored                     # read-only view of the mapping
    if code == "BF16":
        # bf16 is the top half of a float32: widen, shift into place in place, reinterpret.
        out = np.empty(stored.shape, dtype=np.uint32)
        out[...] = stored
        out <<= np.uint32(16)
        return out.view(np.float32)
    return stored.astype(np.float32)      # F16


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order."""
    single = path / SINGLE_FILE
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with 'weight_map': {e}") from e
        names = list(dict.fromkeys(weight_map.values()))
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} lists shard {f.name!r}, which does not exist")
        return files
    if single.is_file():
        return [single]
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    if shards:
        raise CheckpointError(f"{path}: shards {shards} but no {INDEX_FILE}")
    raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")


def check_shapes(source, expected: dict[str, tuple[int, ...]],
                 shapes: dict[str, tuple[int, ...]]) -> None:
    """The tensors of ``source`` (name -> shape) are exactly ``expected``'s, with its shapes;
    the error names the first that is missing, unexpected or of another shape. Shared by
    safetensors directories and GGUF files (which pass llama.cpp's names)."""
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} (expected shape "
                              f"{list(expected[missing[0]])}); {len(missing)} missing in all")
    unexpected = [n for n in shapes if n not in expected]
    if unexpected:
        n = unexpected[0]
        raise CheckpointError(f"{source}: unexpected tensor {n!r} with shape {list(shapes[n])}"
                              f"; {len(unexpected)} unexpected in all")
    for name, shape in expected.items():
        got = tuple(shapes[name])
        if got != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {list(got)}, "
                                  f"config expects {list(shape)}")


def load_checkpoint(path: str | Path, config: GraniteConfig | None = None, *,
                    widen: bool = True) -> Checkpoint:
    """Read config.json (unless ``config`` is given) and every tensor, checked against
    ``expected_shapes``. A tied checkpoint that also stores ``lm_head.weight`` has it
    dropped (transformers ties it to the embedding the same way).

    widen=False returns the stored bits instead of float32: bfloat16 as uint16, float16
    as float16, float32 as float32, all read-only views of the file (no copy)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a directory")
    if config is None:
        config = GraniteConfig.from_file(path / "config.json")
    files = checkpoint_files(path)

    index_map = None
    if (path / INDEX_FILE).is_file():
        index_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]

    stored: dict[str, tuple[str, np.ndarray]] = {}
    for f in files:
        tensors = _map_file(f)
        for name, value in tensors.items():
            if name in stored:
                raise CheckpointError(f"tensor {name!r} appears in more than one file ({f.name})")
            if index_map is not None and index_map.get(name) != f.name:
                raise CheckpointError(f"tensor {name!r} is in {f.name} but {INDEX_FILE} "
                                      f"maps it to {index_map.get(name)!r}")
            stored[name] = value
    if index_map is not None:
        missing_in_files = sorted(set(index_map) - set(stored))
        if missing_in_files:
            raise CheckpointError(f"{INDEX_FILE} lists tensors no shard holds: {missing_in_files[:5]}")

    for name in [n for n in stored if n.endswith(_IGNORED_SUFFIXES)]:
        del stored[name]
    if config.tie_word_embeddings and "lm_head.weight" in stored:
        del stored["lm_head.weight"]
    fp8 = {}
    if fp8_weight_scheme(_quantization_config(path)) is not None:
        fp8 = take_fp8_weights(stored, path, widen_stored)
    elif any(code == FP8_CODE for code, _ in stored.values()):
        raise CheckpointError(f"{path}: F8_E4M3 tensors without a compressed-tensors "
                              "quantization_config in config.json")

    expected = expected_shapes(config)
    check_shapes(path, expected, {name: arr.shape for name, (_, arr) in stored.items()})

    if widen:
        tensors = {name: fp8[name] if name in fp8 else widen_stored(*stored[name]) for name in expected}
    else:
        tensors = {name: fp8[name] if name in fp8 else stored[name][1] for name in expected}
    dtypes = {name: stored[name][0] for name in expected}
    return Checkpoint(config=config, tensors=tensors, path=path, stored_dtypes=dtypes)


def _quantization_config(path: Path) -> dict | None:
    """config.json's quantization_config (None without one, or without a config.json)."""
    f = path / "config.json"
    return json.loads(f.read_text()).get("quantization_config") if f.is_file() else None
