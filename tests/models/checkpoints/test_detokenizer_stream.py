"""IncrementalDetokenizer on tokenizers' DecodeStream: the two cases where the stream
alone would go wrong (test_tokenizer.py holds the behaviour both share)."""

import os
from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer, decoders, models

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spyre_serve.models.checkpoints.tokenizer import IncrementalDetokenizer, load_tokenizer  # noqa: E402

ASSETS = Path(__file__).resolve().parents[3] / "models" / "assets" / "tokenizer"


def test_a_prompt_ending_inside_a_character_is_not_emitted():
    tok = load_tokenizer(ASSETS)
    prompt = tok.encode("Hello there 🦀")[:-1]           # the crab's last byte is missing
    assert tok.decode(prompt).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, prompt)
    text = "".join(d.add(i) for i in tok.encode(" ok")) + d.flush()
    assert text == " ok"


def byte_fallback_tokenizer() -> SimpleNamespace:
    """A sentencepiece-style vocabulary (Llama 2, Mistral): one <0xXX> token per byte, whose
    decoder turns a run of byte tokens that is no valid UTF-8 into one U+FFFD per byte,
    including bytes it had decoded on their own before."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return SimpleNamespace(backend_tokenizer=backend)


def test_text_a_later_token_turns_into_replacements_restarts_the_stream_instead_of_raising():
    d = IncrementalDetokenizer(byte_fallback_tokenizer())
    # " " alone, then 0xE2 joins it into an invalid run: the whole run decodes to "\ufffd\ufffd"
    deltas = [d.add(0x20), d.add(0xE2), d.add(256)]
    assert deltas == [" ", "", "\ufffda"]
    assert d.flush() == ""
