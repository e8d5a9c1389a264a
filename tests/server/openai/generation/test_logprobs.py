"""logprobs.py: the completion and chat shapes, the floor, the token-text cache."""

from __future__ import annotations

from spyre_serve.server.openai.generation.logprobs import (
    LOGPROB_FLOOR,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    joined,
)
from spyre_serve.server.sched.sequence import TokenLogprob
from tests.server.openai.fakes import CharTokenizer, ids_of


class CountingTokenizer(CharTokenizer):
    def __init__(self) -> None:
        self.decoded: list = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded.append(list(ids))
        return super().decode(ids, skip_special_tokens)


A, B, C = ids_of("abc")


def test_token_texts_decode_each_id_once_keeping_special_tokens():
    tok = CountingTokenizer()
    texts = TokenTexts(tok)
    assert [texts(A), texts(0), texts(A)] == ["a", "<eos>", "a"]
    assert tok.decoded == [[A], [0]]


def test_completion_logprobs_list_tokens_logprobs_tops_and_offsets():
    texts = TokenTexts(CharTokenizer())
    lps = [TokenLogprob(A, -0.1, [(A, -0.1), (B, -2.0)]), TokenLogprob(0, -0.3, [(C, -0.2)])]
    out = completion_logprobs(texts, lps, [A, 0], offset=10)
    assert out == {
        "tokens": ["a", "<eos>"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"a": -0.1, "b": -2.0}, {"c": -0.2, "<eos>": -0.3}],  # the token itself is always there
        "text_offset": [10, 11],
    }


def test_a_token_without_a_logprob_has_none_for_it_and_its_top():
    out = completion_logprobs(TokenTexts(CharTokenizer()), [None, TokenLogprob(B, -1.0, [])], [A, B], 0)
    assert out["token_logprobs"] == [None, -1.0] and out["top_logprobs"] == [None, {"b": -1.0}]
    assert out["text_offset"] == [0, 1]


def test_minus_infinity_is_reported_as_the_floor():
    texts = TokenTexts(CharTokenizer())
    out = completion_logprobs(texts, [TokenLogprob(A, float("-inf"), [(B, float("-inf"))])], [A], 0)
    assert out["token_logprobs"] == [LOGPROB_FLOOR]
    assert out["top_logprobs"] == [{"b": LOGPROB_FLOOR, "a": LOGPROB_FLOOR}]
    chat = chat_logprobs(texts, [TokenLogprob(A, float("-inf"), [(B, float("-inf"))])], [A], 1)
    assert chat[0]["logprob"] == chat[0]["top_logprobs"][0]["logprob"] == LOGPROB_FLOOR


def test_joined_puts_the_second_lists_after_the_first():
    texts = TokenTexts(CharTokenizer())
    first = completion_logprobs(texts, [None], [A], 0)
    then = completion_logprobs(texts, [TokenLogprob(B, -1.0, [])], [B], 1)
    assert joined(first, then) == {"tokens": ["a", "b"], "token_logprobs": [None, -1.0],
                                   "top_logprobs": [None, {"b": -1.0}], "text_offset": [0, 1]}


def test_chat_logprobs_give_text_bytes_and_the_first_k_alternatives():
    texts = TokenTexts(CharTokenizer())
    e = ids_of("é")[0]
    out = chat_logprobs(texts, [TokenLogprob(e, -0.5, [(e, -0.5), (A, -1.5), (B, -2.5)])], [e], k=2)
    assert out == [{
        "token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
                         {"token": "a", "logprob": -1.5, "bytes": [0x61]}],
    }]
