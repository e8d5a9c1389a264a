"""What the model reads: a request's prompt as token ids.

A completion's prompt comes in four forms (a string, strings, token ids, lists of token
ids), each string encoded without special tokens, as given. Chat messages go through the
tokenizer's chat template; a template that cannot render them is the caller's input, so a
400 naming ``messages``.
"""

from __future__ import annotations

from server.openai.errors import APIError
from server.openai.protocol import ChatMessage


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """One token-id list per prompt."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=False)]
    if all(isinstance(x, str) for x in prompt):
        return [tokenizer.encode(x, add_special_tokens=False) for x in prompt]
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return [list(x) for x in prompt]


def chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict | None) -> list[int]:
    """The conversation rendered by the chat template, then encoded (the template writes the
    special tokens itself)."""
    convo = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            convo, add_generation_prompt=add_generation_prompt, tokenize=False, **(template_kwargs or {})
        )
    except Exception as exc:  # a template error is the caller's input
        raise APIError(400, f"the chat template could not render these messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
