"""What a step's results add to a sequence, and the ``SeqUpdate`` the API layer receives:
the new tokens with their logprobs, the text not sent yet, the prompt's logprobs once, and
the finish reason when the sequence ends."""

from __future__ import annotations

from dataclasses import dataclass

from spyre_serve.server.engine.stats import ProjectedTimes
from spyre_serve.server.engine.step_work import ScheduledChunk
from spyre_serve.server.sched.sequence import Sequence, TokenLogprob


@dataclass(slots=True)
class SeqUpdate:
    """What one step added to one sequence, as handed to the API layer."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per new token when logprobs were asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, for echo + logprobs
    error: str | None = None
    embedding: object | None = None  # float32[H]: an embedding request's vector, with its finish
    projected: ProjectedTimes | None = None  # its steps on a real card so far (None: not projected)


class RequestFault(str):
    """The message of a choice that failed because of what its request asked for (its grammar
    could not go on): the API answers it as a 400 with the message, not as a 500 naming a
    request id. A ``str``, so it crosses the engine process's pipe as one."""


def error_update(index: int, message: str) -> SeqUpdate:
    """The last update of a choice that ends with an error (``message``: what failed)."""
    return SeqUpdate(index, "", [], [], "error", None, None, message)


def token_logprob(out, i: int, token: int, num_top: int) -> TokenLogprob:
    """The logprob of ``token``, sampled in row ``i`` of the step output ``out``, and up to
    ``num_top`` of the row's top alternatives."""
    k = min(num_top, out.top_ids.shape[1]) if out.top_ids.ndim == 2 else 0
    top = [(int(out.top_ids[i, j]), float(out.top_logprobs[i, j])) for j in range(k)]
    return TokenLogprob(token, float(out.logprobs[i]), top)


def store_prompt_logprobs(c: ScheduledChunk, scores) -> None:
    """Keep the prompt logprobs the runner returned for chunk ``c`` on its sequence:
    ``scores`` is (logprobs, top ids, top logprobs, ranks), one row per scored position."""
    lps, top_ids, top_lps, ranks = scores
    n = len(lps)
    # entry k scores the token at position first + k: token_ids[1:] of the chunk,
    # plus the previous chunk's last (position start) when the runner returns one more
    first = c.start + 1 if n <= c.num_new - 1 else c.start
    seq = c.seq
    for k in range(n):
        pos = first + k
        if 0 < pos < seq.num_prompt:
            top = [(int(top_ids[k, j]), float(top_lps[k, j])) for j in range(top_ids.shape[1])]
            seq.prompt_logprobs[pos] = TokenLogprob(seq.token_ids[pos], float(lps[k]), top, int(ranks[k]))


def take_update(seq: Sequence) -> SeqUpdate | None:
    """What ``seq`` has that was not sent yet, marked as sent; None when there is nothing."""
    new_ids = seq.output_ids[seq.num_tokens_sent :]
    new_lps = seq.output_logprobs[seq.num_tokens_sent :] if seq.params.logprobs is not None else []
    text = seq.take_text()
    prompt_lps = None
    if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
        if seq.is_finished or all(lp is not None for lp in seq.prompt_logprobs[1:]):
            prompt_lps = list(seq.prompt_logprobs)
            seq.prompt_logprobs_sent = True
    if not (new_ids or text or seq.is_finished or prompt_lps is not None):
        return None
    seq.num_tokens_sent = seq.num_generated
    return SeqUpdate(
        index=seq.index,
        text=text,
        token_ids=new_ids,
        logprobs=new_lps,
        finish_reason=seq.finish_reason if seq.is_finished else None,
        stop_reason=seq.stop_reason if seq.is_finished else None,
        prompt_logprobs=prompt_lps,
        error=seq.error,
        embedding=seq.embedding if seq.is_finished else None,
        projected=seq.projected,
    )
