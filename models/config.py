"""GraniteConfig: the model shape and multipliers, read from a Hugging Face config.json.

Two architectures are accepted: ``GraniteForCausalLM`` and ``LlamaForCausalLM``.
A Llama model is a Granite model with the four multipliers neutral:
embedding 1, attention 1/sqrt(head_dim), residual 1, logits scaling 1.
Anything the model code does not implement is refused, naming the field and its value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = {"GraniteForCausalLM": "granite", "LlamaForCausalLM": "llama"}
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config.json this server cannot run."""


@dataclass(slots=True)
class GraniteConfig:
    architecture: str            # "GraniteForCausalLM" or "LlamaForCausalLM"
    vocab_size: int              # V
    hidden_size: int             # H
    intermediate_size: int       # I (SwiGLU)
    num_hidden_layers: int
    num_attention_heads: int     # Hq
    num_key_value_heads: int     # Hkv, divides Hq
    head_dim: int                # D
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    embedding_multiplier: float  # embeddings x this
    attention_multiplier: float  # softmax scale of q.k
    residual_multiplier: float   # each residual branch x this
    logits_scaling: float        # logits / this
    bos_token_id: int | None
    eos_token_id: list[int]      # always a list: config.json's, then generation_config.json's
    pad_token_id: int | None
    torch_dtype: str             # dtype the checkpoint declares: float32, bfloat16, float16

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict) -> GraniteConfig:
        return _parse(d)

    @classmethod
    def from_file(cls, path: str | Path) -> GraniteConfig:
        """Read ``path`` (a config.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
        try:
            config = _parse(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
        config.eos_token_id = _with_generation_eos(config, path.parent / "generation_config.json")
        return config

    def to_dict(self) -> dict:
        """A Hugging Face config.json for this model (readable by transformers 5.x)."""
        arch = self.architecture
        d = {
            "architectures": [arch],
            "model_type": ARCHITECTURES[arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }
        if arch == "GraniteForCausalLM":
            d["embedding_multiplier"] = self.embedding_multiplier
            d["attention_multiplier"] = self.attention_multiplier
            d["residual_multiplier"] = self.residual_multiplier
            d["logits_scaling"] = self.logits_scaling
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ConfigError(
                    f"GraniteForCausalLM has no head_dim field: head_dim {self.head_dim} "
                    f"x num_attention_heads {self.num_attention_heads} must equal "
                    f"hidden_size {self.hidden_size}")
        else:
            d["head_dim"] = self.head_dim
        return d


def _with_generation_eos(config: GraniteConfig, path: Path) -> list[int]:
    """config.json's eos ids plus those of generation_config.json beside it, when there is
    one: what `generate` stops on (Llama 3 instruct lists its end-of-turn id only there)."""
    if not path.is_file():
        return config.eos_token_id
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    eos = d.get("eos_token_id") if isinstance(d, dict) else None
    extra = [] if eos is None else eos if isinstance(eos, list) else [eos]
    ids = list(config.eos_token_id)
    for e in extra:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < config.vocab_size:
            raise ConfigError(f"{path}: field 'eos_token_id' holds {e!r}, not a token id in "
                              f"0..{config.vocab_size - 1}")
        if e not in ids:
            ids.append(e)
    return ids


def _require(d: dict, key: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"config field {key!r} is missing")
    return d[key]


def _positive_int(d: dict, key: str) -> int:
    v = _require(d, key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _rope_theta(d: dict) -> float:
    """transformers 5.x nests rope settings in ``rope_parameters``; 4.x has top-level
    ``rope_theta`` and ``rope_scaling``. Read both; refuse any scaling."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; "
                          "only 'default' (no scaling) is supported")
    scaling = d.get("rope_scaling")
    if scaling is not None:
        st = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if st != "default":
            raise ConfigError(f"config field 'rope_scaling' is {scaling!r}; "
                              "only no scaling is supported")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if "rope_theta" in params and "rope_theta" in d and float(params["rope_theta"]) != float(d["rope_theta"]):
        raise ConfigError(f"config fields 'rope_theta' ({d['rope_theta']!r}) and "
                          f"'rope_parameters.rope_theta' ({params['rope_theta']!r}) disagree")
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"config field 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def _token_id(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    raise ConfigError(f"config field {key!r} must be a non-negative integer or null, got {v!r}")


