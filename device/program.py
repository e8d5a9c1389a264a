"""Programs: compiled ahead of time, prepared once, launched many times.

A `Program` is one Numba entry with the fixed ABI of device/abi.py, a
manifest (name, shapes, operand slots) and, once prepared, a place on the
card: an int64 operand table ("region") and planned scratch memory.

`launch` mirrors Spyre's job plan. It turns the bindings into the slot
values on the host thread, then enqueues ONE stream command running a
`JobPlan` of four steps:

    HostCompute  write the correction blob: int64[n_slots] of addresses and dims
    H2D          copy the blob into the program's region
    Compute      call the compiled entry (under the card's compute lock); it reads the region
    D2H          copy readbacks to host arrays

The entry is called through its compiled overload (`entry_point`), never
through Numba's type-dispatching path, so a launch cannot compile.
Launches of one program share its region: order them (one stream, or events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numba.core.dispatcher import Dispatcher

from spyre_serve.device.abi import ENTRY_ARGS
from spyre_serve.device.event import Event
from spyre_serve.device.memory import DeviceError, DeviceTensor

if TYPE_CHECKING:
    from spyre_serve.device.card import Card
    from spyre_serve.device.stream import Stream

SLOT_KINDS = ("address", "dim")


@dataclass(frozen=True, slots=True)
class Slot:
    """One operand of a program: a byte address ("address") or an integer ("dim")."""

    name: str
    kind: str

    def __post_init__(self):
        if self.kind not in SLOT_KINDS:
            raise DeviceError(f"slot {self.name!r}: kind must be one of {SLOT_KINDS}, got {self.kind!r}")


# ---- job plan steps -------------------------------------------------------------
# Each step's run(card, tally) does its work and adds to tally = [h2d bytes, d2h bytes,
# compute seconds]; the plan reports the tally to the card's counters once.


@dataclass(slots=True)
class HostCompute:
    """Host work inside the plan (here: writing the blob)."""

    fn: Callable
    args: tuple = ()

    def run(self, card: Card, tally: list) -> None:
        self.fn(*self.args)


@dataclass(slots=True)
class H2D:
    """Copy a host array into device memory (`dst` is a view of the arena)."""

    dst: np.ndarray
    src: np.ndarray

    def run(self, card: Card, tally: list) -> None:
        self.dst[:] = self.src
        tally[0] += self.src.nbytes


@dataclass(slots=True)
class Compute:
    """Run a compiled function under the card's compute lock."""

    fn: Callable
    args: tuple = ()

    def run(self, card: Card, tally: list) -> None:
        with card.compute_lock:
            t0 = time.perf_counter()
            self.fn(*self.args)
            tally[2] += time.perf_counter() - t0


@dataclass(slots=True)
class ComputeParts:
    """Run a compiled function once per part, patching the part's slots into the program's
    table before each run and calling `between(k)` after run k (on the stream's thread, the
    card's compute lock released): a program run in parts that synchronize with other cards.
    `on_error` is called before an exception of a part (or of `between`) propagates."""

    fn: Callable
    args: tuple
    table: np.ndarray                        # the program's operand region, int64[n_slots]
    patches: list                            # per part: [(slot index, value), ...]
    between: Callable[[int], None]
    on_error: Callable[[], None]

    def run(self, card: Card, tally: list) -> None:
        try:
            for k, patch in enumerate(self.patches):
                for i, value in patch:
                    self.table[i] = value
                with card.compute_lock:
                    t0 = time.perf_counter()
                    self.fn(*self.args)
                    tally[2] += time.perf_counter() - t0
                self.between(k)
        except BaseException:
            self.on_error()
            raise


@dataclass(slots=True)
class D2H:
    """Copy a device tensor to a host array."""

    dst: np.ndarray
    src: DeviceTensor

    def run(self, card: Card, tally: list) -> None:
        np.copyto(self.dst, self.src.numpy().reshape(self.dst.shape))
        tally[1] += self.dst.nbytes


@dataclass(slots=True)
class JobPlan:
    name: str
    steps: list = field(default_factory=list)

    def run(self, card: Card) -> None:
        tally = [0, 0, 0.0]
        try:
            for step in self.steps:
                step.run(card, tally)
        finally:
            card.counters.add_plan(*tally)


def _run_plan(plan: JobPlan, card: Card, event: Event) -> None:
    try:
        plan.run(card)
    finally:
        event.stamp()  # the launch's event completes with this command


