"""Tokenizer loading and incremental detokenization.

``load_tokenizer(path)`` is transformers' AutoTokenizer on the checkpoint directory,
offline. ``IncrementalDetokenizer`` turns a growing list of token ids into text deltas
without ever emitting half a UTF-8 character: a byte-level BPE can split one character
(an emoji, a CJK ideograph) across tokens, and decoding the first part alone gives
U+FFFD. The delta for such a token is held back until the character is complete; the
``tokenizers`` package's ``DecodeStream`` does that, in Rust.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the first new one, so that a new token's leading space or
# merge with its left neighbour decodes as it does in the whole sequence.
_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """A checkpoint directory without usable tokenizer files."""


def load_tokenizer(path: str | Path):
    """transformers.AutoTokenizer from ``path`` (tokenizer.json + tokenizer_config.json),
    never touching the network."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path}: no tokenizer.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: tokenizer files could not be loaded: {e}") from e


class IncrementalDetokenizer:
    """One per sequence. ``add(ids)`` returns the new text those tokens complete.

    The concatenation of every ``add`` result and a final ``flush()`` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` for a byte-level BPE.
    A U+FFFD is emitted only when later tokens show the bytes before it can never
    form a character (or at ``flush``), never for an incomplete tail.

    ``tokenizer`` is a transformers fast tokenizer: its ``backend_tokenizer`` (the
    ``tokenizers.Tokenizer``) is what ``DecodeStream`` steps with.
    """

    __slots__ = ("backend", "skip_special_tokens", "_stream", "_context", "_held")

    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), *,
                 skip_special_tokens: bool = True):
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context = self._whole_characters(list(prompt_ids)[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(self._context, skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []       # added since the last text returned

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _whole_characters(self, ids: list[int]) -> list[int]:
        """``ids`` less the tokens of a character they end inside: DecodeStream takes a
        prefix that decodes to a trailing U+FFFD as no prefix, and would then return the
        prompt's text with the first token's."""
        while ids and self._decode(ids).endswith(REPLACEMENT):
            ids.pop()
        return ids

    def add(self, ids: int | Iterable[int]) -> str:
        """Append token id(s); return the text delta they complete ("" while a
        character is still incomplete)."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        self._held.extend(ids)
        text = self._step(ids)
        if text is None:
            return ""
        # the stream now decodes after the tokens of this text, as flush() does
        self._context, self._held = self._held, []
        return text

    def _step(self, ids: list[int]) -> str | None:
        try:
            return self._stream.step(self.backend, ids)
        except Exception as e:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(e):
                raise
        # The text already returned is no prefix of the text with these tokens: a byte
        # fallback decoder turns a byte it had decoded into U+FFFD once an invalid byte
        # joins it. Start over after the text returned, with the tokens held since.
        self._context = []
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return self._stream.step(self.backend, self._held)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete
        character decodes to U+FFFD, as in ``tokenizer.decode``)."""
        if not self._held:
            return ""
        before = self._decode(self._context)
        text = self._decode(self._context + self._held)[len(before):]
        self._held = []
        return text
