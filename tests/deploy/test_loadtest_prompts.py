"""Prompts the load-test client sends, and which stream chunks it counts as tokens."""

import json

import pytest

from spyre_serve.deploy.loadtest.client import _token_text, request_body
from spyre_serve.deploy.loadtest.datasets import (
    jsonl_prompts,
    parse_id_range,
    random_prompts,
    sharegpt_prompts,
)
from tests.deploy.procs import REPO


def test_random_prompts_have_the_exact_length_inside_the_id_range():
    ps = random_prompts(5, input_len=33, output_len=7, id_range=(100, 200), seed=3)
    assert [len(p.prompt) for p in ps] == [33] * 5
    assert all(100 <= i < 200 for p in ps for i in p.prompt)
    assert {p.prompt_len for p in ps} == {33} and {p.output_len for p in ps} == {7}
    assert len({tuple(p.prompt) for p in ps}) == 5


def test_random_prompts_are_the_same_for_the_same_seed():
    a = random_prompts(2, 8, 4, (100, 8192), seed=9)
    b = random_prompts(2, 8, 4, (100, 8192), seed=9)
    assert [p.prompt for p in a] == [p.prompt for p in b]


def test_random_chat_prompts_need_a_tokenizer():
    with pytest.raises(ValueError, match="--tokenizer"):
        random_prompts(1, 8, 4, (100, 200), chat=True)


@pytest.mark.parametrize("bad", ["100", "a:b", "200:100", "-1:5"])
def test_id_range_refuses_malformed_ranges(bad):
    with pytest.raises(ValueError):
        parse_id_range(bad)


def test_jsonl_prompts_cycle_and_keep_their_output_length(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a", "max_tokens": 5}) + "\n\n"
                 + json.dumps({"text": "b"}) + "\n")
    ps = jsonl_prompts(f, 3, output_len=None, chat=False)
    assert [(p.prompt, p.output_len) for p in ps] == [("a", 5), ("b", 128), ("a", 5)]


def test_jsonl_prompts_become_chat_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n")
    (p,) = jsonl_prompts(f, 1, output_len=9, chat=True)
    assert p.messages == [{"role": "user", "content": "hi"}] and p.output_len == 9


def test_jsonl_line_without_prompt_is_refused_with_its_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        jsonl_prompts(f, 5, None, chat=False)


def test_sharegpt_takes_the_first_human_turn_and_the_reply_length(tmp_path):
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "y" * 80}]},
    ]))
    ps = sharegpt_prompts(f, 2, output_len=None, chat=False)
    assert [(p.prompt, p.output_len) for p in ps] == [("Q1", 10), ("Q2", 20)]


def test_completion_body_streams_with_usage_and_ignore_eos():
    (p,) = random_prompts(1, 4, 6, (100, 200))
    body = request_body(p, "m", chat=False, temperature=0.0, ignore_eos=True)
    assert body["prompt"] == p.prompt and body["max_tokens"] == 6
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True


def test_chunks_with_text_count_as_tokens():
    assert _token_text({"choices": [{"text": " a", "finish_reason": None}]}, chat=False) == " a"
    assert _token_text({"choices": [{"delta": {"content": "b"}}]}, chat=True) == "b"


def test_held_back_text_counts_as_a_token_but_a_closing_chunk_does_not():
    assert _token_text({"choices": [{"text": "", "finish_reason": None}]}, chat=False) == ""
    assert _token_text({"choices": [{"text": "", "finish_reason": "stop"}]}, chat=False) is None


def test_role_and_usage_chunks_are_not_tokens():
    assert _token_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) is None
    assert _token_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) is None


def test_sharegpt_reply_length_is_counted_in_tokens_with_a_tokenizer(tmp_path):
    from spyre_serve.deploy.loadtest.datasets import load_tokenizer

    tok = load_tokenizer(REPO / "models" / "assets" / "tokenizer")
    reply = "The quick brown fox jumps over the lazy dog."
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Q"},
                                                {"from": "gpt", "value": reply}]}]))
    (p,) = sharegpt_prompts(f, 1, output_len=None, chat=True, tokenizer=tok)
    assert p.output_len == len(tok.encode(reply, add_special_tokens=False).ids)
    assert p.messages == [{"role": "user", "content": "Q"}]


def test_random_chat_prompts_are_decoded_text():
    from spyre_serve.deploy.loadtest.datasets import load_tokenizer

    tok = load_tokenizer(REPO / "models" / "assets" / "tokenizer")
    (p,) = random_prompts(1, 12, 4, (100, 200), seed=1, tokenizer=tok, chat=True)
    text = p.messages[0]["content"]
    assert isinstance(text, str) and text and p.prompt is None
