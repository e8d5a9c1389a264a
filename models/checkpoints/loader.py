"""load_model: a model name, checkpoint directory or GGUF file -> a model whose weights are on
the card."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from spyre_serve.device import Card
from spyre_serve.models.checkpoints.hf import load_checkpoint, stored_width
from spyre_serve.models.checkpoints.profiles import model_names, resolve_model
from spyre_serve.models.checkpoints.quantize import quantize_matrices
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.encoder.config import is_encoder_config
from spyre_serve.models.encoder.weights import load_encoder
from spyre_serve.models.gguf.checkpoint import is_gguf_file, load_gguf_checkpoint
from spyre_serve.models.gguf.tokenizer import load_gguf_tokenizer
from spyre_serve.models.step.weights import ModelWeights, place_weights


@dataclass(slots=True)
class LoadedModel:
    name: str                  # what the user asked for: a model name, or the directory's
                               # or GGUF file's name
    path: Path                 # the checkpoint directory, or the GGUF file
    config: GraniteConfig
    tokenizer: object | None   # transformers tokenizer (None when load_model(tokenizer=False))
    weights: ModelWeights      # on the card
    stored_dtype: str          # dtype the checkpoint stores ("float32", "bfloat16", "float16")


def load_model(path_or_name: str | os.PathLike, card: Card, tokenizer: bool = True,
               dtype: str = "auto", quantization: str | None = None,
               num_layers: int | None = None) -> LoadedModel:
    """Resolve, read the checkpoint (float32 on the host, bf16/fp16 widened; a GGUF file's
    Q8_0/Q4_0/Q4_1 matrices kept quantized), optionally quantize its matrices
    (`quantization`: models/checkpoints/quantize.py), place it on `card` once in the kernels' layout,
    the float tensors in width `dtype` ("auto": the width the checkpoint stores, as vLLM's
    --dtype auto), and load its tokenizer. `num_layers`: keep only the first that many
    decoder layers (the final norm and LM head then read their output: a logit lens, as
    benchmarks/numerics.py uses to see where an error grows)."""
    name = os.fspath(path_or_name)
    path = resolve_model(name)
    if is_encoder_config(path):        # a RoBERTa-family encoder (models/encoder/weights.py)
        return load_encoder(path, card, tokenizer, dtype, quantization, num_layers, name)
    gguf = is_gguf_file(path)   # a GGUF file: tokenizer from its metadata
    if gguf and quantization:
        raise ValueError(f"--quantization {quantization} applies to a float checkpoint; the GGUF "
                         f"file {Path(path).name} is served in the formats it stores")
    ckpt = load_gguf_checkpoint(path) if gguf else load_checkpoint(path)
    if num_layers is not None:
        ckpt.config, ckpt.tensors = first_layers(ckpt.config, ckpt.tensors, num_layers)
    if quantization:
        ckpt.tensors = quantize_matrices(ckpt.tensors, quantization)
    stored_dtype = stored_width(ckpt.stored_dtypes.values(), ckpt.config.torch_dtype)
    weights = place_weights(card, ckpt.config, ckpt.tensors,
                            stored_dtype if dtype == "auto" else dtype)
    del ckpt
    tok = tokenizer_of(path) if tokenizer else None
    display = name if name in model_names() else Path(name).name
    return LoadedModel(name=display, path=Path(path), config=weights.config, tokenizer=tok,
                       weights=weights, stored_dtype=stored_dtype)


def tokenizer_of(path: str | os.PathLike):
    """The tokenizer of a resolved model: a checkpoint directory's, or a GGUF file's metadata's."""
    return load_gguf_tokenizer(path) if is_gguf_file(path) else load_tokenizer(path)


def first_layers(config: GraniteConfig, tensors: dict, n: int) -> tuple[GraniteConfig, dict]:
    """The config and tensors of a model cut after its first n decoder layers (ValueError
    unless 1 <= n <= its layers)."""
    if not 1 <= n <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {n}")
    kept = {name: t for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < n}
    return dataclasses.replace(config, num_hidden_layers=n), kept
