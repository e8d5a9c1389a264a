"""The cards a server runs on: one, or a model sharded over ``--tensor-parallel-size`` of them.

One card: the model placed whole and the runner ``--runner`` asks for (server/launch/pooling.py). Several:
each card ``--device-memory`` big (its own arena, allocator and stream), the checkpoint read
once and each card's shard placed on it (models/parallel/shards.py), and a ``TensorParallelRunner``
(models/parallel/runner.py) that runs every step on all of them. Tensor parallelism takes a float
checkpoint directory (not a GGUF file, not ``--quantization``) and a generating model.
"""

from __future__ import annotations

import logging

log = logging.getLogger("spyre_serve")


def new_card(s):
    """An emulated card, ``--device-memory`` big (the card's own default when not given)."""
    from spyre_serve.device import Card

    return Card(memory_bytes=s.device_memory) if s.device_memory else Card()


def load_on_cards(s):
    """(card 0, the model as the API sees it, the runner, a draft model's runner or None) for
    settings ``s``; the cards are closed again if loading fails."""
    from spyre_serve.models import load_model
    from spyre_serve.server.launch.pooling import make_runner

    tp = s.tensor_parallel_size
    spec = s.speculative_config
    if tp == 1:
        card = new_card(s)
        try:
            model = load_model(s.model, card, dtype=s.dtype, quantization=s.quantization)
            draft = load_draft(s, card, model) if spec is not None and spec.model else None
            return card, model, make_runner(s, model, card), draft
        except BaseException:
            card.close()
            raise
    if spec is not None and spec.model:
        raise ValueError(f"--speculative-config with a draft model runs on one card, not --tensor-parallel-size {tp}")
    return (*_load_sharded(s, tp), None)


def load_draft(s, card, model):
    """The draft model of ``--speculative-config`` on ``card`` beside ``model``, and its runner:
    placed before the served model's runner, whose KV cache takes what is left of the card. Its
    KV cache holds ``disable_by_batch_size`` sequences of the longest context (server/spec_decode/draft_model.py)."""
    from spyre_serve.models import ModelRunner, load_model
    from spyre_serve.server.launch.pooling import generating_sizes

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


def _load_sharded(s, tp: int):
    from spyre_serve.models.checkpoints.loader import LoadedModel
    from spyre_serve.models.checkpoints.profiles import model_names, resolve_model
    from spyre_serve.models.gguf.file import is_gguf_file
    from spyre_serve.models.parallel.runner import TensorParallelRunner, load_sharded
    from spyre_serve.server.launch.pooling import generating_sizes

    path = resolve_model(s.model)
    if is_gguf_file(path) or s.quantization or s.runner == "pooling":
        raise ValueError(f"--tensor-parallel-size {tp} shards a float checkpoint directory of a generating "
                         f"model: not a GGUF file, --quantization or --runner pooling (got --model {s.model}, "
                         f"--quantization {s.quantization}, --runner {s.runner})")
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
    return cards[0], model, runner
