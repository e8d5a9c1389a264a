"""Small RoBERTa-family checkpoints written by the tests, for the encoder's parity tests.

    from tests.models.encoder_checkpoints import write_encoder_checkpoint, reference_pooled

    path = write_encoder_checkpoint(tmp_path, xlm=False, pooling="MEAN")
    want = reference_pooled(path, prompts, "CLS")    # transformers' last_hidden_state, pooled

The weights are seeded numpy draws loaded into transformers' RobertaModel / XLMRobertaModel
and written with ``save_pretrained`` (safetensors): a real HF checkpoint. Every bias and
LayerNorm is drawn too (transformers' init leaves them 0 and 1), so the parity tests see them.
The tokenizer is a byte-level BPE trained here on a few sentences (offline), whose
post-processor wraps a text in <s> ... </s> as RoBERTa's does. ``pooling`` adds the
sentence-transformers files (modules.json, 1_Pooling/config.json) that name a pooling mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]     # RoBERTa's ids 0..4
CORPUS = [
    "The card runs one program per step, and the host prepares the next one meanwhile.",
    "Embeddings pool the hidden states of a whole prompt into one vector of unit length.",
    "Granite embedding models are RoBERTa encoders with learned absolute positions.",
    "Quick brown foxes jump over lazy dogs; sphinxes of black quartz judge my vow.",
] * 4
_ST_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
             "pooling_mode_lasttoken")


def hf_config(*, xlm: bool, vocab: int, hidden: int, layers: int, heads: int,
              intermediate: int, max_positions: int):
    """transformers' RobertaConfig / XLMRobertaConfig of these sizes (pad 1, bos 0, eos 2)."""
    from transformers import RobertaConfig, XLMRobertaConfig

    return (XLMRobertaConfig if xlm else RobertaConfig)(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=max_positions, type_vocab_size=2,
        layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def seeded_state(model, seed: int) -> dict:
    """Every parameter of `model` drawn from a seeded normal: matrices and embeddings std 0.2,
    biases std 0.1, LayerNorm weights 1 + 0.1 N(0, 1)."""
    import torch

    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        if "LayerNorm.weight" in name:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = 0.2 * rng.standard_normal(shape)
        state[name] = torch.from_numpy(a.astype(np.float32))
    return state


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A byte-level BPE of at most `vocab` ids (the five RoBERTa specials first), trained on
    CORPUS, with RoBERTa's <s> ... </s> post-processor; saved as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0),
                                                      add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                   cls_token="<s>", sep_token="</s>")
    fast.save_pretrained(directory)


def write_sentence_transformers(directory: Path, pooling: str, hidden: int) -> None:
    """modules.json (Transformer, Pooling, Normalize) and 1_Pooling/config.json naming one
    pooling mode: "CLS", "MEAN", or a sentence-transformers key such as
    "pooling_mode_max_tokens"."""
    key = {"CLS": "pooling_mode_cls_token", "MEAN": "pooling_mode_mean_tokens"}.get(pooling, pooling)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    conf = {"word_embedding_dimension": hidden, **{k: k == key for k in _ST_MODES},
            "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(conf, indent=2))


def write_encoder_checkpoint(directory, *, xlm: bool = False, vocab: int = 300, hidden: int = 64,
                             layers: int = 2, heads: int = 4, intermediate: int = 128,
                             max_positions: int = 34, seed: int = 0,
                             pooling: str | None = None, masked_lm: bool = False) -> Path:
    """Write an encoder checkpoint into ``directory`` (created) with ``save_pretrained``:
    RobertaModel (xlm: XLMRobertaModel; masked_lm: *ForMaskedLM, its encoder under
    ``roberta.``) with seeded weights, the tokenizer, and with ``pooling`` the
    sentence-transformers files. max_positions 34 holds prompts of 32 tokens (pad 1).
    Returns the directory."""
    from transformers import (
        RobertaForMaskedLM,
        RobertaModel,
        XLMRobertaForMaskedLM,
        XLMRobertaModel,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(xlm=xlm, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                    intermediate=intermediate, max_positions=max_positions)
    cls = {(False, False): RobertaModel, (True, False): XLMRobertaModel,
           (False, True): RobertaForMaskedLM, (True, True): XLMRobertaForMaskedLM}[xlm, masked_lm]
    model = cls(cfg)
    model.load_state_dict(seeded_state(model, seed))
    model.save_pretrained(directory)
    write_tokenizer(directory, vocab)
    if pooling is not None:
        write_sentence_transformers(directory, pooling, hidden)
    return directory


def reference_pooled(path, prompts: list[list[int]], pooling: str) -> np.ndarray:
    """float32[len(prompts), H]: transformers' model at ``path`` (fp32, each prompt alone),
    its last_hidden_state pooled ("CLS": the first row, "MEAN": the mean of the rows) and
    scaled to unit length."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            states = model(torch.tensor([p])).last_hidden_state[0].double().numpy()
            v = states[0] if pooling == "CLS" else states.mean(0)
            out.append(v / np.linalg.norm(v))
    return np.array(out, np.float32)
