"""A buffer declared once, as a table of named fields, and everything derived from it.

    INPUTS = Layout("inputs", [
        Field("tokens", np.int32, ("T",)),                 # [T]
        Field("query_start", np.int32, ("S+1",)),          # [S+1]
        Field("block_tables", np.int32, ("S", "MB")),      # [S, MB]
    ])
    p = INPUTS.place({"T": 8, "S": 2, "MB": 3})            # where each field sits for these dims
    p.nbytes                                               # bytes of the whole buffer
    v = p.views(host)                                      # name -> typed view of host (uint8[nbytes])
    v["block_tables"][1, :2] = (4, 7)                      # the host packs through the named views
    p.bindings(tensor.address)                             # program slots: name -> address,
                                                           #                name.len -> elements

A dimension of a shape is a sum of products of dim names and integers ("S+1", "QD+2*KD").
Fields sit one after the other in table order, each at a 128-byte (stick) aligned offset, so
the placement is host-side data: reordering a table moves every field's offset, its views and
its bindings together, and the compiled program (which reads each field through its own
address slot) does not change. The length slot bounds the program's view of the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spyre_serve.device.memory import STICK


def length_slot(name: str) -> str:
    """Name of the program slot holding field `name`'s length in elements."""
    return name + ".len"


@dataclass(frozen=True, slots=True)
class RowField:
    """One field of a Record: its scalar type, what a padding row holds, and its value for a
    row's item (any object the packer passes, with the packer's context)."""

    name: str
    dtype: type                               # np.int32, np.float32, np.int64
    default: float | int
    value: Callable[[Any, Any], float | int]  # (item, context) -> the field's value


class Record:
    """A row of named scalars, one numpy structured dtype (aligned, a whole number of 8-byte
    words, so the card views it through its int64 arena): a per-row input declared once.

        SAMPLE_ROW = Record("sample_row", [RowField("temperature", np.float32, 0.0,
                                                    lambda w, ctx: w.sampling.temperature), ...])
        Field("sample_rows", SAMPLE_ROW, ("S",))       # a buffer field of S records
        view[:] = SAMPLE_ROW.defaults                  # every row padding
        view[j] = SAMPLE_ROW.row(item, ctx)            # row j from its item
    A kernel reads rows[s].temperature: adding a field is one RowField and the code reading it.
    """

    def __init__(self, name: str, fields: Sequence[RowField]):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"record {name}: duplicate fields {names}")
        self.name = name
        self.fields = tuple(fields)
        packed = np.dtype([(f.name, f.dtype) for f in fields], align=True)
        self.dtype = np.dtype({"names": packed.names,
                               "formats": [packed.fields[n][0] for n in packed.names],
                               "offsets": [packed.fields[n][1] for n in packed.names],
                               "itemsize": -(-packed.itemsize // 8) * 8}, align=True)
        self.words = self.dtype.itemsize // 8      # int64 words per record
        self.defaults = np.array(tuple(f.default for f in fields), dtype=self.dtype)

    def __repr__(self) -> str:
        return f"Record({self.name!r}, {[f.name for f in self.fields]})"

    def row(self, item: Any, context: Any) -> tuple:
        """The record of one item, in field order."""
        return tuple(f.value(item, context) for f in self.fields)


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    dtype: type | Record          # np.int32, np.float32, np.int64, or a Record (one per element)
    shape: tuple[str, ...]        # dim expressions, e.g. ("S", "MB") or ("QD+2*KD",)

    @property
    def np_dtype(self) -> np.dtype:
        return self.dtype.dtype if isinstance(self.dtype, Record) else np.dtype(self.dtype)


def _parse(expr: str) -> tuple[tuple[int | str, ...], ...]:
    """'QD+2*KD' -> (('QD',), (2, 'KD')): a sum of products of dim names and integers."""
    terms = []
    for term in expr.replace(" ", "").split("+"):
        if not term:
            raise ValueError(f"dim expression {expr!r} has an empty term")
        terms.append(tuple(int(f) if f.isdigit() else f for f in term.split("*")))
    return tuple(terms)


@dataclass(frozen=True, slots=True)
class Placement:
    """A layout placed for one set of dims: byte offset and shape of each field."""

    layout: str
    fields: tuple[Field, ...]
    offsets: dict[str, int]                 # field -> byte offset in the buffer
    shapes: dict[str, tuple[int, ...]]      # field -> shape for these dims
    nbytes: int                             # bytes of the buffer (end of the last field)

    def count(self, name: str) -> int:
        """Elements of field `name`."""
        return math.prod(self.shapes[name])

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Each field as a typed, shaped view into `buf` (uint8, at least nbytes)."""
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < self.nbytes:
            raise ValueError(f"{self.layout}: views need a uint8[>= {self.nbytes}] buffer, "
                             f"got {buf.dtype}{list(buf.shape)}")
        out = {}
        for f in self.fields:
            shape = self.shapes[f.name]
            start = self.offsets[f.name]
            end = start + math.prod(shape) * f.np_dtype.itemsize
            out[f.name] = buf[start:end].view(f.np_dtype).reshape(shape)
        return out

    def bindings(self, address: int) -> dict[str, int]:
        """Program slot values for a buffer at `address`: each field's address and length."""
        out = {}
        for f in self.fields:
            out[f.name] = address + self.offsets[f.name]
            out[length_slot(f.name)] = math.prod(self.shapes[f.name])
        return out


class Layout:
    """An ordered table of fields placed in one buffer (see the module docstring)."""

    def __init__(self, name: str, fields: Sequence[Field]):
        names = [f.name for f in fields]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"layout {name}: duplicate fields {dupes}")
        self.name = name
        self.fields = tuple(fields)
        self._shapes = [(f, tuple(_parse(e) for e in f.shape), f.np_dtype.itemsize)
                        for f in self.fields]

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, {[f.name for f in self.fields]})"

    def place(self, dims: Mapping[str, int]) -> Placement:
        """Offsets and shapes of every field for these dims (one value per dim name used)."""
        offsets, shapes, end = {}, {}, 0
        for f, exprs, itemsize in self._shapes:
            shape = tuple(self._value(f, e, dims) for e in exprs)
            offsets[f.name] = end
            shapes[f.name] = shape
            end += -(-math.prod(shape) * itemsize // STICK) * STICK
        return Placement(self.name, self.fields, offsets, shapes, end)

    def _value(self, f: Field, expr, dims: Mapping[str, int]) -> int:
        total = 0
        for term in expr:
            product = 1
            for factor in term:
                if type(factor) is str:
                    if factor not in dims:
                        raise ValueError(f"layout {self.name}: field {f.name} needs dim "
                                         f"{factor!r}; dims given {sorted(dims)}")
                    factor = dims[factor]
                product *= factor
            total += product
        if total < 0:
            raise ValueError(f"layout {self.name}: field {f.name} has a negative dim {total}")
        return total
