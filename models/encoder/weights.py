"""An encoder checkpoint (RoBERTa / XLM-RoBERTa, safetensors) read and placed on the card once.

Tensor names are transformers' RobertaModel names, with or without the ``roberta.`` prefix of
a ``*ForMaskedLM`` checkpoint: embeddings.{word,position,token_type}_embeddings,
embeddings.LayerNorm, and per layer encoder.layer.{i}.attention.self.{query,key,value},
attention.output.dense, attention.output.LayerNorm, intermediate.dense, output.dense,
output.LayerNorm (each a weight and a bias). The pooler head (``pooler.dense``: not part of a
sentence-transformers embedding) and an MLM head (``lm_head.*``) are not read.

Every projection is a GEMM weight W[K, N] in the card's panel layout (models/step/weights.py's
`_Placer`, as a decoder's), Q, K and V fused into one W[H, 3H]; biases, LayerNorms and the
embedding tables stay float32 rows (the tables gathered by row, only token type 0 kept).
`dtype` is the width of the GEMM weights ("float32" by default: the encoder computes in
float32; a 16-bit width is widened in the GEMM's registers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.device.layout import GemmWeight
from spyre_serve.models.checkpoints.hf import (
    CheckpointError,
    _map_file,
    check_shapes,
    checkpoint_files,
    stored_width,
    widen_stored,
)
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from spyre_serve.models.encoder.config import EncoderConfig
from spyre_serve.models.encoder.program import (
    COL_DOWN,
    COL_DOWN_B,
    COL_DOWN_FMT,
    COL_LN1_B,
    COL_LN1_W,
    COL_LN2_B,
    COL_LN2_W,
    COL_O,
    COL_O_B,
    COL_O_FMT,
    COL_QKV,
    COL_QKV_B,
    COL_QKV_FMT,
    COL_UP,
    COL_UP_B,
    COL_UP_FMT,
    CONST_ATTN_SCALE,
    CONST_EPS,
    LAYER_FIELDS,
    N_CONSTS,
)
from spyre_serve.models.step.weights import ModelWeights, _Placer, check_dtype

PREFIX = "roberta."                      # a *ForMaskedLM checkpoint's encoder
IGNORED = ("pooler.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(slots=True)
class EncoderLayerWeights:
    qkv: GemmWeight            # [H, 3H]  columns: q heads, k heads, v heads
    qkv_b: DeviceTensor        # float32 [3H]
    o: GemmWeight              # [H, H]
    o_b: DeviceTensor
    ln1_w: DeviceTensor        # attention.output.LayerNorm
    ln1_b: DeviceTensor
    up: GemmWeight             # [H, I]  intermediate.dense
    up_b: DeviceTensor
    down: GemmWeight           # [I, H]  output.dense
    down_b: DeviceTensor
    ln2_w: DeviceTensor        # output.LayerNorm
    ln2_b: DeviceTensor

    def gemms(self) -> list[GemmWeight]:
        return [self.qkv, self.o, self.up, self.down]


@dataclass(slots=True)
class EncoderWeights:
    config: EncoderConfig
    dtype: str                 # width of the GEMM weights on the card
    word_embed: DeviceTensor   # float32 [V, H]
    pos_embed: DeviceTensor    # float32 [max_position_embeddings, H]
    type_embed: DeviceTensor   # float32 [H]: token type 0's row
    embed_norm_w: DeviceTensor
    embed_norm_b: DeviceTensor
    layers: list[EncoderLayerWeights]
    consts: DeviceTensor       # float32[N_CONSTS]: LayerNorm eps, attention scale
    tensors: list[DeviceTensor]  # every tensor placed (what `free` gives back)
    nbytes: int                # bytes of parameters on the card

    def gemm_weights(self) -> list[GemmWeight]:
        return [g for lw in self.layers for g in lw.gemms()]

    formats = ModelWeights.formats      # bytes on the card of the GEMM weights, by format

    def free(self, card: Card) -> None:
        for t in self.tensors:
            card.free(t)


def _layer_names(i: int) -> dict[str, str]:
    """The HF names of layer i's tensors, by their role here."""
    p = f"encoder.layer.{i}."
    return {"q": p + "attention.self.query", "k": p + "attention.self.key",
            "v": p + "attention.self.value", "o": p + "attention.output.dense",
            "ln1": p + "attention.output.LayerNorm", "up": p + "intermediate.dense",
            "down": p + "output.dense", "ln2": p + "output.LayerNorm"}


