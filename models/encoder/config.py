"""EncoderConfig: a RoBERTa-family encoder (IBM's granite-embedding models), read from config.json,
and the pooling its sentence-transformers files ask for.

Architectures: ``RobertaModel`` and ``XLMRobertaModel`` (the same network: learned absolute
positions with RoBERTa's offset, post-LayerNorm blocks with biases, erf GELU), and their
``*ForMaskedLM`` checkpoints, whose encoder is the same under a ``roberta.`` prefix (the MLM
head is not read). Anything the encoder step does not implement is refused with a ConfigError
naming the field and its value.

    cfg = EncoderConfig.from_file(path)      # path: a checkpoint directory or its config.json
    cfg.max_model_len                        # max_position_embeddings - pad_token_id - 1
    is_encoder_config(path)                  # config.json names one of ARCHITECTURES
    pooler_defaults(path)                    # ("CLS" | "MEAN" | "LAST", normalize)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from spyre_serve.models.config import DTYPES, ConfigError

ARCHITECTURES = {"RobertaModel": "roberta", "XLMRobertaModel": "xlm-roberta",
                 "RobertaForMaskedLM": "roberta", "XLMRobertaForMaskedLM": "xlm-roberta"}
# vLLM's RobertaEmbeddingModel (vllm/model_executor/models/roberta.py, the class that serves
# RobertaModel and XLMRobertaModel) is decorated @default_pooling_type("CLS"), and its embed
# pooler normalizes by default (Pooler.for_embed): CLS pooling, unit length, unless the
# checkpoint's sentence-transformers files say otherwise.
DEFAULT_POOLING = ("CLS", True)
# sentence-transformers' Pooling config keys -> the pooling types device/kernels/pooling.py has
_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                  "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
_ST_POOLING = "sentence_transformers.models.Pooling"


@dataclass(slots=True)
class EncoderConfig:
    architecture: str            # one of ARCHITECTURES
    vocab_size: int              # V
    hidden_size: int             # H
    num_hidden_layers: int
    num_attention_heads: int     # Hq (no grouped KV heads)
    intermediate_size: int       # I (GELU MLP)
    max_position_embeddings: int
    type_vocab_size: int         # token types (only type 0 is added)
    layer_norm_eps: float
    pad_token_id: int            # RoBERTa's positions start at pad_token_id + 1
    bos_token_id: int | None
    eos_token_id: list[int]      # always a list
    torch_dtype: str             # dtype the checkpoint declares: float32, bfloat16, float16

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """Every head has its own K and V (what the server's start-up log prints)."""
        return self.num_attention_heads

    @property
    def max_model_len(self) -> int:
        """Tokens a prompt may have: position ids run pad+1 .. max_position_embeddings-1
        (RoBERTa's 514 positions hold 512 tokens)."""
        return self.max_position_embeddings - self.pad_token_id - 1

    @classmethod
    def from_file(cls, path: str | Path) -> EncoderConfig:
        """Read ``path`` (a config.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        d = _read_json(path, "config.json")
        try:
            return parse_encoder_config(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e


def _read_json(path: Path, what: str):
    if not path.is_file():
        raise ConfigError(f"no {what} at {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e


def _int(d: dict, key: str, low: int = 1, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"config field {key!r} must be an integer >= {low}, got {v!r}")
    return v


def _token_ids(d: dict, key: str, vocab: int) -> list[int]:
    v = d.get(key)
    ids = [] if v is None else v if isinstance(v, list) else [v]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ConfigError(f"config field {key!r} holds {t!r}, not a token id in 0..{vocab - 1}")
    return list(ids)


def parse_encoder_config(d: dict) -> EncoderConfig:
    """The EncoderConfig of a config.json's object; ConfigError naming what it cannot run."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    archs, mt = d.get("architectures"), d.get("model_type")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if arch not in ARCHITECTURES:
        raise ConfigError(f"config field 'architectures' is {archs!r}; supported: one of "
                          f"{sorted(ARCHITECTURES)}")
    if mt not in (None, ARCHITECTURES[arch]):
        raise ConfigError(f"config field 'model_type' is {mt!r} but architecture {arch} needs "
                          f"{ARCHITECTURES[arch]!r}")
    refused = {                          # field: (what the step implements, its default)
        "hidden_act": (("gelu",), "gelu"),
        "position_embedding_type": (("absolute",), "absolute"),
        "is_decoder": ((False,), False),
        "add_cross_attention": ((False,), False),
    }
    for key, (allowed, default) in refused.items():
        if d.get(key, default) not in allowed:
            raise ConfigError(f"config field {key!r} is {d[key]!r}; supported: {allowed[0]!r}")

    vocab = _int(d, "vocab_size")
    hidden = _int(d, "hidden_size")
    heads = _int(d, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"config field 'hidden_size' ({hidden}) is not divisible by "
                          f"'num_attention_heads' ({heads})")
    max_pos = _int(d, "max_position_embeddings")
    pad = d.get("pad_token_id")
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab:
        raise ConfigError(f"config field 'pad_token_id' is {pad!r}; RoBERTa's positions start "
                          f"after it, so it must be a token id in 0..{vocab - 1}")
    if max_pos - pad - 1 < 1:
        raise ConfigError(f"config field 'max_position_embeddings' ({max_pos}) leaves no position "
                          f"after pad_token_id {pad} (positions start at pad_token_id + 1)")
    eps = d.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps)
                                                                         and eps > 0):
        raise ConfigError(f"config field 'layer_norm_eps' must be a positive number, got {eps!r}")
    dtype = d.get("torch_dtype", d.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"config field 'torch_dtype' is {dtype!r}; supported: {list(DTYPES)}")
    bos = _token_ids(d, "bos_token_id", vocab)
    return EncoderConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        num_hidden_layers=_int(d, "num_hidden_layers"), num_attention_heads=heads,
        intermediate_size=_int(d, "intermediate_size"), max_position_embeddings=max_pos,
        type_vocab_size=_int(d, "type_vocab_size", default=1), layer_norm_eps=float(eps),
        pad_token_id=pad, bos_token_id=bos[0] if bos else None,
        eos_token_id=_token_ids(d, "eos_token_id", vocab), torch_dtype=dtype)


