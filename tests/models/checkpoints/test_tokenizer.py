"""The shipped tokenizer and incremental detokenization."""

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spyre_serve.models.checkpoints.tokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    TokenizerError,
    load_tokenizer,
)

ASSETS = Path(__file__).resolve().parents[3] / "models" / "assets" / "tokenizer"
MIXED = "Weather: ☀️ then 🌧️. 東京は晴れ、明日は雨。 Ünïcödé «quotes» and 🦀🦑 crabs; 한국어 끝."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSETS)


def byte_token_id(tok, byte: int) -> int:
    """Id of the single-byte token for ``byte`` (GPT-2 byte-to-unicode mapping)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + extra.index(byte))
    tid = tok.convert_tokens_to_ids(char)
    assert isinstance(tid, int) and tid != tok.unk_token_id
    return tid


def stream(tok, ids, prompt=()):
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add(i) for i in ids]
    return deltas, d.flush()


def test_vocab_size_and_granite_special_tokens(tok):
    assert len(tok) == 8192
    assert tok.convert_tokens_to_ids("<|end_of_text|>") == 0
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == 0
    ids = tok.encode("<|start_of_role|>user<|end_of_role|>hi<|end_of_text|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|start_of_role|>")
    assert ids[2] == tok.convert_tokens_to_ids("<|end_of_role|>")
    assert ids[-1] == 0


def test_chat_template_is_granite_form(tok):
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
                    "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
                    "<|start_of_role|>assistant<|end_of_role|>")


def test_chat_template_default_system_turn(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.startswith("<|start_of_role|>system<|end_of_role|>You are Granite")
    assert text.endswith("<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n")


def test_roundtrip_of_mixed_unicode(tok):
    assert tok.decode(tok.encode(MIXED)) == MIXED


def test_tokenizer_config_holds_chat_template():
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    assert "<|start_of_role|>" in config["chat_template"]


def test_load_tokenizer_without_files_names_the_directory(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def test_incremental_deltas_concatenate_to_full_decode(tok):
    ids = tok.encode(MIXED)
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == MIXED


def test_incremental_never_emits_replacement_for_split_characters(tok):
    ids = tok.encode(MIXED)
    deltas, tail = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert tail == ""


def test_split_emoji_held_until_complete(tok):
    ids = tok.encode("🦀")
    assert len(ids) >= 2, "the test needs an emoji split across tokens"
    deltas, _ = stream(tok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🦀"


def test_cjk_split_across_tokens(tok):
    text = "明日は雨"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a split character"
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) == text and tail == ""


def test_invalid_byte_emitted_as_replacement_once_followed(tok):
    lone = byte_token_id(tok, 0x80)            # a continuation byte with no lead byte
    ids = [lone, *tok.encode(" ok")]
    deltas, tail = stream(tok, ids)
    assert deltas[0] == ""
    assert "".join(deltas) + tail == tok.decode(ids) == "\ufffd ok"


def test_incomplete_tail_flushed_as_in_full_decode(tok):
    ids = tok.encode("ab🦀")[:-1]               # drop the emoji's last token
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) == "ab"
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tok.decode(ids)


def test_prompt_text_is_not_emitted(tok):
    prompt = tok.encode("The weather today is")
    gen = tok.encode(" sunny 😀 and warm")
    deltas, tail = stream(tok, gen, prompt)
    assert "".join(deltas) + tail == tok.decode(prompt + gen)[len(tok.decode(prompt)):]


def test_special_tokens_skipped_by_default(tok):
    ids = tok.encode("done") + [0]
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == "done"


def test_special_tokens_kept_when_asked(tok):
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = d.add(tok.encode("done") + [0]) + d.flush()
    assert text == "done<|end_of_text|>"


def test_training_script_reproduces_committed_files():
    import importlib.util

    script = ASSETS.parents[2] / "scripts" / "train_tokenizer.py"
    spec = importlib.util.spec_from_file_location("train_tokenizer", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, text in mod.tokenizer_files(mod.train()).items():
        assert (ASSETS / name).read_text() == text, name