def expected_encoder_shapes(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder reads, without prefix, with its shape (HF layout: [out, in])."""
    c = config
    H, I = c.hidden_size, c.intermediate_size  # noqa: E741
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, H),
        "embeddings.position_embeddings.weight": (c.max_position_embeddings, H),
        "embeddings.token_type_embeddings.weight": (c.type_vocab_size, H),
        "embeddings.LayerNorm.weight": (H,), "embeddings.LayerNorm.bias": (H,)}
    for i in range(c.num_hidden_layers):
        n = _layer_names(i)
        for role, (out, inp) in {"q": (H, H), "k": (H, H), "v": (H, H), "o": (H, H),
                                 "up": (I, H), "down": (H, I)}.items():
            shapes[n[role] + ".weight"] = (out, inp)
            shapes[n[role] + ".bias"] = (out,)
        for role in ("ln1", "ln2"):
            shapes[n[role] + ".weight"] = (H,)
            shapes[n[role] + ".bias"] = (H,)
    return shapes


def read_encoder_tensors(path: str | Path, config: EncoderConfig) -> tuple[dict[str, np.ndarray], set[str]]:
    """(name without prefix -> float32 array, the stored dtype codes) of the checkpoint
    directory at `path`, checked against expected_encoder_shapes (CheckpointError naming the
    first tensor missing, unexpected or of another shape)."""
    path = Path(path)
    stored: dict[str, tuple[str, np.ndarray]] = {}
    for f in checkpoint_files(path):
        for name, value in _map_file(f).items():
            key = name[len(PREFIX):] if name.startswith(PREFIX) else name
            if key.startswith(IGNORED):
                continue
            if key in stored:
                raise CheckpointError(f"{path}: tensor {key!r} appears twice (as {name!r} in "
                                      f"{f.name})")
            stored[key] = value
    expected = expected_encoder_shapes(config)
    check_shapes(path, expected, {name: arr.shape for name, (_, arr) in stored.items()})
    tensors = {name: widen_stored(*stored[name]) for name in expected}
    return tensors, {code for code, _ in stored.values()}


def encoder_constants(config: EncoderConfig) -> np.ndarray:
    """float32[N_CONSTS] the step reads: LayerNorm eps and the attention scale 1/sqrt(D)."""
    consts = np.zeros(N_CONSTS, np.float32)
    consts[CONST_EPS] = config.layer_norm_eps
    consts[CONST_ATTN_SCALE] = 1.0 / math.sqrt(config.head_dim)
    return consts


def place_encoder_weights(card: Card, config: EncoderConfig, tensors: dict[str, np.ndarray],
                          dtype: str = "float32") -> EncoderWeights:
    """Place the tensors (read_encoder_tensors's) on `card`: the GEMM weights in width `dtype`,
    everything else float32 (rounded to `dtype`'s values, as models/step/weights.py does)."""
    put = _Placer(card, check_dtype(dtype))

    def vec(name: str) -> DeviceTensor:
        return put.vector(tensors[name])

    try:
        layers = []
        for i in range(config.num_hidden_layers):
            n = _layer_names(i)
            w = {role: tensors[name + ".weight"] for role, name in n.items()}
            layers.append(EncoderLayerWeights(
                qkv=put.gemm(n["q"], w["q"], w["k"], w["v"]),
                qkv_b=put.vector(np.concatenate([tensors[n[r] + ".bias"] for r in "qkv"])),
                o=put.gemm(n["o"], w["o"]), o_b=vec(n["o"] + ".bias"),
                ln1_w=vec(n["ln1"] + ".weight"), ln1_b=vec(n["ln1"] + ".bias"),
                up=put.gemm(n["up"], w["up"]), up_b=vec(n["up"] + ".bias"),
                down=put.gemm(n["down"], w["down"]), down_b=vec(n["down"] + ".bias"),
                ln2_w=vec(n["ln2"] + ".weight"), ln2_b=vec(n["ln2"] + ".bias")))
        word = vec("embeddings.word_embeddings.weight")
        pos = vec("embeddings.position_embeddings.weight")
        type0 = put.vector(tensors["embeddings.token_type_embeddings.weight"][0])
        norm_w, norm_b = vec("embeddings.LayerNorm.weight"), vec("embeddings.LayerNorm.bias")
        consts = put.vector(encoder_constants(config), rounded=False)
    except BaseException:
        put.free()
        raise
    return EncoderWeights(config=config, dtype=dtype, word_embed=word, pos_embed=pos,
                          type_embed=type0, embed_norm_w=norm_w, embed_norm_b=norm_b,
                          layers=layers, consts=consts, tensors=list(put.placed),
                          nbytes=sum(t.nbytes for t in put.placed) - consts.nbytes)


def build_encoder_layer_table(card: Card, weights: EncoderWeights) -> DeviceTensor:
    """int64[L, LAYER_FIELDS]: each layer's tensors by byte address and its GEMM weights'
    formats (columns COL_* of models/encoder/program.py, which reads it)."""
    host = np.zeros((len(weights.layers), LAYER_FIELDS), np.int64)
    for i, lw in enumerate(weights.layers):
        for col, t in ((COL_QKV, lw.qkv), (COL_QKV_B, lw.qkv_b), (COL_O, lw.o), (COL_O_B, lw.o_b),
                       (COL_LN1_W, lw.ln1_w), (COL_LN1_B, lw.ln1_b), (COL_UP, lw.up),
                       (COL_UP_B, lw.up_b), (COL_DOWN, lw.down), (COL_DOWN_B, lw.down_b),
                       (COL_LN2_W, lw.ln2_w), (COL_LN2_B, lw.ln2_b)):
            host[i, col] = t.address
        for col, gw in ((COL_QKV_FMT, lw.qkv), (COL_O_FMT, lw.o), (COL_UP_FMT, lw.up),
                        (COL_DOWN_FMT, lw.down)):
            host[i, col] = gw.fmt
    t = card.empty(host.shape, np.int64)
    t.numpy()[...] = host
    return t


def load_encoder(path: str | Path, card: Card, tokenizer: bool = True, dtype: str = "auto",
                 quantization: str | None = None, num_layers: int | None = None,
                 name: str | None = None):
    """A RoBERTa-family checkpoint directory (models/encoder/config.py) with its weights on
    `card` and its tokenizer (models/checkpoints/tokenizer.py), as a models.checkpoints.loader.LoadedModel. `dtype`:
    the GEMM weights' width ("auto": float32, what the encoder computes in); quantization
    and a cut to fewer layers are decoders' options, refused here."""
    from spyre_serve.models.checkpoints.loader import LoadedModel  # (loader imports this module)

    path = Path(path)
    if quantization or num_layers is not None:
        raise ValueError(f"{path.name} is an encoder ({EncoderConfig.__name__}): quantization "
                         f"({quantization!r}) and num_layers ({num_layers!r}) apply to decoders")
    config = EncoderConfig.from_file(path)
    tensors, codes = read_encoder_tensors(path, config)
    stored_dtype = stored_width(codes, config.torch_dtype)
    weights = place_encoder_weights(card, config, tensors, "float32" if dtype == "auto" else dtype)
    del tensors
    try:
        tok = load_tokenizer(path) if tokenizer else None
    except BaseException:
        weights.free(card)
        raise
    return LoadedModel(name=Path(name or path).name, path=path, config=config, tokenizer=tok,
                       weights=weights, stored_dtype=stored_dtype)
