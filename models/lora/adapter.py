"""A PEFT LoRA adapter read from its directory: adapter_config.json + adapter_model.safetensors.

    adapter = read_adapter(path, config, max_rank)     # LoraError (a ValueError) naming the problem
    adapter.rank, adapter.scaling                      # scaling: alpha / r, or alpha / sqrt(r) (rsLoRA)
    adapter.weights[(layer, "q_proj")]                 # (A float32[r, K], B.T float32[r, N])

What is served: LoRA on q/k/v/o/gate/up/down_proj of the decoder layers (PEFT's
`target_modules`, a list, "all-linear" or a regular expression, matched in linear time by
`target_pattern.py`), bias "none", no DoRA, no `modules_to_save`, one rank and alpha for every
module. Anything else is refused with what it is, as is a rank over `max_rank`
(`LoraError.rank_over` is then set) and a tensor whose shape does not match the base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spyre_serve.models.checkpoints.hf import CheckpointError, _map_file, open_regular, widen_stored
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.lora.layout import MODULES, module_dims
from spyre_serve.models.lora.target_pattern import PATTERN_FEATURES, PatternError, TargetPattern

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT writes a config of 1-2 KB; one listing every module of an 80-layer model by its path is
# some 30 KB. Larger is refused unread (a runtime load may name any file: issue 38).
MAX_CONFIG_BYTES = 256 << 10
MAX_HEADER_BYTES = 1 << 20   # a safetensors header of ~150 bytes a tensor, 14 tensors a layer
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoraError(ValueError):
    """An adapter this server cannot serve; the message names the file and the problem."""

    def __init__(self, message: str, rank_over: bool = False):
        super().__init__(message)
        self.rank_over = rank_over


@dataclass(slots=True)
class LoraAdapter:
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]             # of MODULES
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def _json(path: Path) -> dict:
    try:
        f, _ = open_regular(path, MAX_CONFIG_BYTES)
        with f:
            cfg = json.loads(f.read())
    except FileNotFoundError as e:
        raise LoraError(f"{path}: no such file (a PEFT LoRA adapter has {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})") from e
    except CheckpointError as e:
        raise LoraError(str(e)) from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{path}: not a JSON file: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: not a JSON object")
    return cfg


def max_weights_bytes(config: GraniteConfig, max_rank: int) -> int:
    """The largest adapter_model.safetensors of an adapter of ``config``'s model served at
    ``max_rank``: rank ``max_rank`` on every module of every layer, in float32, and a header of
    ``MAX_HEADER_BYTES``. A larger file is no adapter this server serves: refused unread."""
    c = config
    dims = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
            c.intermediate_size)
    per_rank = sum(sum(module_dims(m, *dims)) for m in range(len(MODULES)))
    return 8 + MAX_HEADER_BYTES + 4 * max_rank * c.num_hidden_layers * per_rank


def _targets(value, where: Path) -> tuple[str, ...]:
    """PEFT's target_modules as names of MODULES (a regex is matched against module paths)."""
    if value == "all-linear":
        return MODULES
    if isinstance(value, str):
        try:   # matched in linear time: the file may be a client's, and re backtracks (issue 38)
            pattern = TargetPattern(value)
        except PatternError as e:
            raise LoraError(f"{where}: target_modules {value[:80]!r} is refused: {e} (a regular expression "
                            f"here may use what PEFT configs do: {PATTERN_FEATURES})") from None
        names = {m for m in MODULES for i in range(2)
                 if pattern.fullmatch(f"model.layers.{i}.{_PARENT[m]}.{m}")}
        if not names:
            raise LoraError(f"{where}: target_modules {value[:80]!r} matches none of {', '.join(MODULES)}")
        return tuple(m for m in MODULES if m in names)
    if not isinstance(value, list) or not value:
        raise LoraError(f"{where}: target_modules must be a list of module names, got {value!r}")
    names = [str(v).rsplit(".", 1)[-1] for v in value]
    other = sorted(set(names) - set(MODULES))
    if other:
        raise LoraError(f"{where}: target modules {other} are not supported "
                        f"(supported: {', '.join(MODULES)})")
    return tuple(m for m in MODULES if m in names)


def read_config(path: Path, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, targets) of an adapter directory's adapter_config.json."""
    where = path / CONFIG_FILE
    cfg = _json(where)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA is served")
    if cfg.get("use_dora"):
        raise LoraError(f"{where}: use_dora is set; DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg.get('bias')!r}; only bias \"none\" is supported")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise LoraError(f"{where}: {key} is not supported (one rank and alpha for every module)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if r > max_rank:
        raise LoraError(f"{path}: LoRA rank {r} is greater than max_lora_rank {max_rank}",
                        rank_over=True)
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling), _targets(cfg.get("target_modules"), where)


def read_adapter(path: str | Path, config: GraniteConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path`, checked against the base model's `config` and `max_rank`."""
    path = Path(path)
    if not path.is_dir():
        raise LoraError(f"{path}: not a directory (a PEFT LoRA adapter is a directory with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    rank, scaling, targets = read_config(path, max_rank)
    file = path / WEIGHTS_FILE
    limit, what = max_weights_bytes(config, max_rank), f" for an adapter of rank {max_rank} of this model"
    try:
        tensors = _map_file(file, limit, what)
    except FileNotFoundError as e:
        raise LoraError(f"{file}: no such file (adapter weights in safetensors are needed)") from e
    except CheckpointError as e:      # each names the file and what is wrong with it
        raise LoraError(str(e)) from None
    except (OSError, KeyError, ValueError) as e:
        raise LoraError(f"{file}: not a readable safetensors file: {e}") from e
    adapter = LoraAdapter(path=path, rank=rank, scaling=scaling, targets=targets)
    c = config
    dims = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
            c.intermediate_size)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, (code, stored) in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None or m.group(3) not in MODULES or _PARENT[m.group(3)] != m.group(2):
            raise LoraError(f"{file}: tensor {name!r} is not a LoRA weight of "
                            f"{', '.join(MODULES)} in a decoder layer")
        layer, module = int(m.group(1)), m.group(3)
        if layer >= c.num_hidden_layers or module not in targets:
            raise LoraError(f"{file}: tensor {name!r}: layer {layer} of {c.num_hidden_layers}, "
                            f"targets {list(targets)}")
        parts.setdefault((layer, module), {})[m.group(4)] = widen_stored(code, stored)
    for (layer, module), ab in sorted(parts.items()):
        k, n = module_dims(MODULES.index(module), *dims)
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.shape != (rank, k) or b.shape != (n, rank):
            got = [None if t is None else list(t.shape) for t in (a, b)]
            raise LoraError(f"{file}: layer {layer} {module}: lora_A must be [{rank}, {k}] and "
                            f"lora_B [{n}, {rank}] for this model (r={rank}), got {got}")
        adapter.weights[(layer, module)] = (np.ascontiguousarray(a, np.float32),      # as the arena's
                                            np.ascontiguousarray(b.T, np.float32))    # slots hold them
    if not adapter.weights:
        raise LoraError(f"{file}: holds no LoRA weights")
    return adapter
