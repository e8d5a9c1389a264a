"""Weights placed once on the card, in the layout the GEMM kernels read (weight-stationary).

A caller hands over a weight as the K x N matrix of a GEMM (out[M, N] = a[M, K] @ W[K, N])
and a storage format; the card packs it once into panels of NR columns and keeps it:

    W [K, N]                     packed: panel p = columns p*NR .. p*NR+NR-1
    +----+----+----+--           +---------------+  k = 0     NR values, contiguous
    | p0 | p1 | p2 |             | panel 0       |  k = 1
    |    |    |    |    ---->    |  K x NR       |  ...
    |    |    |    |             +---------------+
    +----+----+----+--           | panel 1       |  (the last panel is zero past column N)

Formats: "float32", "bfloat16", "float16" or "dlfloat16" (16-bit values stored as uint16 bits; the
kernels widen them to float32 right after the load, or multiply bfloat16 pairs natively; a
bfloat16 panel keeps rows k and k + 1 of a column together, K padded to BF16_KB rows). Converting float32 to a 16-bit
format rounds to nearest even, as torch's `.to(torch.bfloat16 / torch.float16)` does, so a
checkpoint stored in that format is placed bit for bit.

Block-quantized weights ("Q8_0", "Q4_0", "Q4_1": GGML's formats; "FP8_E4M3": 8-bit floats
with a scale a column, in Q8_0's records) come as a `QuantizedWeight`, the quants and scales of each output channel in
blocks of QB = 32 inputs, and are placed at their width: each panel is K / QB records of QB rows (the NR scales, the
Q4_1 minimums, then the quants in groups of 4 rows; device/kernels/gemm/microkernel.py has the
bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spyre_serve.device.card import Card
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_DLF16,
    FMT_F16,
    FMT_F32,
    FMT_FP8,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q6_K_MIN,
    FMT_Q8_0,
    FORMAT_NAMES,
    FORMATS,
    HIGH_BITS,
    QUANTS_AT,
    RECORD_BYTES,
    padded_k,
)
from spyre_serve.device.kernels.simd import NR, QB
from spyre_serve.device.memory import DeviceError, DeviceTensor
from spyre_serve.device.numerics import dlfloat16_decode, dlfloat16_encode, fp8_e4m3_decode

STORAGE = {FMT_F32: np.float32, FMT_BF16: np.uint16, FMT_F16: np.uint16, FMT_DLF16: np.uint16}
K_QUANTS = (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q6_K_MIN)
QUANTIZED = (FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_FP8, *K_QUANTS)


def format_code(dtype: str) -> int:
    """FMT_* code of a storage format name; DeviceError naming the formats otherwise."""
    try:
        return FORMATS[dtype]
    except KeyError:
        raise DeviceError(f"weight format {dtype!r} is not one of {sorted(FORMATS)}") from None


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode(x: np.ndarray, fmt: int) -> np.ndarray:
    """float32 values -> storage values of format fmt (float32, or uint16 bits)."""
    x = np.asarray(x, np.float32)
    if fmt == FMT_F32:
        return x
    if fmt == FMT_BF16:
        return to_bf16_bits(x)
    if fmt == FMT_DLF16:
        return dlfloat16_encode(x)
    return x.astype(np.float16).view(np.uint16)


def decode(stored: np.ndarray, fmt: int) -> np.ndarray:
    """Storage values of format fmt -> float32, exactly (what the kernels compute with)."""
    if fmt == FMT_F32:
        return np.asarray(stored, np.float32)
    if fmt == FMT_BF16:
        return from_bf16_bits(stored)
    if fmt == FMT_DLF16:
        return dlfloat16_decode(stored)
    return stored.view(np.float16).astype(np.float32)


def packed_shape(k: int, n: int, fmt: int = FMT_F32) -> tuple[int, int, int]:
    """(panels, rows, NR) of a packed K x N weight (rows: K, a bfloat16 weight's padded)."""
    return (-(-n // NR), int(padded_k(k, fmt)), NR)


def pack(w: np.ndarray, fmt: int) -> np.ndarray:
    """W[K, N] (float32) -> its panels [ceil(N/NR), K, NR] in format fmt, zero past column N;
    bfloat16: K padded with zero rows, each pair of rows a column's two values together (the
    array [P, K/2, NR, 2], seen as [P, K, NR])."""
    k, n = w.shape
    p, kp, _ = packed_shape(k, n, fmt)
    full = np.zeros((kp, p * NR), STORAGE[fmt])
    full[:k, :n] = encode(w, fmt)
    if fmt == FMT_BF16:
        return np.ascontiguousarray(
            full.reshape(kp // 2, 2, p, NR).transpose(2, 0, 3, 1)).reshape(p, kp, NR)
    return np.ascontiguousarray(full.reshape(kp, p, NR).transpose(1, 0, 2))


def unpack(panels: np.ndarray, n: int, fmt: int, k: int | None = None) -> np.ndarray:
    """The float32 K x N matrix the kernels compute with (inverse of pack, widened); k: the
    weight's rows (default: every row the panels hold)."""
    p, kp, nr = panels.shape
    values = decode(panels, fmt)
    if fmt == FMT_BF16:
        full = values.reshape(p, kp // 2, nr, 2).transpose(1, 3, 0, 2).reshape(kp, p * nr)
    else:
        full = values.transpose(1, 0, 2).reshape(kp, p * nr)
    return full[:kp if k is None else k, :n]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A block-quantized [N, K] matrix in GGML's orientation (rows: output channels, blocks of
    QB along a row), the transpose of the GEMM's W[K, N]:

        value[n, k] = d[n, k // QB] * q[n, k]                 Q8_0 (q int8)
                    = d[n, k // QB] * (q[n, k] - 8)           Q4_0 (q 0..15)
                    = d[n, k // QB] * q[n, k] + m[n, k // QB] Q4_1 (q 0..15), Q4_K (q 0..15),
                                                              Q5_K (q 0..31)
                    = d[n, k // 16] * (q[n, k] - 32)          Q6_K (q 0..63)
                    = d[n, k // 16] * q[n, k] + m[n, k // 16] Q6_K_MIN (q 0..63)
                    = d[n, k // QB] * e4m3(q[n, k])           FP8_E4M3 (q uint8 codes)

    Q8_0, Q4_0, Q4_1 and FP8 hold d and m in float16, the products computed in float32 as
    GGML's dequantizer does. The K-quants hold them in float32: a K-quant's scale of a block
    (d times a 6- or 8-bit integer of the super-block) and minimum, as GGML's dequantizer
    multiplies them out, exactly (models/gguf/file.py); GGML's Q5_0 and Q5_1 are Q5_K's
    (their float16 scale and minimum widened, Q5_0's minimum -16 d). Q6_K_MIN is no GGML type:
    the record that holds Q4_K, Q5_K and Q6_K alike (exactly_as), for a fused projection of
    them. Every product d * q is exact in float32, so one rounding gives the value GGML's two
    give."""

    fmt: int                     # FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_FP8 or a K-quant's (K_QUANTS)
    q: np.ndarray                # int8 [N, K] (FP8: uint8 E4M3 codes)
    d: np.ndarray                # float16 [N, K / QB]; K-quants float32 [N, K / sub_block(fmt)]
    m: np.ndarray | None = None  # Q4_1 float16, Q4_K / Q5_K / Q6_K_MIN float32 [N, K / sub_block(fmt)]

    def __post_init__(self):
        n, k = self.q.shape
        if self.fmt not in QUANTIZED:
            raise DeviceError(f"format {self.fmt} is not block-quantized")
        has_m = self.fmt in (FMT_Q4_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K_MIN)
        sub = sub_block(self.fmt)
        scale = np.float32 if self.fmt in K_QUANTS else np.float16
        if k % QB or self.d.shape != (n, k // sub) or (self.m is None) == has_m \
                or (self.m is not None and self.m.shape != (n, k // sub)):
            raise DeviceError(f"a {FORMAT_NAMES[self.fmt]} weight [{n}, {k}] needs K in blocks of "
                              f"{QB} and scales [{n}, {k // sub}]; got d {self.d.shape}")
        if self.d.dtype != scale or (self.m is not None and self.m.dtype != scale):
            raise DeviceError(f"a {FORMAT_NAMES[self.fmt]} weight's scales are {np.dtype(scale).name}, "
                              f"got {self.d.dtype.name}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], as GGML's dequantizer computes it."""
        d = np.repeat(self.d.astype(np.float32), sub_block(self.fmt), axis=1)
        q = self.q.astype(np.float32)
        if self.fmt == FMT_Q8_0:
            return q * d
        if self.fmt == FMT_FP8:
            return d * fp8_e4m3_decode(self.q)
        if self.fmt == FMT_Q4_0:
            return d * (q - np.float32(8))
        if self.fmt == FMT_Q6_K:
            return d * (q - np.float32(32))
        return d * q + np.repeat(self.m.astype(np.float32), sub_block(self.fmt), axis=1)

    def take_rows(self, order: np.ndarray) -> QuantizedWeight:
        """The rows in `order` (a permutation of output channels)."""
        return QuantizedWeight(self.fmt, self.q[order], self.d[order],
                               None if self.m is None else self.m[order])

    def exactly_as(self, fmt: int) -> QuantizedWeight | None:
        """The same values in format `fmt`, where it holds them exactly, else None: Q4_0, and
        a Q5_0 (Q5_K's record with m = -16 d, d a float16), as Q8_0 (q - 8, q - 16); Q4_0, Q4_1
        and Q4_K as Q5_K (the scales widened to float32; Q4_0's m = -8 d); those, Q5_K and
        Q6_K as Q6_K_MIN (a block's scale and minimum for both its halves; Q6_K's m = -32 d)."""
        if fmt == self.fmt:
            return self
        if fmt == FMT_Q8_0 and self.fmt == FMT_Q4_0:
            return QuantizedWeight(fmt, self.q - np.int8(8), self.d)
        if fmt == FMT_Q8_0 and self.fmt == FMT_Q5_K:
            d16 = self.d.astype(np.float16)
            if np.array_equal(d16.astype(np.float32), self.d) and np.array_equal(self.m, self.d * np.float32(-16)):
                return QuantizedWeight(fmt, self.q - np.int8(16), d16)
            return None
        if fmt == FMT_Q5_K and self.fmt in (FMT_Q4_0, FMT_Q4_1, FMT_Q4_K):
            d = self.d.astype(np.float32)
            return QuantizedWeight(fmt, self.q, d, d * np.float32(-8) if self.m is None else self.m.astype(np.float32))
        if fmt == FMT_Q6_K_MIN and self.fmt == FMT_Q6_K:
            return QuantizedWeight(fmt, self.q, self.d, self.d * np.float32(-32))
        if fmt == FMT_Q6_K_MIN:
            five = self.exactly_as(FMT_Q5_K)
            if five is not None:
                return QuantizedWeight(fmt, five.q, np.repeat(five.d, 2, axis=1), np.repeat(five.m, 2, axis=1))
        return None

    @staticmethod
    def in_one_format(parts: list[QuantizedWeight]) -> list[QuantizedWeight] | None:
        """The parts in one format that holds every part's values exactly (the narrowest of
        their own, Q5_K, Q8_0 and Q6_K_MIN that does: exactly_as), or None: a fused projection
        of a Q4_K_M file (a Q8_0 or Q6_K v_proj beside Q5_0 or Q4_K q and k) at a quantized
        width."""
        candidates = {p.fmt for p in parts} | {FMT_Q5_K, FMT_Q8_0, FMT_Q6_K_MIN}
        for fmt in sorted(candidates, key=lambda f: (RECORD_BYTES[f], f)):
            converted = [p.exactly_as(fmt) for p in parts]
            if all(c is not None for c in converted):
                return converted
        return None

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of every part, in order (a fused projection's outputs); one format."""
        fmts = {p.fmt for p in parts}
        if len(fmts) != 1:
            raise DeviceError(f"cannot stack weights of formats {sorted(FORMAT_NAMES[f] for f in fmts)}")
        m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
        return QuantizedWeight(parts[0].fmt, np.concatenate([p.q for p in parts]),
                               np.concatenate([p.d for p in parts]), m)


def sub_block(fmt: int) -> int:
    """Rows of a weight's block that share one scale: QB, Q6_K's half a block."""
    return QB // 2 if fmt in (FMT_Q6_K, FMT_Q6_K_MIN) else QB


def pack_quantized(qw: QuantizedWeight) -> np.ndarray:
    """A QuantizedWeight [N, K] -> the GEMM's panels of W = its transpose, as uint8
    [ceil(N/NR), K/QB, record bytes], zero past column N."""
    n, k = qw.shape
    p, nb = -(-n // NR), k // QB

    def by_panel(x, fill=0):                     # [N, ...] -> [P, NR, ...], zero rows past N
        out = np.full((p * NR, *x.shape[1:]), fill, x.dtype)
        out[:n] = x
        return out.reshape(p, NR, *x.shape[1:])

    if qw.fmt == FMT_Q6_K:                                               # [P, NR, nb, 2] halves
        scales = [by_panel(qw.d).reshape(p, NR, nb, 2)[..., h] for h in (0, 1)]
    elif qw.fmt == FMT_Q6_K_MIN:                                         # each half's d, then m
        scales = [by_panel(x).reshape(p, NR, nb, 2)[..., h] for h in (0, 1) for x in (qw.d, qw.m)]
    else:
        scales = [by_panel(qw.d)] + ([by_panel(qw.m)] if qw.m is not None else [])
    parts = [np.ascontiguousarray(s.transpose(0, 2, 1)).view(np.uint8).reshape(p, nb, -1)
             for s in scales]                                            # [P, nb, NR scales]
    # the quants in groups of 4 rows: group g of a record is NR columns of 4 bytes (rows 4g..4g+3)
    q = by_panel(qw.q)                                                   # [P, NR, K]
    if qw.fmt in (FMT_Q8_0, FMT_FP8):
        q = q.reshape(p, NR, nb, QB // 4, 4).transpose(0, 2, 3, 1, 4)   # [P, nb, G, NR, 4]
        parts.append(np.ascontiguousarray(q).view(np.uint8).reshape(p, nb, QB * NR))
    else:                       # a byte: row r (low nibble) and row r + QB/2 (high) of a column
        low = q & 15
        q4 = low.reshape(p, NR, nb, 2, QB // 8, 4).transpose(0, 2, 3, 4, 1, 5).view(np.uint8)
        parts.append((q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(p, nb, QB // 2 * NR))
        if HIGH_BITS[qw.fmt]:
            parts.append(_pack_high_bits(q, qw.fmt, p, nb))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=2))
    assert packed.shape[2] == RECORD_BYTES[qw.fmt]
    return packed


def _pack_high_bits(q: np.ndarray, fmt: int, p: int, nb: int) -> np.ndarray:
    """The bits of q [P, NR, K] above the nibble as a record's planes [P, nb, words x NR x 4]:
    a column's word w, byte t holds, for rows 16 h + 4 g + t (h the half, g the group), the
    hb high bits at bit (4 h + g) hb - 8 w (hb = 1: one word; hb = 2: word h, bits 2 g)."""
    hb = HIGH_BITS[fmt]
    hi = (q.astype(np.uint8) >> 4).reshape(p, NR, nb, 2, QB // 8, 4).transpose(0, 2, 3, 4, 1, 5)
    planes = np.zeros((p, nb, hb, NR, 4), np.uint8)                      # [P, nb, W, NR, t]
    for h in range(2):
        for g in range(QB // 8):
            at = (4 * h + g) * hb
            planes[:, :, at // 8] |= hi[:, :, h, g] << (at % 8)
    return planes.reshape(p, nb, hb * 4 * NR)


def unpack_quantized(panels: np.ndarray, n: int, fmt: int) -> np.ndarray:
    """The float32 K x N matrix the kernels compute with, from quantized panels."""
    p, nb, _ = panels.shape
    wide = fmt in K_QUANTS
    scale = (lambda lo: panels[:, :, lo:lo + 4 * NR].copy().view(np.float32)) if wide else \
        (lambda lo: panels[:, :, lo:lo + 2 * NR].copy().view(np.float16).astype(np.float32))
    step = 4 * NR if wide else 2 * NR
    d = scale(0)                                                         # [P, nb, NR]
    raw = panels[:, :, QUANTS_AT[fmt]:]
    if fmt in (FMT_Q8_0, FMT_FP8):  # [P, nb, G, NR, 4] -> rows 4g + t of each column
        q = raw.reshape(p, nb, QB // 4, NR, 4).transpose(0, 1, 2, 4, 3).reshape(p, nb, QB, NR)
        q = fp8_e4m3_decode(q) if fmt == FMT_FP8 else q.view(np.int8).astype(np.float32)
    else:
        b = raw[:, :, :QB * NR // 2].reshape(p, nb, QB // 8, NR, 4).transpose(0, 1, 2, 4, 3)
        q = np.concatenate([b & 15, b >> 4], axis=2).astype(np.int32)  # [P, nb, 2 G, 4, NR]
        hb = HIGH_BITS[fmt]
        if hb:
            planes = raw[:, :, QB * NR // 2:].reshape(p, nb, hb, NR, 4).transpose(0, 1, 2, 4, 3)
            for h in range(2):
                for g in range(QB // 8):
                    at = (4 * h + g) * hb
                    bits = (planes[:, :, at // 8] >> (at % 8)) & ((1 << hb) - 1)
                    q[:, :, 4 * h + g] |= bits.astype(np.int32) << 4
        q = q.reshape(p, nb, QB, NR).astype(np.float32)
    if fmt == FMT_Q6_K:
        halves = np.repeat(np.stack([d, scale(step)], axis=2), QB // 2, axis=2)   # [P, nb, QB, NR]
        w = halves * (q - np.float32(32))
    elif fmt == FMT_Q6_K_MIN:
        d, m = (np.repeat(np.stack([scale(at), scale(at + 2 * step)], axis=2), QB // 2, axis=2)
                for at in (0, step))
        w = d * q + m
    else:
        w = d[:, :, None, :] * (q - np.float32(8) if fmt == FMT_Q4_0 else q)
    if fmt in (FMT_Q4_1, FMT_Q4_K, FMT_Q5_K):
        w = w + scale(step)[:, :, None, :]
    return w.reshape(p, nb * QB, NR).transpose(1, 0, 2).reshape(nb * QB, p * NR)[:, :n]


@dataclass(frozen=True, slots=True)
class GemmWeight:
    """A K x N GEMM weight on the card, in panels (see the module docstring)."""

    tensor: DeviceTensor     # [ceil(N/NR), K, NR] float32 or uint16; quantized: uint8
    k: int                   #   [ceil(N/NR), K/QB, record bytes]
    n: int
    fmt: int                 # FMT_F32, FMT_BF16, FMT_F16, FMT_DLF16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_FP8

    @property
    def address(self) -> int:
        return self.tensor.address

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def numpy(self) -> np.ndarray:
        """The float32 K x N matrix as the kernels see it (tests and debugging)."""
        if self.fmt in QUANTIZED:
            return unpack_quantized(self.tensor.numpy(), self.n, self.fmt)
        return unpack(self.tensor.numpy(), self.n, self.fmt, self.k)


def place_quantized_weight(card: Card, qw: QuantizedWeight) -> GemmWeight:
    """Place the GEMM weight W = qw.T [K, N] at qw's width, once."""
    panels = pack_quantized(qw)
    t = card.empty(panels.shape, np.uint8)
    t.numpy()[...] = panels
    n, k = qw.shape
    return GemmWeight(tensor=t, k=k, n=n, fmt=qw.fmt)


def place_gemm_weight(card: Card, w: np.ndarray, dtype: str) -> GemmWeight:
    """Pack W[K, N] into panels of format `dtype` and place it on `card`, once."""
    fmt = format_code(dtype)
    if fmt in QUANTIZED:
        raise DeviceError(f"a {dtype} weight is placed from its quants (place_quantized_weight)")
    w = np.asarray(w)
    if w.ndim != 2:
        raise DeviceError(f"a GEMM weight is a K x N matrix, got shape {w.shape}")
    panels = pack(w, fmt)
    t = card.empty(panels.shape, panels.dtype)
    t.numpy()[...] = panels
    return GemmWeight(tensor=t, k=int(w.shape[0]), n=int(w.shape[1]), fmt=fmt)
