"""The LoRA adapters on the card: K slots in device memory, placed once, evicted least recently used.

    arena = LoraArena(card, config, max_loras=K, max_rank=R, stream=runner's compute stream)
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
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.lora.adapter import LoraAdapter, LoraError
from spyre_serve.models.lora.layout import MODULES, N_MODULES, block_offsets, module_dims


class LoraArena:
    def __init__(self, card: Card, config: GraniteConfig, max_loras: int, max_rank: int, stream):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be positive")
        c = config
        self.card, self.stream = card, stream
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers = c.num_hidden_layers
        self.dims = (c.hidden_size, c.num_attention_heads * c.head_dim,
                     c.num_key_value_heads * c.head_dim, c.intermediate_size)
        self.offsets = block_offsets(*self.dims, max_rank, max_loras)
        self.block_floats = int(self.offsets[-1])
        self.tensor: DeviceTensor = card.zeros((self.layers, self.block_floats), np.float32)
        self.adapters: dict[str, LoraAdapter] = {}
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
            self.adapters[name] = adapter

    def unregister(self, name: str) -> None:
        """Forget `name`; a slot holding it is free now, or once its sequences are unpinned."""
        with self._lock:
            self._forget(name)

    def _forget(self, name: str) -> None:
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
        unpinned slot if it is not on the card; None when every slot is pinned. KeyError for an
        adapter not registered."""
        with self._lock:
            if seq_id in self._pins:
                slot = self._pins[seq_id]
                if self.slots[slot] in (name, f"\0{name}"):    # unregistered since: it finishes
                    return slot
                self.unpin(seq_id)
            if name not in self.adapters:
                raise KeyError(f"LoRA adapter {name!r} is not registered")
            slot = self.slots.index(name) if name in self.slots else self._victim()
            if slot is None:
                return None
            if self.slots[slot] != name:
                self._place(slot, self.adapters[name])
                self.slots[slot] = name
            self._pins[seq_id] = slot
            self._pinned[slot] += 1
            self._lru.pop(slot, None)
            self._lru[slot] = None
            return slot

    def unpin(self, seq_id: int) -> None:
        with self._lock:
            slot = self._pins.pop(seq_id, None)
            if slot is None:
                return
            self._pinned[slot] -= 1
            if not self._pinned[slot] and self.slots[slot] not in self.adapters:
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
