"""Prompts to send: random token ids of a fixed length, or text from a file.

- ``random``: ``input_len`` token ids drawn uniformly from ``token_id_range``
  (default 100..8191: past the special tokens of common tokenizers and inside
  any vocabulary of 8192 ids or more). Sent as a list of ids to
  /v1/completions, so the prompt length is exact without a tokenizer. For
  /v1/chat/completions (which takes text) the ids are decoded with
  ``--tokenizer``.
- ``jsonl``: one object a line, ``{"prompt": "..."}`` (or ``"text"``), or
  ``{"messages": [...]}`` for chat; an optional ``"max_tokens"`` sets that
  prompt's output length.
- ``sharegpt``: a JSON list of ``{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}``; the first human turn
  is the prompt; the reply's length in tokens (with ``--tokenizer``, else its
  characters / 4) is the output length unless ``--output-len`` is given.

A file with fewer prompts than asked for is cycled through.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Prompt:
    prompt: str | list[int] | None     # text or token ids (completions)
    messages: list[dict] | None        # chat messages (chat completions)
    prompt_len: int | None             # tokens, when known before sending
    output_len: int                    # max_tokens to ask for


def parse_id_range(text: str) -> tuple[int, int]:
    """``"100:8192"`` -> (100, 8192), the half-open range of ids to draw from."""
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--token-id-range takes LOW:HIGH, got {text!r}") from None
    if not sep or not 0 <= low < high:
        raise ValueError(f"--token-id-range needs 0 <= LOW < HIGH, got {text!r}")
    return low, high


def random_prompts(n: int, input_len: int, output_len: int, id_range: tuple[int, int],
                   seed: int = 0, tokenizer=None, chat: bool = False) -> list[Prompt]:
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len}, {output_len}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids = [rng.randrange(*id_range) for _ in range(input_len)]
        if chat:
            if tokenizer is None:
                raise ValueError("random prompts on a chat endpoint need --tokenizer "
                                 "to turn token ids into text")
            text = tokenizer.decode(ids)
            prompts.append(Prompt(None, [{"role": "user", "content": text}], None, output_len))
        else:
            prompts.append(Prompt(ids, None, input_len, output_len))
    return prompts


def _cycle(items: list, n: int, source: str) -> list:
    if not items:
        raise ValueError(f"{source} holds no usable prompt")
    return [items[i % len(items)] for i in range(n)]


def jsonl_prompts(path: str | Path, n: int, output_len: int | None, chat: bool) -> list[Prompt]:
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            out = output_len or int(obj.get("max_tokens") or 128)
            text = obj.get("prompt", obj.get("text"))
            messages = obj.get("messages")
            if messages is None and not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: needs a string \"prompt\" (or \"text\") "
                                 "or a \"messages\" list")
            if chat:
                messages = messages or [{"role": "user", "content": text}]
                items.append(Prompt(None, messages, None, out))
            else:
                if text is None:
                    raise ValueError(f"{path}:{lineno}: \"messages\" needs a chat endpoint")
                items.append(Prompt(text, None, None, out))
            if len(items) >= n:
                break
    return _cycle(items, n, str(path))


def sharegpt_prompts(path: str | Path, n: int, output_len: int | None, chat: bool,
                     tokenizer=None) -> list[Prompt]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    items = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        human = next((t["value"] for t in turns if t.get("from") in ("human", "user")), None)
        reply = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), "")
        if not human:
            continue
        out = output_len
        if out is None:
            if tokenizer is not None:
                out = len(tokenizer.encode(reply, add_special_tokens=False).ids)
            else:
                out = len(reply) // 4
            out = max(out, 4)
        if chat:
            items.append(Prompt(None, [{"role": "user", "content": human}], None, out))
        else:
            items.append(Prompt(human, None, None, out))
        if len(items) >= n:
            break
    return _cycle(items, n, str(path))


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from tokenizer.json or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(p))
