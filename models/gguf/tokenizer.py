"""The tokenizer and chat template of a GGUF file, built from its metadata.

A GGUF file has no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``, in
id order), the merges, each token's type (normal, control, user-defined...), the special
ids, the chat template, and the name of the pre-tokenizer (``tokenizer.ggml.pre``), i.e.
the regexes llama.cpp splits text with before the merges. ``load_gguf_tokenizer`` builds a
``tokenizers`` byte-level BPE from those and wraps it in transformers'
``PreTrainedTokenizerFast``, so the server calls it as it calls AutoTokenizer's (encode,
decode, apply_chat_template, eos_token_id, len, backend_tokenizer).

Only byte-level BPE vocabularies (``tokenizer.ggml.model`` "gpt2": Llama 3, Granite,
SmolLM) are built; SentencePiece ("llama": Llama 1/2) and others are refused naming the
model, and so is a pre-tokenizer name not in ``PRE_TOKENIZERS`` (a wrong split would
tokenize text differently from what the model was trained on, silently).

Why not transformers' GGUF converter: its module and API changed between transformers 4.x
and 5.x (the project takes both), it reads the file again through ``gguf.GGUFReader``
(15 s for SmolLM2 on this machine, against ~2 s here), and it knows fewer of llama.cpp's
pre-tokenizer names (none of "smollm", "refact", "gpt-2": it falls back to GPT-2's split).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from spyre_serve.models.gguf.file import GGUFError, GGUFFile, read_gguf, require

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied one after the other, each
# splitting the pieces of the one before (matches and the text between them both kept).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    regexes: tuple[str, ...]       # applied in order
    ignore_merges: bool = False    # a whole piece found in the vocabulary is one token
    add_bos: bool = False          # llama.cpp's default when the file has no add_bos_token


def _named(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **_named("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4", PreTokenizer((_GPT2,))),
    **_named("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             PreTokenizer((r"\p{N}", _GPT2))),
    **_named("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
             PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_named("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_named("qwen2 deepseek-r1-qwen stablelm2 megrez", PreTokenizer((_QWEN2,))),
}
SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)   # matched whole, skipped by skip_special_tokens


class GGUFTokenizerError(GGUFError):
    """Tokenizer metadata this server cannot build a tokenizer from."""


def load_gguf_tokenizer(path_or_file: str | Path | GGUFFile):
    """transformers' PreTrainedTokenizerFast for the file's tokenizer metadata."""
    f = path_or_file if isinstance(path_or_file, GGUFFile) else read_gguf(path_or_file)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import PreTrainedTokenizerFast

    backend = build_backend(f)
    tokens = f.metadata[Keys.Tokenizer.LIST]
    special = {name: _token(f, tokens, key) for name, key in (
        ("bos_token", Keys.Tokenizer.BOS_ID), ("eos_token", Keys.Tokenizer.EOS_ID),
        ("unk_token", Keys.Tokenizer.UNK_ID), ("pad_token", Keys.Tokenizer.PAD_ID))}
    named = {v for v in special.values() if v is not None}
    others = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())
              if t.special and t.content not in named]
    context = f.metadata.get(f.arch_key(Keys.LLM.CONTEXT_LENGTH))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=f.metadata.get(Keys.Tokenizer.CHAT_TEMPLATE),
        clean_up_tokenization_spaces=False,   # as the server's streamed text, which never cleans
        model_max_length=context or int(1e30),
        additional_special_tokens=others,     # the control tokens: all_special_ids
        **{k: v for k, v in special.items() if v is not None})


def build_backend(f: GGUFFile) -> Tokenizer:
    """The ``tokenizers.Tokenizer``: BPE over the vocabulary and merges, llama.cpp's split
    for the pre-tokenizer name, byte-level decoding, special tokens matched whole."""
    kind = f.metadata.get(Keys.Tokenizer.MODEL)
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"{f.path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) "
            "is supported")
    tokens: list[str] = require(f, Keys.Tokenizer.LIST)
    merges = [_merge_pair(f, i, m) for i, m in enumerate(require(f, Keys.Tokenizer.MERGES))]
    pre = _pre_tokenizer(f)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GGUFTokenizerError(f"{f.path}: token {dup!r} appears more than once in "
                                 "tokenizer.ggml.tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_whole_tokens(f, tok, tokens)
    tok.post_processor = _post_processor(f, tokens, pre)
    return tok


def _merge_pair(f: GGUFFile, index: int, merge: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise GGUFTokenizerError(f"{f.path}: merge {index} ({merge!r}) is not two tokens "
                                 "separated by one space")
    return parts[0], parts[1]


def _pre_tokenizer(f: GGUFFile) -> PreTokenizer:
    """The split for ``tokenizer.ggml.pre``; a file without one gets llama.cpp's default."""
    name = f.metadata.get(Keys.Tokenizer.PRE) or "default"
    if name not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"{f.path}: tokenizer.ggml.pre is {name!r}, a pre-tokenizer "
                                 f"this server does not know; known: {', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[name]


def _add_whole_tokens(f: GGUFFile, tok: Tokenizer, tokens: list[str]) -> None:
    """Control and unknown tokens become special added tokens, user-defined ones plain
    added tokens: both are matched whole in the text (as llama.cpp does) instead of being
    cut into byte pieces, and keep their vocabulary ids."""
    types = f.metadata.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"{f.path}: {len(types)} token types for {len(tokens)} tokens")
    special = {i: t for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in SPECIAL_TYPES}
    user = {i: t for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == TokenType.USER_DEFINED}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user.values()])
    moved = [(i, t) for i, t in (special | user).items() if tok.token_to_id(t) != i]
    if moved:
        i, t = moved[0]
        raise GGUFTokenizerError(f"{f.path}: added token {t!r} got id {tok.token_to_id(t)}, "
                                 f"not its vocabulary id {i}")


def _post_processor(f: GGUFFile, tokens: list[str], pre: PreTokenizer):
    """BOS/EOS added by encode(add_special_tokens=True) when the file says so."""
    add_bos = bool(f.metadata.get(Keys.Tokenizer.ADD_BOS, pre.add_bos))
    add_eos = bool(f.metadata.get(Keys.Tokenizer.ADD_EOS, False))
    bos = _token(f, tokens, Keys.Tokenizer.BOS_ID) if add_bos else None
    eos = _token(f, tokens, Keys.Tokenizer.EOS_ID) if add_eos else None
    for flag, token, key in ((add_bos, bos, Keys.Tokenizer.BOS_ID), (add_eos, eos, Keys.Tokenizer.EOS_ID)):
        if flag and token is None:
            raise GGUFTokenizerError(f"{f.path}: the file asks to add {key.split('.')[-1]} "
                                     f"but has no valid {key!r}")
    if not (bos or eos):
        return processors.ByteLevel(trim_offsets=False)
    pieces = [p for p in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if p]
    pair = pieces + [p for p in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if p]
    ids = [(tokens[f.metadata[k]], f.metadata[k]) for t, k in
           ((bos, Keys.Tokenizer.BOS_ID), (eos, Keys.Tokenizer.EOS_ID)) if t]
    return processors.TemplateProcessing(single=" ".join(pieces), pair=" ".join(pair),
                                         special_tokens=list(dict.fromkeys(ids)))


def _token(f: GGUFFile, tokens: list[str], key: str) -> str | None:
    """The text of the token a special-id key names, or None when absent or out of range."""
    tid = f.metadata.get(key)
    return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None
