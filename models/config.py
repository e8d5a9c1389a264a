"""GraniteConfig: the model shape and multipliers, read from a Hugging Face config.json.

Five architectures are accepted: ``GraniteForCausalLM``, ``LlamaForCausalLM``, Granite 4.0's
hybrid ``GraniteMoeHybridForCausalLM`` and Granite 3.x's mixtures of experts
``GraniteMoeForCausalLM`` (experts only) and ``GraniteMoeSharedForCausalLM`` (experts beside a
shared MLP), which are the hybrid's layers with attention (RoPE) everywhere. A Llama model is a
Granite model with the four multipliers neutral: embedding 1, attention 1/sqrt(head_dim),
residual 1, logits scaling 1.
A hybrid model (transformers' GraniteMoeHybridConfig) has Granite's multipliers and, layer by
layer, a Mamba-2 mixer (``layer_kinds[i] == "mamba"``: its shape in ``mamba``) or attention
(with RoPE, or none: ``rope`` False for ``position_embedding_type: "nope"``), then a dense
MLP of ``intermediate_size`` (its ``shared_intermediate_size``) beside a mixture of
``num_experts`` experts of ``expert_intermediate_size`` when it has them.
Anything the model code does not implement is refused, naming the field and its value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCHITECTURES = {"GraniteForCausalLM": "granite", "LlamaForCausalLM": "llama",
                 "GraniteMoeHybridForCausalLM": "granitemoehybrid", "GraniteMoeForCausalLM": "granitemoe",
                 "GraniteMoeSharedForCausalLM": "granitemoeshared"}
HYBRID = "GraniteMoeHybridForCausalLM"
MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")      # Granite 3.x's mixtures of experts
# a layer's mixer as published configs name it (layers_block_type) and as transformers 5 does
# (layer_types)
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
               "full_attention": "attention"}
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config.json this server cannot run."""


