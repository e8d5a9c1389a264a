"""Logprobs as the two APIs write them (vLLM's shapes).

Completions: four parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as
{text: logprob}, ``text_offset`` in characters), and vLLM's ``prompt_logprobs`` (per prompt
token {id: {logprob, rank, decoded_token}}). Chat: one entry per token with its text,
logprob, UTF-8 bytes and top alternatives. A token's text is what the tokenizer decodes it
to alone, special tokens kept; JSON has no -inf, so a logprob below ``LOGPROB_FLOOR`` is
reported as the floor.
"""

from __future__ import annotations

from spyre_serve.server.sched.sequence import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this instead


class TokenTexts:
    """Each token id's text, decoded once: every token of every logprobs answer names its top
    alternatives too, and the same ids come back again and again."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s


def floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(texts: TokenTexts, tokens: list[TokenLogprob | None], ids: list[int], offset: int) -> dict:
    """A completion's logprobs of ``ids``; ``text_offset`` counts characters from ``offset``.
    A token without a logprob (a prompt's first) has ``None`` for its logprob and its top;
    a top always lists the token itself."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(ids, tokens, strict=True):
        s = texts(t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(floored(lp.logprob))
        top = {texts(tid): floored(v) for tid, v in lp.top}
        top.setdefault(s, floored(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(texts: TokenTexts, tokens: list[TokenLogprob | None], ids: list[int], k: int) -> list:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token None (the first
    has no logprob) or ``{token id: {logprob, rank, decoded_token}}``, the token itself first
    (its rank in the whole vocabulary), then its ``k`` top alternatives (ranks 1..k)."""
    out: list[dict | None] = []
    for t, lp in zip(ids, tokens, strict=True):
        if lp is None:
            out.append(None)
            continue
        top = lp.top[:k]
        rank = lp.rank if lp.rank is not None else next((r for r, (tid, _) in enumerate(top, 1) if tid == t), None)
        entry = {str(t): {"logprob": floored(lp.logprob), "rank": rank, "decoded_token": texts(t)}}
        for r, (tid, v) in enumerate(top, 1):
            entry.setdefault(str(tid), {"logprob": floored(v), "rank": r, "decoded_token": texts(tid)})
        out.append(entry)
    return out


def joined(first: dict, then: dict) -> dict:
    """Two completion logprobs one after the other (an echoed prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(texts: TokenTexts, tokens: list[TokenLogprob], ids: list[int], k: int) -> list[dict]:
    """A chat's logprobs of ``ids``, each with its ``k`` top alternatives."""
    out = []
    for t, lp in zip(ids, tokens, strict=True):
        s = texts(t)
        top = [
            {"token": texts(tid), "logprob": floored(v), "bytes": list(texts(tid).encode())}
            for tid, v in lp.top[:k]
        ]
        out.append({"token": s, "logprob": floored(lp.logprob), "bytes": list(s.encode()), "top_logprobs": top})
    return out
