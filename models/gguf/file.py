"""The GGUF container (llama.cpp's file format), read without torch: header, metadata,
tensor entries, and one tensor's bytes dequantized to float32.

    f = read_gguf(path)                  # GGUFFile: version, metadata, tensors, the mapped bytes
    f.tensors["blk.0.attn_q.weight"]     # GGUFTensor: GGML type, numpy-order shape, offset
    dequantize_tensor(f, t)              # float32[t.shape]

The header is parsed here rather than by ``gguf.GGUFReader``: that reader builds a numpy
view per string, and SmolLM2's 98k vocabulary and merge strings take it 8-15 s on this
machine against ~0.2 s with ``struct``. Tensor bytes stay in a read-only memory map and are
dequantized with ``gguf.quants.dequantize``, one tensor at a time. What the tensors and
metadata mean for a model is models/gguf/checkpoint.py's business.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys
from gguf.quants import Q4_K, dequantize

from spyre_serve.device.kernels.formats import FMT_Q4_0, FMT_Q4_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q8_0
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.layout import QuantizedWeight
from spyre_serve.models.checkpoints.hf import CheckpointError

GGUF_SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# A file may come from anywhere (a path, a download): every count it gives is checked against
# what its bytes can hold before anything is read or allocated by it (issue 38).
MAX_ARRAY_DEPTH = 8      # arrays of arrays: llama.cpp writes none; 20,000 levels raised RecursionError
MAX_DIMS = 4             # GGML_MAX_DIMS
_MIN_KV_BYTES = 12       # a key's length (8) and a value's type (4), before the key and value
_MIN_TENSOR_BYTES = 24   # a name's length (8), dims (4), type (4), offset (8)
_MIN_ITEM_BYTES = {8: 8, 9: 12}   # an array's string (its length), array (its type and count)

# GGUF metadata value types: id -> struct format (scalars) or numpy dtype (arrays of them).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(CheckpointError):
    """A GGUF file this server cannot serve: not GGUF, an architecture, a tensor or a tensor
    type it does not run, metadata that does not describe the tensors."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's entry in the header; its bytes stay in the file."""
    name: str                 # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]    # numpy order (GGML's dims reversed): [rows, cols] = HF's [out, in]
    offset: int               # byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass(slots=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, object]        # key -> int | float | bool | str | list of those
    tensors: dict[str, GGUFTensor]     # by llama.cpp name, in file order
    data: mmap.mmap                    # the whole file, read-only

    @property
    def architecture(self) -> str:
        return require(self, Keys.General.ARCHITECTURE)

    def arch_key(self, key: str) -> str:
        """``Keys.LLM.BLOCK_COUNT`` ("{arch}.block_count") -> "llama.block_count"."""
        return key.format(arch=self.architecture)


def is_gguf_file(path) -> bool:
    """A path names a GGUF file: by its suffix, as llama.cpp and transformers do."""
    return str(path).lower().endswith(GGUF_SUFFIX)


