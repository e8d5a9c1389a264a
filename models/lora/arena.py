"""The LoRA adapters on the card: K slots in device memory, placed once, evicted least recently used.

    arena = LoraArena(card, config, max_loras=K, max_rank=R, stream=runner's compute stream,
                      max_cpu_loras=C)   # adapters kept in host memory (vLLM's --max-cpu-loras; K)
    arena.register("sql", adapter)       # models/lora/adapter.py's LoraAdapter; not placed yet
    slot = arena.pin(seq_id, "sql")      # its slot (placed there first if it was not), or None
                                         # when every slot is pinned by another adapter's sequences
    arena.unpin(seq_id)                  # (the runner's forget) the slot may be reused
    arena.unregister("sql")              # gone from the registry; its slot is free once unpinned
    arena.layer_columns()                # per layer (block address, R, K): the layer table's

An adapter is copied into its slot on the compute stream, so it lands after every step
launched before it and before every step launched after it; a slot is only overwritten when
no sequence pins it, and the runner unpins a sequence only once no launched step holding it is
unread (its `forget`), so no step ever reads a slot while it changes. Layout of a slot: see
models/lora/layout.py.

Host memory holds at most C adapters (`adapters`, least recently registered or pinned first
out), as vLLM's CPU cache of --max-cpu-loras: 40 loads grew the engine by 170 MB without a
cap (issue 38). Every registered name keeps its directory (`paths`); placing an adapter whose
copy was dropped reads it again from there first, as vLLM's worker does, on the thread that
pins (the engine's), outside the lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.lora.adapter import LoraAdapter, LoraError, read_adapter
from spyre_serve.models.lora.layout import MODULES, N_MODULES, block_offsets, module_dims

log = logging.getLogger("spyre_serve")


class LoraArena:
    def __init__(self, card: Card, config: GraniteConfig, max_loras: int, max_rank: int, stream,
                 max_cpu_loras: int | None = None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be positive")
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        c = config
        self.card, self.stream, self.config = card, stream, config
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.layers = c.num_hidden_layers
        self.dims = (c.hidden_size, c.num_attention_heads * c.head_dim,
                     c.num_key_value_heads * c.head_dim, c.intermediate_size)
        self.offsets = block_offsets(*self.dims, max_rank, max_loras)
        self.block_floats = int(self.offsets[-1])
        self.tensor: DeviceTensor = card.zeros((self.layers, self.block_floats), np.float32)
        self.paths: dict[str, Path] = {}                     # every registered adapter's directory
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()   # host copies, least recently used first
        self.slots: list[str | None] = [None] * max_loras     # adapter placed in each slot
        self._placed: list[tuple[tuple[str, ...], int]] = [((), 0)] * max_loras  # its targets, rank
        self._lru: OrderedDict[int, None] = OrderedDict()     # slots, least recently used first
        self._pins: dict[int, int] = {}                       # seq_id -> slot
        self._pinned = [0] * max_loras                        # sequences holding each slot
        self._lock = threading.RLock()    # the registry changes from the API's side at run time

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def layer_columns(self) -> list[tuple[int, int, int]]:
        """Per layer: (block address, rank R, slots K), the layer table's LoRA columns."""
        row = self.block_floats * 4
        return [(self.tensor.address + i * row, self.max_rank, self.max_loras)
                for i in range(self.layers)]

    # ---- registry (any thread: under the lock) -----------------------------------------
    def register(self, name: str, adapter: LoraAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise LoraError(f"{adapter.path}: LoRA rank {adapter.rank} is greater than "
                            f"max_lora_rank {self.max_rank}", rank_over=True)
        with self._lock:
            self._forget(name)
            self.paths[name] = adapter.path
            self._keep(name, adapter)

    def unregister(self, name: str) -> None:
        """Forget `name`; a slot holding it is free now, or once its sequences are unpinned."""
        with self._lock:
            self._forget(name)

    def registered(self) -> list[str]:
        """The names registered, in the order they were."""
        with self._lock:
            return list(self.paths)

    def _keep(self, name: str, adapter: LoraAdapter) -> None:
        """Hold `name`'s host copy, the least recently used dropped past max_cpu_loras (a slot
        that holds one keeps it; it is read again only to be placed again)."""
        self.adapters[name] = adapter
        self.adapters.move_to_end(name)
        while len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)

    def _forget(self, name: str) -> None:
        self.paths.pop(name, None)
        self.adapters.pop(name, None)
        for s, held in enumerate(self.slots):
            if held == name:
                self._lru.pop(s, None)
                # pinned: its sequences keep reading it; the name no longer finds it
                self.slots[s] = None if not self._pinned[s] else f"\0{name}"

    # ---- slots ------------------------------------------------------------------------
    def slot_of(self, seq_id: int) -> int:
        """The slot pinned for seq_id, -1 for none."""
        return self._pins.get(seq_id, -1)

    def can_pin(self, name: str) -> bool:
        """Whether `pin` would find a slot for `name` now."""
        with self._lock:
            return name in self.slots or any(not n for n in self._pinned)

    def pin(self, seq_id: int, name: str) -> int | None:
        """The slot holding adapter `name` for seq_id (idempotent: a sequence keeps its slot
        even if the adapter is unregistered meanwhile), placing it in the least recently used
        unpinned slot if it is not on the card (read again from its directory first if its
        host copy was dropped); None when every slot is pinned. KeyError for an adapter not
        registered, or whose files no longer read."""
        while True:
            with self._lock:
                if seq_id in self._pins:
                    slot = self._pins[seq_id]
                    if self.slots[slot] in (name, f"\0{name}"):    # unregistered since: it finishes
                        return slot
                    self.unpin(seq_id)
                if name not in self.paths:
                    raise KeyError(f"LoRA adapter {name!r} is not registered")
                slot = self.slots.index(name) if name in self.slots else self._victim()
                if slot is None:
                    return None
                if self.slots[slot] == name or name in self.adapters:
                    if self.slots[slot] != name:
                        self._place(slot, self.adapters[name])
                        self.slots[slot] = name
                    if name in self.adapters:
                        self.adapters.move_to_end(name)
                    self._pins[seq_id] = slot
                    self._pinned[slot] += 1
                    self._lru.pop(slot, None)
                    self._lru[slot] = None
                    return slot
                path = self.paths[name]
            try:                   # its host copy was dropped: read it again, the lock not held
                adapter = read_adapter(path, self.config, self.max_rank)
            except LoraError as exc:
                log.warning("LoRA adapter %s could not be read again from %s: %s", name, path, exc)
                raise KeyError(f"LoRA adapter {name!r} could not be read again from its files (changed or "
                               "removed since it was loaded)") from None
            with self._lock:
                if self.paths.get(name) == path and name not in self.adapters:
                    self._keep(name, adapter)

    def unpin(self, seq_id: int) -> None:
        with self._lock:
            slot = self._pins.pop(seq_id, None)
            if slot is None:
                return
            self._pinned[slot] -= 1
            if not self._pinned[slot] and self.slots[slot] not in self.paths:
                self.slots[slot] = None          # unregistered while in use
                self._lru.pop(slot, None)

    def targets_of(self, slots: dict[int, int]) -> dict[int, tuple[int, tuple[str, ...], int]]:
        """seq_id -> (its slot, the modules the adapter placed there targets, its rank), for
        the projection of a step (models/sizing/projection.py's step_of_work)."""
        return {seq: (slot, *self._placed[slot]) for seq, slot in slots.items()}

    def pinned(self) -> int:
        """Sequences holding a slot: 0 once every sequence is unpinned."""
        return len(self._pins)

    def _victim(self) -> int | None:
        for s, name in enumerate(self.slots):
            if name is None:
                return s
        for s in self._lru:
            if not self._pinned[s]:
                return s
        return None

    def _place(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy the adapter into `slot` of every layer's block (zero where it has no weight)."""
        rank, k_slots = self.max_rank, self.max_loras
        base = self.tensor.address
        for layer in range(self.layers):
            at = base + layer * self.block_floats * 4
            scales = np.zeros(N_MODULES, np.float32)
            for m, module in enumerate(MODULES):
                k, n = module_dims(m, *self.dims)
                ab = adapter.weights.get((layer, module))
                if ab is not None:       # the slot's first rows; the kernel reads no others
                    a, b = ab            # A [r, K], B.T [r, N]: the slot's layout
                    scales[m] = adapter.scaling
                    self._copy(at + 4 * (int(self.offsets[1 + 2 * m]) + slot * rank * k), a)
                    self._copy(at + 4 * (int(self.offsets[2 + 2 * m]) + slot * rank * n), b)
            for m in range(N_MODULES):
                self._copy(at + 4 * (m * k_slots + slot), scales[m:m + 1])
            self._copy(at + 4 * (N_MODULES * k_slots + slot), np.array([adapter.rank], np.float32))
        self._placed[slot] = (tuple(adapter.targets), adapter.rank)

    def _copy(self, address: int, host: np.ndarray) -> None:
        self.stream.copy_h2d(DeviceTensor(address, host.shape, np.float32, self.card), host)

    def free(self) -> None:
        self.stream.synchronize()
        self.card.free(self.tensor)
