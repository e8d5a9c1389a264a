"""LoRA adapters served beside the base model (vLLM's interface): flags, names, slots.

    --enable-lora --lora-modules NAME=PATH [NAME=PATH ...] --max-loras K --max-lora-rank R
    --max-cpu-loras C             adapters kept in host memory (vLLM's; default K)
    --allow-runtime-lora          POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    --allowed-lora-root DIR ...   where those may read (default: the --lora-modules' directories)

A request picks an adapter by its ``model`` field. The API side keeps the names
(``LoraNames``: 404 for an unknown one, /v1/models lists them with the base as ``parent``);
the engine side keeps the adapters on the card (``models/lora/arena.py``, the runner's
``lora``): ``models.build_runner`` registers the ``--lora-modules`` at start, ``apply_update``
at run time, and ``lora_admits``,
the scheduler's gate: a waiting sequence is admitted once its adapter holds a slot, which it
pins until the runner forgets the sequence (so a slot in use is never evicted).

A runtime load names a path on the server, and anyone with the key (or anyone, without one)
may send it, so (issue 38): the path is read only if its real path, and its two files' real
paths, lie under an allowed root and the files are regular (``runtime_path``, in the API
process), every path refused gets one message whatever exists there, the files are capped in
size (``models/lora/adapter.py``), the engine holds at most --max-cpu-loras adapters in host
memory (``models/lora/arena.py``), and no lock is held while files are read.

Nothing here imports a kernel module at import time (server/launch/settings.py imports it before
``device.process.configure()``): the models' LoRA modules are imported where used.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import stat
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


def parse_lora_root(text: str) -> tuple[str, ...]:
    """One --allowed-lora-root value: a directory, or several joined by ``os.pathsep`` (the
    environment variable's form, as PATH)."""
    return tuple(p for p in text.split(os.pathsep) if p)


def _flat(value) -> list[str]:
    """--allowed-lora-root as parsed (a tuple, or argparse's list of tuples) -> directories."""
    if isinstance(value, str):
        return list(parse_lora_root(value))
    return [p for item in value or () for p in ([item] if isinstance(item, str) else item)]


def lora_roots(settings) -> list[str]:
    """The real paths of the directories a runtime load may read from: --allowed-lora-root,
    else the directories holding the --lora-modules adapters."""
    given = _flat(settings.allowed_lora_root) or [
        os.path.dirname(os.path.abspath(p)) for p in lora_modules(settings.lora_modules).values()]
    return sorted({os.path.realpath(p) for p in given})


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")   # PEFT's (models/lora/adapter.py)


def _under(real: str, roots: list[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def runtime_path(path: str, roots: list[str]) -> str | None:
    """The real path of the adapter directory a runtime load names, if it may be read: an
    absolute path whose real path, and its two files' real paths, lie under one of ``roots``,
    the files regular ones; None otherwise, whatever the reason, so that a refusal tells
    nothing of what exists. (Nothing here opens a file: a FIFO is never waited on.)"""
    if not path or not os.path.isabs(path) or "\0" in path:
        return None
    real = os.path.realpath(path)
    if not _under(real, roots):
        return None
    for name in ADAPTER_FILES:
        file = os.path.realpath(os.path.join(real, name))
        try:
            if not _under(file, roots) or not stat.S_ISREG(os.stat(file).st_mode):
                return None
        except OSError:
            return None
    return real


def refused_path(path: str) -> str:
    """The one message of every runtime path refused."""
    return (f"lora_path {path[:200]!r} names no adapter this server may load: give the absolute path of a PEFT "
            f"adapter's directory ({' and '.join(ADAPTER_FILES)}) under the directories it allows "
            "(--allowed-lora-root)")


def check_lora_settings(s) -> None:
    """Start-up refusals (ValueError naming the flags) of what LoRA cannot combine with."""
    modules = lora_modules(s.lora_modules)
    if not s.enable_lora:
        if modules or s.allow_runtime_lora or _flat(s.allowed_lora_root) or s.max_cpu_loras is not None:
            raise ValueError("--lora-modules, --max-cpu-loras, --allow-runtime-lora and --allowed-lora-root "
                             "need --enable-lora")
        return
    if s.max_loras < 1 or s.max_lora_rank < 1:
        raise ValueError(f"--max-loras {s.max_loras} and --max-lora-rank {s.max_lora_rank} must "
                         "be positive")
    if s.max_cpu_loras is not None and s.max_cpu_loras < s.max_loras:
        raise ValueError(f"--max-cpu-loras {s.max_cpu_loras} must be at least --max-loras {s.max_loras} "
                         "(vLLM's rule: every slot's adapter is also held in host memory)")
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
    if s.allow_runtime_lora and not lora_roots(s):
        raise ValueError("--allow-runtime-lora loads adapters only from allowed directories: give "
                         "--allowed-lora-root DIR (or --lora-modules, whose directories are then allowed)")
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
    """Load ("load", name, path: a real path ``runtime_path`` allowed) or unload ("unload",
    name) an adapter in the runner's arena: None, or (HTTP status, why) when refused (400: bad
    files or rank, 404: unknown name). The files are read before the lock is taken (a slow or
    stuck read held every other load and unload back: issue 38), the name checked again under it."""
    from spyre_serve.models import LoraError, read_adapter

    arena = getattr(runner, "lora", None)
    if arena is None:
        return 400, "LoRA is not enabled on this server (start it with --enable-lora)"
    if op == "unload":
        with _UPDATES:
            if name not in arena.registered():
                return 404, f"The lora adapter '{name}' cannot be found."
            arena.unregister(name)
    else:
        if name in arena.registered():
            return 400, f"The lora adapter '{name}' has already been loaded."
        try:
            adapter = read_adapter(path, runner.config, arena.max_rank)
        except LoraError as exc:
            return 400, str(exc)
        with _UPDATES:
            if name in arena.registered():
                return 400, f"The lora adapter '{name}' has already been loaded."
            arena.register(name, adapter)
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
