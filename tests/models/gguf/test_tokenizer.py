"""A GGUF file's tokenizer, built from its metadata: it encodes, decodes and renders chats like
the tokenizer.json it was written from, splits text as llama.cpp's pre-tokenizers do (checked
against the Hugging Face pre-tokenizers of the same models), and refuses what it cannot build."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tokenizers import Regex, pre_tokenizers

from spyre_serve.models.checkpoints.profiles import ASSETS, TINY, init_tensors
from spyre_serve.models.checkpoints.tokenizer import IncrementalDetokenizer, load_tokenizer
from spyre_serve.models.gguf.checkpoint import GGUFError
from spyre_serve.models.gguf.tokenizer import PRE_TOKENIZERS, load_gguf_tokenizer
from tests.models.gguf_files import Q, write_gguf

CORPUS = ASSETS.parent / "corpus"
TRICKY = [
    "Weather: ☀️ then 🌧️. 東京は晴れ、明日は雨。 Ünïcödé «quotes» and 🦀🦑 crabs; 한국어 끝.",
    "In 2024, 1,234,567 people paid $3.50 (about 12%).",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines   \n  trailing   ",
    "<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|> and text after",
    "it's they're we've I'm you'll he'd IT'S",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a paged KV cache?"},
            {"role": "assistant", "content": "Blocks of keys and values."},
            {"role": "user", "content": "Why 64 tokens a block?"}]


def write_tiny_gguf(path, pre="gpt-2", **kwargs):
    """granite-tiny's shape (one layer) with the project's tokenizer in the metadata."""
    config = dataclasses.replace(TINY.config, num_hidden_layers=1)
    tensors = dict(init_tensors(config, TINY.stds, seed=1))
    write_gguf(path, config, tensors, qtype=Q.Q8_0, tokenizer_dir=ASSETS, pre=pre, **kwargs)
    return path


@pytest.fixture(scope="module")
def original():
    return load_tokenizer(ASSETS)


@pytest.fixture(scope="module")
def from_gguf(tmp_path_factory):
    return load_gguf_tokenizer(write_tiny_gguf(tmp_path_factory.mktemp("tok") / "m.gguf"))


def corpus_texts(n=300, seed=0):
    """Lines of every corpus file, sampled."""
    lines = [line for f in sorted(CORPUS.glob("*.txt"))
             for line in f.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()]
    pick = np.random.default_rng(seed).choice(len(lines), size=min(n, len(lines)), replace=False)
    return [lines[i] for i in pick]


def test_encodes_every_text_as_the_original(original, from_gguf):
    for text in TRICKY + corpus_texts():
        assert from_gguf.encode(text, add_special_tokens=False) == \
            original.encode(text, add_special_tokens=False), text


def test_decodes_as_the_original(original, from_gguf):
    rng = np.random.default_rng(1)
    for text in TRICKY:
        ids = original.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert from_gguf.decode(ids, skip_special_tokens=skip) == \
                original.decode(ids, skip_special_tokens=skip)
    for _ in range(50):   # any ids, including pieces of characters and special tokens
        ids = rng.integers(0, len(original), 12).tolist()
        assert from_gguf.decode(ids) == original.decode(ids)


def test_special_tokens_and_size_are_the_originals(original, from_gguf):
    assert len(from_gguf) == len(original) == 8192
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "eos_token"):
        assert getattr(from_gguf, attr) == getattr(original, attr), attr
    assert set(from_gguf.all_special_ids) == set(original.all_special_ids)


def test_chat_template_renders_as_the_original(original, from_gguf):
    for gen in (True, False):
        assert from_gguf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False) \
            == original.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)


def test_streamed_text_is_the_decoded_text(from_gguf):
    ids = from_gguf.encode(TRICKY[0], add_special_tokens=False)
    d = IncrementalDetokenizer(from_gguf, ids[:3])
    text = "".join(d.add(i) for i in ids[3:]) + d.flush()
    assert text == from_gguf.decode(ids[3:])


def test_bos_is_added_when_the_file_says_so(tmp_path):
    tok = load_gguf_tokenizer(write_tiny_gguf(tmp_path / "m.gguf", metadata={
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 1}))
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


# ---------------------------------------------------------------- llama.cpp's splits


def pieces(pre, text):
    return [p for p, _ in pre.pre_tokenize_str(text)]


def ours(name):
    """The pre-tokenizer load_gguf_tokenizer builds for a tokenizer.ggml.pre name."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[name].regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


LLAMA3_TOKENIZER_JSON = (   # Meta-Llama-3's tokenizer.json pre_tokenizer regex
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_PRE_TOKENIZERS = {   # the pre_tokenizer of each model's own tokenizer.json
    "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                use_regex=True)]),
    "llama-bpe": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_TOKENIZER_JSON), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


@pytest.mark.parametrize("name", list(HF_PRE_TOKENIZERS))
def test_splits_as_the_models_own_pre_tokenizer(name):
    for text in TRICKY + corpus_texts(100, seed=2):
        assert pieces(ours(name), text) == pieces(HF_PRE_TOKENIZERS[name], text), text


def test_digit_splits_differ_as_llama_cpp_defines_them():
    assert pieces(ours("gpt-2"), "abc 123456") == ["abc", "Ġ123456"]
    assert pieces(ours("smollm"), "abc 123456") == ["abc", "Ġ", "1", "2", "3", "4", "5", "6"]
    assert pieces(ours("llama-bpe"), "abc 123456") == ["abc", "Ġ", "123", "456"]


# ---------------------------------------------------------------- refusals


def test_a_sentencepiece_vocabulary_is_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", metadata={"tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFError, match="tokenizer.ggml.model is 'llama'; only 'gpt2'"):
        load_gguf_tokenizer(path)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", pre="made-up")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre is 'made-up', a pre-tokenizer this "
                                        "server does not know; known: .*smollm"):
        load_gguf_tokenizer(path)


def test_a_served_gguf_chats_through_its_own_template(tmp_path, original):
    """A GGUF file behind the real server (uvicorn, the openai client): its chat prompt is
    the file's template rendered by the file's tokenizer."""
    from openai import OpenAI

    from spyre_serve.server.launch.cli import build
    from tests.server.servers import ServerThread, real_settings

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    built = build(real_settings(model=str(path), max_num_seqs=2, num_kv_blocks=16,
                                device_memory=256 << 20), progress=False)
    try:
        with ServerThread(built.app) as server:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(model="tiny.gguf", messages=MESSAGES,
                                                   max_tokens=5, temperature=0)
    finally:
        built.engine.shutdown()
    rendered = original.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(original.encode(rendered, add_special_tokens=False))
    assert reply.usage.completion_tokens == 5 and reply.model == "tiny.gguf"
