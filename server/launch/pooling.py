"""What an embedding server runs (vLLM's ``--runner`` and ``--pooler-config``).

``--runner auto`` (the default) pools with an encoder checkpoint (RoBERTa's family:
``models/encoder/runner.py``) and generates with a decoder; ``--runner pooling`` serves a
decoder's embeddings too (``ModelRunner(pooling=...)``). How a prompt's rows become one vector
is vLLM's default for the model, unless ``--pooler-config`` says otherwise:
    a decoder: the last token's final hidden state (LAST), normalized
    an encoder: its sentence-transformers config's pooling (CLS or MEAN), else CLS, normalized
(The two flags' texts are parsed in server/launch/settings.py.)
"""

from __future__ import annotations


def is_encoder(model) -> bool:
    """Whether ``model`` (models.LoadedModel) is an encoder checkpoint (bidirectional)."""
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


def generating_sizes(s) -> dict:
    """A generating ModelRunner's sizes and widths from settings ``s`` (one card's, or each of
    a sharded model's cards: server/launch/cards.py)."""
    return dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                max_model_len=s.max_model_len, block_size=s.block_size, num_kv_blocks=s.num_kv_blocks,
                compute_dtype=s.compute_dtype, kv_cache_dtype=s.kv_cache_dtype)


def make_runner(s, model, card):
    """The runner ``s`` (Settings) asks for: ModelRunner (generating or pooling a decoder), or
    an encoder's EncoderRunner. A pooled prompt is computed in one step, so its context is at
    most --max-num-batched-tokens."""
    from spyre_serve.models import ModelRunner

    if runner_kind(s.runner, model) == "generate":
        return lora_runner(s, model, card) if s.enable_lora else ModelRunner(model, card, **generating_sizes(s))
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


def lora_runner(s, model, card):
    """A generating ModelRunner with an adapter arena (--max-loras slots of --max-lora-rank)
    holding the --lora-modules adapters (server/lora/adapters.py); refused for a GGUF file."""
    from spyre_serve.models import ModelRunner
    from spyre_serve.models.gguf.file import is_gguf_file
    from spyre_serve.server.lora.adapters import register_adapters

    if is_gguf_file(model.path):
        raise ValueError(f"--enable-lora serves adapters of a float checkpoint directory, not the GGUF file "
                         f"{model.path}")
    runner = ModelRunner(model, card, **generating_sizes(s), lora=(s.max_loras, s.max_lora_rank))
    try:
        register_adapters(runner, s)
    except BaseException:
        runner.close()
        raise
    return runner
