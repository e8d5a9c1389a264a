"""``POST /v1/completions``: text completions (vLLM's fields), one JSON body or a stream.

Every prompt of a request gets ``n`` choices. With ``echo`` a choice's text starts with its
prompt, and with ``logprobs`` too the prompt's tokens are scored (the first has none); a
stream sends the prompt in each choice's first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Request

from server.engine import SeqUpdate
from server.openai.bridge import Choice, Submission
from server.openai.logprobs import TokenTexts, completion_logprobs, joined
from server.openai.prompts import completion_prompts
from server.openai.protocol import CompletionRequest
from server.openai.response import full_response, new_head, stream_response
from server.openai.sampling import generation_params
from server.openai.serving import serving_of

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request):
    serving = serving_of(request)
    req = await serving.read(request, CompletionRequest)
    prompts = completion_prompts(serving.tokenizer, req.prompt)
    for ids in prompts:
        serving.check_tokens(ids, "prompt")
    max_tokens = serving.max_tokens(req.max_tokens, prompts)
    for ids in prompts:
        serving.check_fits(ids, max_tokens)
    params = generation_params(req, max_tokens, req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None,
                               max_n=serving.settings.max_n)
    serving.check_admission()
    head = new_head("cmpl", "text_completion", serving.model_name)
    sub = Submission(serving.engine, head["id"], prompts, params)
    echo = None
    if req.echo:
        prompt_texts = [serving.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        echo = Echo(serving.texts, sub, prompt_texts, req.logprobs is not None)
    if req.stream:
        choice_of = partial(streamed_choice, serving.texts, sub, echo, req.logprobs)
        return stream_response(sub, head, req.stream_usage, choice_of)
    return await full_response(sub, request.is_disconnected, head,
                               partial(finished_choice, serving.texts, echo, req.logprobs))


@dataclass(slots=True)
class Echo:
    """What ``echo`` puts before each choice: its prompt's text and, with logprobs, the
    prompt's token logprobs (offsets from 0)."""

    texts: TokenTexts
    sub: Submission
    prompt_texts: list[str]  # one per prompt, as the tokenizer decodes it (special tokens kept)
    logprobs: bool

    def __call__(self, idx: int) -> tuple[str, dict | None]:
        c = self.sub.choices[idx]
        text = self.prompt_texts[idx // self.sub.n]
        if not self.logprobs:
            return text, None
        scores = c.prompt_logprobs or [None] * len(c.prompt_ids)
        return text, completion_logprobs(self.texts, scores, c.prompt_ids, 0)


def finished_choice(texts: TokenTexts, echo: Echo | None, logprobs: int | None, idx: int, c: Choice) -> dict:
    """A choice of the JSON body, from its finished ``Choice``."""
    prefix, prefix_lps = echo(idx) if echo is not None else ("", None)
    lps = None
    if logprobs is not None:
        lps = completion_logprobs(texts, c.logprobs, c.token_ids, len(prefix))
        if prefix_lps is not None:
            lps = joined(prefix_lps, lps)
    return {"index": idx, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def streamed_choice(texts: TokenTexts, sub: Submission, echo: Echo | None, logprobs: int | None, idx: int,
                    u: SeqUpdate) -> dict:
    """A chunk's choice, from one engine update; a choice's first chunk carries the echo.
    ``text_offset`` runs on across the chunks of a choice (kept on its ``Choice``)."""
    c = sub.choices[idx]
    text, lps, prefix = u.text, None, None
    if echo is not None and not c.started:
        prompt_text, prefix = echo(idx)
        text = prompt_text + text
        if prefix is not None:
            c.text_offset = sum(len(t) for t in prefix["tokens"])
    c.started = True
    if logprobs is not None:
        lps = completion_logprobs(texts, u.logprobs, u.token_ids, c.text_offset)
        c.text_offset += sum(len(t) for t in lps["tokens"])
        if prefix is not None:
            lps = joined(prefix, lps)
    return {"index": idx, "text": text, "logprobs": lps, "finish_reason": u.finish_reason,
            "stop_reason": u.stop_reason}