def _parse(d: dict) -> GraniteConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    archs = d.get("architectures")
    if archs is None:
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        mt = d.get("model_type")
        if mt not in by_type:
            raise ConfigError(f"config field 'model_type' is {mt!r} and 'architectures' is missing; "
                              f"supported: {sorted(ARCHITECTURES)}")
        archs = [by_type[mt]]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(f"config field 'architectures' is {archs!r}; "
                          f"supported: one of {sorted(ARCHITECTURES)}")
    arch = archs[0]
    mt = d.get("model_type")
    if mt is not None and mt != ARCHITECTURES[arch]:
        raise ConfigError(f"config field 'model_type' is {mt!r} but architecture {arch} "
                          f"needs {ARCHITECTURES[arch]!r}")

    # Options the model code does not implement.
    refused = {
        "hidden_act": ("silu",),
        "attention_bias": (False, None),
        "mlp_bias": (False, None),
        "pretraining_tp": (1, None),
    }
    for key, allowed in refused.items():
        if key in d and d[key] not in allowed:
            raise ConfigError(f"config field {key!r} is {d[key]!r}; supported: {allowed[0]!r}")

    vocab = _positive_int(d, "vocab_size")
    hidden = _positive_int(d, "hidden_size")
    inter = _positive_int(d, "intermediate_size")
    layers = _positive_int(d, "num_hidden_layers")
    heads = _positive_int(d, "num_attention_heads")
    kv_heads = d.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _positive_int(d, "num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(f"config field 'num_key_value_heads' ({kv_heads}) must divide "
                          f"'num_attention_heads' ({heads})")
    if d.get("head_dim") is not None:
        head_dim = _positive_int(d, "head_dim")
    else:
        if hidden % heads:
            raise ConfigError(f"config field 'hidden_size' ({hidden}) is not divisible by "
                              f"'num_attention_heads' ({heads}) and 'head_dim' is missing")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"head_dim {head_dim} must be even for rotary embeddings")
    if arch == "GraniteForCausalLM" and head_dim * heads != hidden:
        raise ConfigError(f"config field 'head_dim' ({head_dim}) x num_attention_heads ({heads}) "
                          f"!= hidden_size ({hidden}); GraniteForCausalLM requires equality")

    max_pos = _positive_int(d, "max_position_embeddings")
    eps = float(d.get("rms_norm_eps", 1e-6))
    if not eps > 0:
        raise ConfigError(f"config field 'rms_norm_eps' must be > 0, got {d.get('rms_norm_eps')!r}")
    theta = _rope_theta(d)

    if arch == "GraniteForCausalLM":
        mults = {k: float(d.get(k, 1.0)) for k in
                 ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                  "logits_scaling")}
        for k, v in mults.items():
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"config field {k!r} must be a positive number, got {d.get(k)!r}")
    else:
        for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                  "logits_scaling"):
            if k in d:
                raise ConfigError(f"config field {k!r} ({d[k]!r}) is not part of LlamaForCausalLM")
        mults = {"embedding_multiplier": 1.0, "attention_multiplier": 1.0 / math.sqrt(head_dim),
                 "residual_multiplier": 1.0, "logits_scaling": 1.0}

    dtype = d.get("torch_dtype", d.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"config field 'torch_dtype' is {dtype!r}; supported: {list(DTYPES)}")

    eos = d.get("eos_token_id")
    if eos is None:
        eos_list: list[int] = []
    elif isinstance(eos, list):
        eos_list = [_token_id({"eos_token_id": e}, "eos_token_id") for e in eos]
    else:
        eos_list = [_token_id(d, "eos_token_id")]
    for key in ("bos_token_id", "pad_token_id"):
        tid = _token_id(d, key)
        if tid is not None and tid >= vocab:
            raise ConfigError(f"config field {key!r} ({tid}) is outside vocab_size {vocab}")
    for e in eos_list:
        if e >= vocab:
            raise ConfigError(f"config field 'eos_token_id' ({e}) is outside vocab_size {vocab}")

    return GraniteConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_pos, rms_norm_eps=eps, rope_theta=theta,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=_token_id(d, "bos_token_id"), eos_token_id=eos_list,
        pad_token_id=_token_id(d, "pad_token_id"), torch_dtype=dtype, **mults)
