"""Device errors, `DeviceTensor` (a typed view of a place in the card's arena), and
`parse_bytes`, how a memory size is written (the server's `--device-memory` reads it).

A tensor is only an address, a shape and a dtype: it owns nothing. The bytes
live in `card.memory`; the allocator (device/allocator.py) decides where.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from spyre_serve.device.card import Card

STICK = 128  # bytes: Spyre lays tensors out in 128-byte sticks; every allocation is aligned to one


class DeviceError(RuntimeError):
    """A misuse of the device (bad address, double free, bad binding) or a failed command."""


class DeviceOutOfMemory(DeviceError):
    """The allocator cannot serve a request; the numbers say why."""

    def __init__(self, requested: int, free: int, largest_free: int, capacity: int):
        self.requested = requested
        self.free = free
        self.largest_free = largest_free
        self.capacity = capacity
        super().__init__(
            f"device out of memory: requested {requested} bytes, {free} bytes free "
            f"(largest free block {largest_free} bytes) of {capacity} bytes"
        )


def parse_bytes(text: str) -> int:
    """'1073741824', '4G', '512M', '1.5G', '64MiB', '512mb' -> bytes (binary units, any case)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise DeviceError(f"not a size: {text!r} (cannot read a memory size from it: "
                          f"use bytes or e.g. 4G, 512M, 1.5G, 64MiB)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    number = m.group(1)
    return int(float(number) * (1 << shift)) if "." in number else int(number) << shift


@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """`shape` elements of `dtype`, C-contiguous, starting at byte `address` of `card`'s arena."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    card: Card | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if any(d < 0 for d in self.shape):
            raise DeviceError(f"negative dimension in shape {self.shape}")
        if self.address % self.dtype.itemsize:
            raise DeviceError(
                f"address {self.address} is not a multiple of the {self.dtype} itemsize "
                f"{self.dtype.itemsize}"
            )

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        """A view into the arena (no copy): for tests, debugging and loading weights."""
        if self.card is None:
            raise DeviceError("tensor has no card: construct it with card= or through card.empty")
        end = self.address + self.nbytes
        if end > self.card.capacity:
            raise DeviceError(f"tensor [{self.address}, {end}) lies past the arena end {self.card.capacity}")
        return self.card.memory[self.address:end].view(self.dtype).reshape(self.shape)

    def reshape(self, *shape) -> DeviceTensor:
        """Same bytes, another shape with the same number of elements (-1 allowed once)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if shape.count(-1) > 1:
            raise DeviceError(f"cannot reshape {self.shape} to {shape}: more than one -1")
        if -1 in shape:
            known = 1
            for d in shape:
                if d != -1:
                    known *= d
            if known == 0 or self.size % known:
                raise DeviceError(f"cannot reshape {self.shape} ({self.size} elements) to {shape}")
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        n = 1
        for d in shape:
            n *= d
        if n != self.size:
            raise DeviceError(f"cannot reshape {self.shape} ({self.size} elements) to {shape} ({n} elements)")
        return DeviceTensor(self.address, shape, self.dtype, self.card)
