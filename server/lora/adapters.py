"""LoRA adapters served beside the base model (vLLM's interface): flags, names, slots.

    --enable-lora --lora-modules NAME=PATH [NAME=PATH ...] --max-loras K --max-lora-rank R
    --allow-runtime-lora          POST /v1/load_lora_adapter, /v1/unload_lora_adapter

A request picks an adapter by its ``model`` field. The API side keeps the names
(``LoraNames``: 404 for an unknown one, /v1/models lists them with the base as ``parent``);
the engine side keeps the adapters on the card (``models/lora/arena.py``, the runner's
``lora``): ``models.build_runner`` registers the ``--lora-modules`` at start, ``apply_update``
at run time, and ``lora_admits``,
the scheduler's gate: a waiting sequence is admitted once its adapter holds a slot, which it
pins until the runner forgets the sequence (so a slot in use is never evicted).

Nothing here imports a kernel module at import time (server/launch/settings.py imports it before
``device.process.configure()``): the models' LoRA modules are imported where used.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("spyre_serve")


def parse_lora_module(text: str) -> tuple[tuple[str, str], ...]:
    """One --lora-modules value (vLLM's forms): NAME=PATH, or a JSON object with "name" and
    "path"; several NAME=PATH separated by spaces (the environment variable's form)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} is not JSON: {exc}") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: a JSON module needs "
                                             "\"name\" and \"path\"")
        return ((str(value["name"]), str(value["path"])),)
    out = []
    for item in text.split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules {item!r} is not NAME=PATH")
        out.append((name, path))
    return tuple(out)


def lora_modules(value) -> dict[str, str]:
    """--lora-modules as parsed -> name -> path: argparse gives a list of each value's pairs,
    the environment's text one tuple of pairs, a caller may give a dict."""
    if isinstance(value, dict):
        return dict(value)
    pairs = []
    for item in value or ():
        is_pair = len(item) == 2 and all(isinstance(x, str) for x in item)
        pairs.extend([item] if is_pair else item)
    return dict(pairs)


def check_lora_settings(s) -> None:
    """Start-up refusals (ValueError naming the flags) of what LoRA cannot combine with."""
    modules = lora_modules(s.lora_modules)
    if not s.enable_lora:
        if modules or s.allow_runtime_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora need --enable-lora")
        return
    if s.max_loras < 1 or s.max_lora_rank < 1:
        raise ValueError(f"--max-loras {s.max_loras} and --max-lora-rank {s.max_lora_rank} must "
                         "be positive")
    why = [f"--tensor-parallel-size {s.tensor_parallel_size}" if s.tensor_parallel_size != 1 else "",
           f"--quantization {s.quantization}" if s.quantization else "",
           "--runner pooling" if s.runner == "pooling" else "",
           f"--model {s.model} (a GGUF file)" if str(s.model).endswith(".gguf") else ""]
    why = [w for w in why if w]
    if why:
        raise ValueError(f"--enable-lora serves adapters on one card's float checkpoint of a "
                         f"generating model; it cannot be combined with {', '.join(why)}")
    if s.allow_runtime_lora and s.api_server_count > 1:
        raise ValueError(f"--allow-runtime-lora with --api-server-count {s.api_server_count}: "
                         "each API process keeps its own names; give 1")
    if s.model in modules:
        raise ValueError(f"--lora-modules: {s.model!r} is the base model's name")


@dataclass(slots=True)
class LoraNames:
    """The API side's adapters: name -> (id, path); an id is new at each load, so that prefix-
    cache blocks of an adapter loaded again under its name are never shared with the old one."""

    base: str
    adapters: dict[str, tuple[int, str]] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def of(cls, settings, base: str) -> LoraNames:
        names = cls(base)
        for name, path in lora_modules(settings.lora_modules).items():
            names.add(name, path)
        return names

    def add(self, name: str, path: str) -> None:
        self.adapters[name] = (next(self._ids), path)

    def resolve(self, model: str | None) -> tuple[str, int] | None:
        """(adapter name, id) of a request's ``model``; None: the base model."""
        if model is None or model not in self.adapters:
            return None
        return model, self.adapters[model][0]


# ---- the engine side ------------------------------------------------------------------

_UPDATES = threading.Lock()


def apply_update(runner, op: str, name: str, path: str | None) -> tuple[int, str] | None:
    """Load ("load", name, path) or unload ("unload", name) an adapter in the runner's arena:
    None, or (HTTP status, why) when refused (400: bad files or rank, 404: unknown name)."""
    from spyre_serve.models import LoraError, read_adapter

    arena = getattr(runner, "lora", None)
    if arena is None:
        return 400, "LoRA is not enabled on this server (start it with --enable-lora)"
    with _UPDATES:
        if op == "unload":
            if name not in arena.adapters:
                return 404, f"The lora adapter '{name}' cannot be found."
            arena.unregister(name)
            return None
        if name in arena.adapters:
            return 400, f"The lora adapter '{name}' has already been loaded."
        try:
            arena.register(name, read_adapter(path, runner.config, arena.max_rank))
        except LoraError as exc:
            return 400, str(exc)
    log.info("LoRA adapter %s %sed%s", name, op, f" from {path}" if path else "")
    return None


def lora_admits(runner):
    """The scheduler's gate for a waiting sequence: True once its adapter (if any) holds a slot
    pinned for it; False while every slot is pinned by other adapters' sequences. An adapter
    unloaded meanwhile is admitted: its launch names it and fails that sequence alone."""
    arena = getattr(runner, "lora", None)

    def admits(seq) -> bool:
        name = seq.params.lora
        if name is None or arena is None:
            return True
        try:
            return arena.pin(seq.seq_id, name) is not None
        except KeyError:
            return True

    return admits
