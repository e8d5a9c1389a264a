"""An OpenAI request's sampling fields as the engine's ``GenerationParams``, one per choice.

OpenAI's unset values become the engine's neutral ones (temperature 1, no top-k, top-p 1,
min-p 0), and so does a top-k at least the vocabulary's size (it keeps every token, as
off does: vLLM takes any top-k, the step program an int32); choice ``i`` of a seeded request
gets seed ``seed + i`` (wrapped to 64 bits), so the ``n`` choices differ and each is
reproducible.
"""

from __future__ import annotations

from models import SamplingParams
from server.openai.protocol import INT64, SamplingRequest
from server.sequence import GenerationParams


def generation_params(req: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: bool,
                      vocab_size: int) -> list[GenerationParams]:
    """``req.n`` choices' parameters (``limits.check_limits`` has held ``n`` to ``--max-n``).
    ``logprobs``: None for none, else how many top alternatives each token lists."""
    top_k = max(0, req.top_k or 0)
    if top_k >= vocab_size:
        top_k = 0
    out = []
    for i in range(req.n):
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else seed_of_choice(req.seed, i),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logprobs=logprobs or 0,
        )
        out.append(
            GenerationParams(
                sampling=sampling,
                max_tokens=max_tokens,
                min_tokens=min(req.min_tokens, max_tokens),
                stop=list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )
    return out


def seed_of_choice(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, wrapped into the 64-bit range the seed came in."""
    return (seed + i - INT64[0]) % 2**64 + INT64[0]
