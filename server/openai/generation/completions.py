"""``POST /v1/completions``: text completions (vLLM's fields), one JSON body or a stream.

Every prompt of a request gets ``n`` choices; a text prompt is encoded with the tokenizer's
special tokens unless ``add_special_tokens`` is false (vLLM's default: a Llama prompt starts
with BOS, and ``usage.prompt_tokens`` is what ``/tokenize`` counts). With ``echo`` a choice's text starts with its
prompt, and with ``logprobs`` too the prompt's tokens are scored (the first has none); a
stream sends the prompt in each choice's first chunk. ``prompt_logprobs`` (vLLM's; echo with
logprobs asks for them too) puts each prompt token's logprob, rank and top alternatives in the
choice (not in a stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Request

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.bridge import Choice, Submission
from spyre_serve.server.openai.generation.logprobs import (
    TokenTexts,
    completion_logprobs,
    joined,
    prompt_logprobs,
)
from spyre_serve.server.openai.generation.prompts import completion_prompts
from spyre_serve.server.openai.generation.protocol import CompletionRequest
from spyre_serve.server.openai.generation.reply import (
    encoded,
    full_response,
    new_head,
    stream_response,
)
from spyre_serve.server.openai.generation.response_bodies import GENERATION_RESPONSES
from spyre_serve.server.openai.generation.sampling import generation_params
from spyre_serve.server.openai.openapi import GENERATION_ERRORS, route
from spyre_serve.server.openai.request_id import request_ids
from spyre_serve.server.openai.serving import Serving, serving_of
from spyre_serve.server.sched.sequence import TokenLogprob
from spyre_serve.server.structured_output import request as structured

router = APIRouter()


@router.post("/v1/completions", **route(CompletionRequest, GENERATION_ERRORS, streams=True,
                    answers=GENERATION_RESPONSES["completions"]))
async def create_completion(request: Request):
    serving = serving_of(request)
    response_id, engine_id = request_ids(request, "cmpl")
    serving.check_admission(1)          # before the body is read: a full queue costs nothing
    req = await serving.read(request, CompletionRequest)
    serving.check_limits(req)
    prompts = await prompt_ids(serving, req)
    max_tokens = serving.max_tokens(req.max_tokens, prompts)
    echo_scored = req.echo and req.logprobs is not None
    # vLLM's prompt_logprobs, which echo with logprobs asks for too; a stream has none (0 passes, > 0 is a 400)
    shown = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if echo_scored else None
    shown = None if req.stream else shown
    params = generation_params(req, max_tokens, req.logprobs, prompt_logprobs=echo_scored or shown is not None,
                               vocab_size=serving.vocab_size, defaults=serving.defaults,
                               prompt_top=max((req.logprobs or 0) if echo_scored else 0, shown or 0))
    structured.apply(params, await structured.request_grammar(serving, req),
                     structured.logit_bias(req, serving.vocab_size))
    head = new_head("cmpl", "text_completion", serving.answered_as(req.model), serving.fingerprint, response_id)
    sub = serving.start(engine_id, prompts, params, model=req.model)
    echo = None
    if req.echo:
        echo = Echo(serving.texts, sub, echoed_texts(serving.tokenizer, req, prompts), req.logprobs)
    if req.stream:
        choice_of = partial(streamed_choice, serving.texts, sub, echo, req.logprobs)
        return stream_response(sub, head, req.stream_usage, choice_of)
    return encoded(await full_response(sub, request.is_disconnected, head,
                                       partial(finished_choice, serving.texts, echo, req.logprobs, shown)))


async def prompt_ids(serving: Serving, req: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids (a request within the caps: ``Serving.check_limits``;
    also /v1/completions/render's)."""
    texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
    serving.check_text_fits(texts, "prompt", req.truncate_prompt_tokens)
    return await serving.prompt_ids("tokenizing the prompt", "prompt", completion_prompts, serving.tokenizer,
                                    req.prompt, req.add_special_tokens, truncate=req.truncate_prompt_tokens)


def echoed_texts(tokenizer, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What ``echo`` repeats of each prompt, as vLLM does: a text prompt as it was sent (not
    the BOS the tokenizer added), token ids (or a truncated prompt) as they decode."""
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if req.truncate_prompt_tokens is None and all(isinstance(t, str) for t in texts):
        return list(texts)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


@dataclass(slots=True)
class Echo:
    """What ``echo`` puts before each choice: its prompt's text and, with logprobs, the
    prompt's token logprobs (offsets from 0)."""

    texts: TokenTexts
    sub: Submission
    prompt_texts: list[str]  # one per prompt (``echoed_texts``)
    logprobs: int | None  # the request's: top alternatives per token, None for no logprobs

    def __call__(self, idx: int) -> tuple[str, dict | None]:
        c = self.sub.choices[idx]
        text = self.prompt_texts[idx // self.sub.n]
        if self.logprobs is None:
            return text, None
        k = self.logprobs  # the card computed as many as prompt_logprobs asked, if more
        scores = [lp if lp is None else TokenLogprob(lp.token_id, lp.logprob, lp.top[:k])
                  for lp in (c.prompt_logprobs or [None] * len(c.prompt_ids))]
        return text, completion_logprobs(self.texts, scores, c.prompt_ids, 0)


def finished_choice(texts: TokenTexts, echo: Echo | None, logprobs: int | None, shown: int | None, idx: int,
                    c: Choice) -> dict:
    """A choice of the JSON body, from its finished ``Choice``; with ``shown`` (the request's
    prompt_logprobs) its prompt's logprobs too."""
    prefix, prefix_lps = echo(idx) if echo is not None else ("", None)
    lps = None
    if logprobs is not None:
        lps = completion_logprobs(texts, c.logprobs, c.token_ids, len(prefix))
        if prefix_lps is not None:
            lps = joined(prefix_lps, lps)
    choice = {"index": idx, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
    if shown is not None:
        choice["prompt_logprobs"] = prompt_logprobs(texts, c.prompt_logprobs or [None] * len(c.prompt_ids),
                                                    c.prompt_ids, shown)
    return choice


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
