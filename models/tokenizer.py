"""Tokenizer loading and incremental detokenization.

``load_tokenizer(path)`` is transformers' AutoTokenizer on the checkpoint directory,
offline. ``IncrementalDetokenizer`` turns a growing list of token ids into text deltas
without ever emitting half a UTF-8 character: a byte-level BPE can split one character
(an emoji, a CJK ideograph) across tokens, and decoding the first part alone gives
U+FFFD. The delta for such a token is held back until the character is complete.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

REPLACEMENT = "\ufffd"
# Tokens decoded before the first new one, so that a new token's leading space or
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
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix_offset", "read_offset")

    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), *,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)                 # prompt + generated
        self.read_offset = len(self.ids)                       # text up to here was emitted
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)  # start of decode window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, ids: int | Iterable[int]) -> str:
        """Append token id(s); return the text delta they complete ("" while a
        character is still incomplete)."""
        if isinstance(ids, int):
            self.ids.append(ids)
        else:
            self.ids.extend(int(i) for i in ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete
        character decodes to U+FFFD, as in ``tokenizer.decode``)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or the last character is not complete
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