@dataclass(frozen=True, slots=True)
class MambaShape:
    """A Mamba-2 mixer's shape (transformers' mamba_* fields)."""

    n_heads: int          # NH
    head_dim: int         # P: NH * P is the mixer's inner width (mamba_expand * hidden_size)
    d_state: int          # N
    n_groups: int         # G: heads share B and C by group
    d_conv: int           # K: the causal conv's width
    conv_bias: bool
    dt_min: float         # time_step_limit: dt clamped to [dt_min, dt_max]
    dt_max: float
    chunk_size: int       # transformers' SSD chunk (the scan here is token by token)

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def proj(self) -> int:
        """in_proj's outputs: gate z, x B C, dt."""
        return self.d_inner + self.conv_dim + self.n_heads

    @property
    def conv_state(self) -> tuple[int, int]:
        """A sequence's conv state: its last K - 1 inputs of every channel."""
        return self.d_conv - 1, self.conv_dim

    @property
    def ssm_state(self) -> tuple[int, int, int]:
        """A sequence's SSM state: [heads, head dim, state size]."""
        return self.n_heads, self.head_dim, self.d_state

    @property
    def state_values(self) -> int:
        """float32 values of one sequence's two states in one layer."""
        return int(np.prod(self.conv_state)) + int(np.prod(self.ssm_state))


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
    # Granite 4.0's hybrid models (the defaults: every layer attention with RoPE, a dense MLP)
    layer_kinds: tuple[str, ...] = ()    # per layer "attention" or "mamba" (empty: all attention)
    rope: bool = True                    # False: attention without position embedding ("nope")
    mamba: MambaShape | None = None
    num_experts: int = 0                 # E experts beside the dense MLP (0: none)
    num_experts_per_tok: int = 0         # k of them per token
    expert_intermediate_size: int = 0    # each expert's SwiGLU width
    dense_mlp: bool = True               # the dense MLP (GraniteMoeForCausalLM has experts only)

    @property
    def is_hybrid(self) -> bool:
        return self.architecture == HYBRID

    @property
    def mlp_names(self) -> str:
        """How the checkpoint names the dense MLP: "mlp" (gate_proj, up_proj, down_proj),
        "shared_mlp" (input_linear gate and up fused, output_linear) or "" (none)."""
        if not self.dense_mlp:
            return ""
        return "shared_mlp" if self.architecture in (HYBRID, *MOE) else "mlp"

    def kind_of(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "attention"

    @property
    def attention_layers(self) -> list[int]:
        """The layers with attention (and a KV cache)."""
        return [i for i in range(self.num_hidden_layers) if self.kind_of(i) == "attention"]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.kind_of(i) == "mamba"]

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
        if arch != "LlamaForCausalLM":            # Granite's four multipliers
            d.update({"embedding_multiplier": self.embedding_multiplier,
                      "attention_multiplier": self.attention_multiplier,
                      "residual_multiplier": self.residual_multiplier, "logits_scaling": self.logits_scaling})
        if arch == "GraniteForCausalLM":
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ConfigError(
                    f"GraniteForCausalLM has no head_dim field: head_dim {self.head_dim} "
                    f"x num_attention_heads {self.num_attention_heads} must equal "
                    f"hidden_size {self.hidden_size}")
        elif arch in MOE:
            d.update({
                "intermediate_size": self.expert_intermediate_size, "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                **({"shared_intermediate_size": self.intermediate_size} if self.dense_mlp else {})})
        elif arch == HYBRID:
            m = self.mamba
            kinds = [self.kind_of(i) for i in range(self.num_hidden_layers)]
            d.update({
                "layer_types": ["linear_attention" if k == "mamba" else "full_attention" for k in kinds],
                "position_embedding_type": "rope" if self.rope else "nope",
                "shared_intermediate_size": self.intermediate_size,
                "intermediate_size": self.expert_intermediate_size or self.intermediate_size,
                "num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            })
            if m is not None:
                d.update({"mamba_n_heads": m.n_heads, "mamba_d_head": m.head_dim, "mamba_d_state": m.d_state,
                          "mamba_n_groups": m.n_groups, "mamba_d_conv": m.d_conv, "mamba_conv_bias": m.conv_bias,
                          "mamba_expand": m.d_inner / self.hidden_size, "mamba_chunk_size": m.chunk_size,
                          "mamba_proj_bias": False, "time_step_limit": [m.dt_min, m.dt_max]})
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

    if arch in ("GraniteForCausalLM", HYBRID, *MOE):
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

    hybrid = (_hybrid_fields(d, hidden, layers) if arch == HYBRID
              else _moe_fields(d, arch) if arch in MOE else {})
    if hybrid:
        inter = hybrid.pop("intermediate_size")

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
        pad_token_id=_token_id(d, "pad_token_id"), torch_dtype=dtype, **mults, **hybrid)


def _number(v, key: str) -> float:
    """A number of config.json, or transformers 5's {"__float__": "Infinity"} spelling of one."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    try:
        out = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"config field {key!r} holds {v!r}, not a number") from None
    if math.isnan(out):
        raise ConfigError(f"config field {key!r} is NaN")
    return out


def _experts(d: dict, required: bool) -> tuple[int, int]:
    """(num_local_experts, num_experts_per_tok), checked; (0, 0) for none where none is allowed."""
    experts = _positive_int(d, "num_local_experts") if required else int(d.get("num_local_experts") or 0)
    if experts < 0:
        raise ConfigError(f"config field 'num_local_experts' must be >= 0, got {experts}")
    top_k = _positive_int(d, "num_experts_per_tok") if experts else 0
    if top_k > experts:
        raise ConfigError(f"config field 'num_experts_per_tok' ({top_k}) is over num_local_experts ({experts})")
    return experts, top_k


def _moe_fields(d: dict, arch: str) -> dict:
    """A Granite 3.x MoE config's experts (and, GraniteMoeShared's, the shared MLP's width)."""
    experts, top_k = _experts(d, required=True)
    inter = _positive_int(d, "intermediate_size")
    shared = arch == "GraniteMoeSharedForCausalLM" and bool(d.get("shared_intermediate_size"))
    return {"num_experts": experts, "num_experts_per_tok": top_k, "expert_intermediate_size": inter,
            "dense_mlp": shared,
            # the dense MLP's width (GraniteMoe's has none: the experts' width sizes its unused buffers)
            "intermediate_size": _positive_int(d, "shared_intermediate_size") if shared else inter}


def _hybrid_fields(d: dict, hidden: int, layers: int) -> dict:
    """A GraniteMoeHybridConfig's own fields (see the module docstring), checked."""
    kinds_raw = d.get("layer_types", d.get("layers_block_type"))
    if not isinstance(kinds_raw, list) or len(kinds_raw) != layers:
        raise ConfigError(f"config field 'layer_types' must list one mixer per layer ({layers}), "
                          f"got {kinds_raw!r}")
    bad = [k for k in kinds_raw if k not in LAYER_KINDS]
    if bad:
        raise ConfigError(f"config field 'layer_types' holds {bad[0]!r}; supported: {sorted(LAYER_KINDS)}")
    kinds = tuple(LAYER_KINDS[k] for k in kinds_raw)
    pe = d.get("position_embedding_type") or "rope"
    if pe not in ("rope", "nope"):
        raise ConfigError(f"config field 'position_embedding_type' is {pe!r}; supported: 'rope', 'nope'")
    if d.get("mamba_proj_bias"):
        raise ConfigError("config field 'mamba_proj_bias' is True; supported: False")
    experts, top_k = _experts(d, required=False)
    out: dict = {"layer_kinds": kinds, "rope": pe == "rope", "num_experts": experts, "num_experts_per_tok": top_k,
                 "expert_intermediate_size": _positive_int(d, "intermediate_size") if experts else 0,
                 "intermediate_size": _positive_int(d, "shared_intermediate_size")}
    if "mamba" in kinds:
        heads, head_dim = _positive_int(d, "mamba_n_heads"), _positive_int(d, "mamba_d_head")
        groups, state = _positive_int(d, "mamba_n_groups"), _positive_int(d, "mamba_d_state")
        expand = _number(d.get("mamba_expand", 2), "mamba_expand")
        if heads * head_dim != expand * hidden:
            raise ConfigError(f"config fields mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must be "
                              f"mamba_expand ({expand}) x hidden_size ({hidden})")
        if heads % groups:
            raise ConfigError(f"config field 'mamba_n_groups' ({groups}) must divide mamba_n_heads ({heads})")
        limit = d.get("time_step_limit") or [0.0, math.inf]
        if not isinstance(limit, list | tuple) or len(limit) != 2:
            raise ConfigError(f"config field 'time_step_limit' must be [min, max], got {limit!r}")
        lo, hi = (_number(v, "time_step_limit") for v in limit)
        if not 0 <= lo <= hi:
            raise ConfigError(f"config field 'time_step_limit' must be 0 <= min <= max, got {limit!r}")
        out["mamba"] = MambaShape(n_heads=heads, head_dim=head_dim, d_state=state, n_groups=groups,
                                  d_conv=_positive_int(d, "mamba_d_conv"),
                                  conv_bias=bool(d.get("mamba_conv_bias", True)),
                                  dt_min=lo, dt_max=hi, chunk_size=int(d.get("mamba_chunk_size") or 256))
    return out