def _write_blob(blob: np.ndarray, values: list) -> None:
    blob[:] = values


@dataclass(slots=True)
class LaunchHandle:
    program: Program
    event: Event

    def wait(self) -> None:
        """Block until the launch (readbacks included) is done; re-raise its device error."""
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


# ---- the program --------------------------------------------------------------------


class Program:
    def __init__(self, card: Card, name: str, entry: Dispatcher, slots: Sequence[Slot],
                 scratch_bytes: int = 0, shapes: Mapping | None = None):
        if not isinstance(entry, Dispatcher):
            raise DeviceError(f"program {name!r}: entry must be an @njit function, got {type(entry).__name__}")
        if not entry.targetoptions.get("nogil"):
            raise DeviceError(f"program {name!r}: entry {entry.py_func.__name__} must be njit(nogil=True)")
        names = [s.name for s in slots]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise DeviceError(f"program {name!r}: duplicate slot names {dupes}")
        if scratch_bytes < 0:
            raise DeviceError(f"program {name!r}: scratch_bytes must be >= 0, got {scratch_bytes}")
        self.card = card
        self.name = name
        self.entry = entry
        self.slots = tuple(slots)
        self.scratch_bytes = int(scratch_bytes)
        self.shapes = dict(shapes or {})
        self.scratch: DeviceTensor | None = None
        self.table: DeviceTensor | None = None  # the operand region, int64[n_slots]
        self._index = {s.name: i for i, s in enumerate(self.slots)}
        self._is_address = [s.kind == "address" for s in self.slots]
        self._values: list[int] = [0] * len(self.slots)  # persistent bindings (bind)
        self._bound = [False] * len(self.slots)
        self._n_unbound = len(self.slots)
        self._entry_point = None
        self._h2d_dst: np.ndarray | None = None
        self._compute: Compute | None = None

    def __repr__(self) -> str:
        state = "prepared" if self.prepared else "not prepared"
        return f"Program({self.name!r}, {len(self.slots)} slots, {state})"

    @property
    def prepared(self) -> bool:
        return self._entry_point is not None

    def manifest(self) -> dict:
        return {"name": self.name, "shapes": self.shapes,
                "slots": [(s.name, s.kind) for s in self.slots], "scratch_bytes": self.scratch_bytes}

    def prepare(self) -> Program:
        """Compile the entry for the ABI (unless already compiled) and place table + scratch. Once."""
        if self.prepared:
            return self
        counters = self.card.counters
        existing = self.entry.overloads.get(ENTRY_ARGS)
        if existing is not None:
            entry_point = existing.entry_point
        else:
            stats = self.entry.stats
            misses, hits = sum(stats.cache_misses.values()), sum(stats.cache_hits.values())
            t0 = time.perf_counter()
            entry_point = self.entry.compile(ENTRY_ARGS)
            counters.add("compile_seconds", time.perf_counter() - t0)
            if sum(self.entry.stats.cache_misses.values()) > misses:
                counters.add("compiles")
            elif sum(self.entry.stats.cache_hits.values()) > hits:
                counters.add("cache_loads")
        ret = self.entry.overloads[ENTRY_ARGS].signature.return_type
        if str(ret) != "none":
            raise DeviceError(f"program {self.name!r}: entry must return nothing, returns {ret}")
        card = self.card
        self.table = card.empty((len(self.slots),), np.int64)
        if self.scratch_bytes:
            self.scratch = card.empty((self.scratch_bytes,), np.uint8)
        start = self.table.address >> 3
        region = card.i64[start:start + len(self.slots)]  # int64[n_slots], C-contiguous view
        self._h2d_dst = region
        self._compute = Compute(entry_point, (card.f32, card.i32, card.i64, card.u16, region))
        self._entry_point = entry_point
        counters.add("prepares")
        return self

    def bind(self, bindings: Mapping) -> None:
        """Bindings that persist across launches (weights, scratch); a launch may still override them."""
        for name, value in bindings.items():
            i = self._slot(name)
            self._values[i] = self._convert(i, name, value)
            if not self._bound[i]:
                self._bound[i] = True
                self._n_unbound -= 1

    def launch(self, stream: Stream | None = None, bindings: Mapping | None = None,
               readback: Sequence = (), compute: ComputeParts | None = None) -> LaunchHandle:
        """Enqueue one run with these bindings; returns at once. Never compiles. (`compute`:
        the run in parts of `launch_parts`.)"""
        t0 = time.perf_counter()
        if self._entry_point is None:
            raise DeviceError(f"program {self.name!r} launched before prepare()")
        stream = stream or self.card.default_stream
        values = self._values.copy()
        covered = 0
        if bindings:
            index, bound, is_addr, card = self._index, self._bound, self._is_address, self.card
            for name, value in bindings.items():
                i = index.get(name)
                if i is None:
                    raise DeviceError(f"program {self.name!r}: unknown slot {name!r}; slots are {list(index)}")
                if is_addr[i] and type(value) is DeviceTensor and value.card is card:
                    values[i] = value.address  # fast path for the common case
                else:
                    values[i] = self._convert(i, name, value)
                if not bound[i]:
                    covered += 1
        if covered != self._n_unbound:
            given = set(bindings or ())
            missing = [s.name for s, b in zip(self.slots, self._bound, strict=True) if not b and s.name not in given]
            raise DeviceError(f"program {self.name!r}: missing bindings for slots {missing}")
        blob = np.empty(len(values), np.int64)
        steps = [HostCompute(_write_blob, (blob, values)), H2D(self._h2d_dst, blob), compute or self._compute]
        for host, dev in readback:
            steps.append(self._readback_step(host, dev))
        event = Event()
        event.mark(stream, stream.enqueue(_run_plan, JobPlan(self.name, steps), self.card, event,
                                          compute=False, label=self.name))
        self.card.counters.add_launch(8 * len(values), time.perf_counter() - t0)
        return LaunchHandle(self, event)

    def launch_parts(self, stream: Stream, bindings: Mapping, parts: Sequence[Mapping],
                     between: Callable[[int], None], on_error: Callable[[], None],
                     readback: Sequence = ()) -> LaunchHandle:
        """One launch run as len(parts) computes (`ComputeParts`): the table written once with
        `bindings`, then before compute k the slots of parts[k] patched into it in place (no new
        table is written), `between(k)` after it; readbacks after the last. Never compiles."""
        if self._entry_point is None:
            raise DeviceError(f"program {self.name!r} launched before prepare()")
        patches = [[(self._slot(name), self._convert(self._slot(name), name, value))
                    for name, value in part.items()] for part in parts]
        compute = ComputeParts(self._compute.fn, self._compute.args, self._h2d_dst, patches, between, on_error)
        return self.launch(stream, {**bindings, **parts[0]}, readback=readback, compute=compute)

    def release(self) -> None:
        """Give the table region and scratch back to the card."""
        for t in (self.table, self.scratch):
            if t is not None:
                self.card.free(t)
        self.table = self.scratch = None
        self._entry_point = self._compute = self._h2d_dst = None

    # helpers ------------------------------------------------------------------
    def _slot(self, name: str) -> int:
        i = self._index.get(name)
        if i is None:
            raise DeviceError(f"program {self.name!r}: unknown slot {name!r}; slots are {list(self._index)}")
        return i

    def _convert(self, i: int, name: str, value) -> int:
        if self._is_address[i]:
            if isinstance(value, DeviceTensor):
                if value.card is not None and value.card is not self.card:
                    raise DeviceError(f"program {self.name!r}: slot {name!r} bound to a tensor of another card")
                return value.address
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                if not 0 <= value < self.card.capacity:
                    raise DeviceError(f"program {self.name!r}: address {value} for slot {name!r} "
                                      f"is outside the arena (0..{self.card.capacity})")
                return int(value)
            raise DeviceError(f"program {self.name!r}: address slot {name!r} needs a DeviceTensor "
                              f"or an int address, got {type(value).__name__}")
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        raise DeviceError(f"program {self.name!r}: dim slot {name!r} needs an int, got {type(value).__name__}")

    def _readback_step(self, host, dev) -> D2H:
        if not isinstance(host, np.ndarray) or not isinstance(dev, DeviceTensor):
            raise DeviceError(f"program {self.name!r}: readback wants (host ndarray, DeviceTensor) pairs")
        if host.size != dev.size or host.dtype != dev.dtype or not host.flags.writeable:
            raise DeviceError(f"program {self.name!r}: readback into host {host.shape} {host.dtype} "
                              f"from device {dev.shape} {dev.dtype}: need a writable array, same dtype and size")
        return D2H(host, dev)