# ---------------------------------------------------------------- the header


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing ``pos``."""

    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: header ends at byte {len(self.buf)}, inside a value "
                            f"at {self.pos} (a truncated file?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: a string of {n} bytes at {self.pos} runs past the end "
                            f"of the file ({len(self.buf)} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: a string at byte {self.pos - n} is not UTF-8: {e}") from e

    def left(self) -> int:
        return len(self.buf) - self.pos

    def value(self, kind: int, depth: int = 0):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(depth + 1)
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: metadata value type {kind} at byte {self.pos} is not "
                            "a GGUF type")
        return self.unpack(_SCALAR_FORMATS[kind])

    def array(self, depth: int = 1) -> list:
        """An array's values; nested at most ``MAX_ARRAY_DEPTH`` deep, and of a count its
        items' smallest size fits in the bytes left (checked before any is read)."""
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels at byte {self.pos}")
        kind, n = self.unpack("<I"), self.unpack("<Q")
        if kind in _SCALAR_FORMATS:   # numbers in one read
            dtype = np.dtype(_SCALAR_FORMATS[kind].replace("?", "u1"))
            if n * dtype.itemsize > self.left():
                raise GGUFError(f"{self.path}: an array of {n} values at {self.pos} runs past "
                                "the end of the file")
            values = np.frombuffer(self.buf, dtype, n, self.pos)
            self.pos += n * dtype.itemsize
            return (values != 0).tolist() if kind == 7 else values.tolist()
        if n * _MIN_ITEM_BYTES.get(kind, 1) > self.left():
            raise GGUFError(f"{self.path}: an array of {n} values at {self.pos} cannot fit in the "
                            f"{self.left()} bytes left of the file")
        return [self.value(kind, depth) for _ in range(n)]


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of a GGUF file (metadata and tensor entries); tensor data stays mapped."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with {MAGIC!r})")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(data, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in VERSIONS:
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        what = "a big-endian file" if swapped in VERSIONS else f"version {version}"
        raise GGUFError(f"{path}: {what}; this reader takes little-endian GGUF "
                        f"versions {list(VERSIONS)}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    for n, what, least in ((n_kv, "metadata entries", _MIN_KV_BYTES), (n_tensors, "tensor entries", _MIN_TENSOR_BYTES)):
        if n * least > cur.left():
            raise GGUFError(f"{path}: the header counts {n} {what}, more than its {cur.left()} bytes left can hold")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = [_tensor_entry(cur) for _ in range(n_tensors)]
    alignment = metadata.get(Keys.General.ALIGNMENT, DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: {Keys.General.ALIGNMENT} {alignment!r:.40} is not a power of two (GGUF's "
                        "alignment is a uint32 power of two)")
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, kind, shape, offset in entries:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = _place(path, name, kind, shape, start + offset, len(data))
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, data=data)


def _tensor_entry(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if n_dims > MAX_DIMS:
        raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions; GGML's have at most {MAX_DIMS}")
    dims = [cur.unpack("<Q") for _ in range(n_dims)]
    kind, offset = cur.unpack("<I"), cur.unpack("<Q")
    return name, kind, tuple(reversed(dims)), offset


def _place(path: Path, name: str, kind: int, shape: tuple[int, ...], offset: int,
           file_size: int) -> GGUFTensor:
    try:
        ggml_type = GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFError(f"{path}: tensor {name!r} has type id {kind}, which GGML does not "
                        "define") from None
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if shape and shape[-1] % block:
        raise GGUFError(f"{path}: tensor {name!r} {ggml_type.name}{list(shape)}: rows of "
                        f"{shape[-1]} values are not whole blocks of {block}")
    nbytes = math.prod(shape) // block * block_bytes
    if offset + nbytes > file_size:
        raise GGUFError(f"{path}: tensor {name!r} {ggml_type.name}{list(shape)} needs bytes "
                        f"[{offset}, {offset + nbytes}) of a {file_size}-byte file")
    return GGUFTensor(name, ggml_type, shape, offset, nbytes)


def require(f: GGUFFile, key: str):
    """A metadata value the model cannot do without."""
    if key not in f.metadata:
        raise GGUFError(f"{f.path}: metadata has no {key!r}")
    return f.metadata[key]



# ---------------------------------------------------------------- a tensor's values


# GGML types kept at their width on the card (device.layout.QuantizedWeight), by format code
_Q = GGMLQuantizationType
QUANTIZED_TYPES = {_Q.Q8_0: FMT_Q8_0, _Q.Q4_0: FMT_Q4_0, _Q.Q4_1: FMT_Q4_1, _Q.Q5_0: FMT_Q5_K,
                   _Q.Q5_1: FMT_Q5_K, _Q.Q4_K: FMT_Q4_K, _Q.Q5_K: FMT_Q5_K, _Q.Q6_K: FMT_Q6_K}


def quantized_tensor(f: GGUFFile, t: GGUFTensor) -> QuantizedWeight:
    """A quantized matrix as its quants and scales (no value widened), in the card's format
    of its type (QUANTIZED_TYPES; device/layout.py's QuantizedWeight has their arithmetic).

    GGML's blocks along a row (ggml-common.h): Q8_0 d (fp16), 32 int8; Q4_0 d, 16 bytes;
    Q4_1 d, m, 16 bytes, value i of a block in the low nibble of byte i, value i + 16 in its
    high nibble; Q5_0 / Q5_1 those and a 32-bit word of 5th bits; the K-quants in super-blocks
    of 256 (_k_quant_parts)."""
    rows, cols = t.shape
    block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
    nb = cols // block
    blocks = np.frombuffer(f.data, np.uint8, t.nbytes, t.offset).reshape(rows, nb, block_bytes)
    half = lambda lo: blocks[:, :, lo:lo + 2].copy().view(np.float16).reshape(rows, nb)  # noqa: E731
    fmt = QUANTIZED_TYPES[t.ggml_type]
    if fmt == FMT_Q8_0:
        return QuantizedWeight(fmt, blocks[:, :, 2:].copy().view(np.int8).reshape(rows, cols), half(0))
    if t.ggml_type in (_Q.Q4_K, _Q.Q5_K, _Q.Q6_K):
        return QuantizedWeight(fmt, *_k_quant_parts(t.ggml_type, blocks.reshape(rows * nb, block_bytes), rows))
    five = t.ggml_type in (_Q.Q5_0, _Q.Q5_1)
    first = (4 if t.ggml_type in (_Q.Q4_1, _Q.Q5_1) else 2) + (4 if five else 0)
    qs = blocks[:, :, first:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(rows, nb, QB).astype(np.int8)
    if not five:
        return QuantizedWeight(fmt, q.reshape(rows, cols), half(0), half(2) if fmt == FMT_Q4_1 else None)
    qh = blocks[:, :, first - 4:first].copy().view(np.uint32)          # [rows, nb, 1]: bit i, value i
    q |= (((qh >> np.arange(QB, dtype=np.uint32)) & 1) << 4).astype(np.int8)
    d = half(0).astype(np.float32)
    m = half(2).astype(np.float32) if t.ggml_type == _Q.Q5_1 else d * np.float32(-16)
    return QuantizedWeight(fmt, q.reshape(rows, cols), d, m)


def _k_quant_parts(kind: GGMLQuantizationType, blocks: np.ndarray, rows: int):
    """(q int8 [rows, cols], d float32, m float32 or None) of super-blocks [n, bytes] of a
    K-quant, the scales multiplied out as GGML's dequantizer does (float32 d times the
    integer scale: exact): block_q4_K d, dmin, 12 bytes of 6-bit scales and minimums, 128
    bytes (64 values a 32 bytes: a sub-block the low nibbles, the next the high ones);
    block_q5_K those with 32 bytes of 5th bits between (bit 2i of byte l: value l of sub-block
    2i, bit 2i + 1 of sub-block 2i + 1); block_q6_K 128 bytes of low nibbles, 64 of 2-bit
    highs, 16 int8 scales (one a 16 values), d."""
    n = blocks.shape[0]
    if kind == _Q.Q6_K:
        ql, qh = blocks[:, :128].reshape(n, 2, 1, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
        ql = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 2, 4, 32)
        qh = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3     # [n, 2, 4, 32]
        q = (ql | (qh << 4)).astype(np.int8)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)      # [n, 1]
        d = d * blocks[:, 192:208].view(np.int8).astype(np.float32)            # [n, 16]
        return q.reshape(rows, -1), d.reshape(rows, -1), None
    five = kind == _Q.Q5_K
    d, dmin = (blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())                       # [n, 8] each
    qs = blocks[:, 48 if five else 16:].reshape(n, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 8, 32)
    if five:
        qh = blocks[:, 16:48].reshape(n, 1, 32)
        q |= ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    scale = d * sc.reshape(n, 8).astype(np.float32)
    low = -(dmin * mn.reshape(n, 8).astype(np.float32))
    return q.astype(np.int8).reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)


def dequantize_tensor(f: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """float32 array of ``t.shape``: F32 a read-only view of the file, others a new array."""
    block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
    row_bytes = t.shape[-1] // block * block_bytes
    raw = np.frombuffer(f.data, np.uint8, t.nbytes, t.offset)
    raw = raw.reshape(*t.shape[:-1], row_bytes)           # [rows, bytes of a row]
    out = dequantize(raw, t.ggml_type)                    # [rows, cols]
    if out.dtype != np.float32:
        out = out.astype(np.float32)
    if out.shape != t.shape:
        raise GGUFError(f"{f.path}: tensor {t.name!r} dequantized to {list(out.shape)}, "
                        f"expected {list(t.shape)}")
    return out