def is_encoder_config(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory whose config.json names an encoder
    architecture (anything unreadable: False, for the decoder loader to explain)."""
    f = Path(path) / "config.json"
    try:
        archs = json.loads(f.read_text()).get("architectures") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES


def pooler_defaults(path: str | Path) -> tuple[str, bool]:
    """(pooling type, normalize) of the checkpoint at ``path``: its sentence-transformers
    Pooling module's mode when modules.json lists one (pooling_mode_cls_token: "CLS",
    pooling_mode_mean_tokens: "MEAN", pooling_mode_lasttoken: "LAST"), else DEFAULT_POOLING;
    normalize is always True (vLLM's embed default). ConfigError for a mode the card does
    not pool by (max, mean_sqrt_len, weightedmean) or for several at once."""
    path = Path(path)
    if not (path / "modules.json").is_file():
        return DEFAULT_POOLING
    modules = _read_json(path / "modules.json", "modules.json")
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING] \
        if isinstance(modules, list) else []
    if not pooling:
        return DEFAULT_POOLING
    where = path / str(pooling[0].get("path", "")) / "config.json"
    conf = _read_json(where, "sentence-transformers Pooling config")
    on = [k for k in (*_POOLING_MODES, *_UNSUPPORTED_MODES) if conf.get(k)]
    if len(on) != 1 or on[0] in _UNSUPPORTED_MODES:
        raise ConfigError(f"{where}: pooling modes {on or 'none'} are set; supported: exactly one "
                          f"of {list(_POOLING_MODES)}")
    return _POOLING_MODES[on[0]], DEFAULT_POOLING[1]
