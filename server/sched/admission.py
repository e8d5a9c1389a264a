"""What a request must satisfy to be queued: everything a step could not hold is refused
up front (``RequestRejected``, HTTP 400 naming the field), so that a bad value never
reaches the runner and fails the other requests of its step."""

from __future__ import annotations

from spyre_serve.models import INT32_MAX, MAX_LOGPROBS, ParamError
from spyre_serve.server.sched.sequence import GenerationParams


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the context or the cache, or
    a value the step cannot hold): HTTP 400, ``param`` naming the field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_lengths(num_prompt_tokens: int, max_tokens: int, *, max_model_len: int,
                  num_kv_blocks: int, block_size: int) -> None:
    """The prompt and the completion fit the context and the whole KV cache."""
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise RequestRejected(f"max_tokens must be an integer >= 0, got {max_tokens!r}", "max_tokens")
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty: give at least one token", "prompt")
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            "max_tokens" if max_tokens else "prompt",
        )
    capacity = num_kv_blocks * block_size
    if total > capacity:
        raise RequestRejected(
            f"The KV cache holds {capacity} tokens ({num_kv_blocks} blocks of "
            f"{block_size}). However, you requested {total} tokens "
            f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion).",
            "max_tokens" if max_tokens else "prompt",
        )


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """Token ids the embedding can read: 0..V-1."""
    high = vocab_size - 1
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t <= high)), None)
    if bad is not None:
        raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary (0..{high})", "prompt")


def check_params(params: list[GenerationParams]) -> None:
    """Each choice's values against what a step holds: the sampling parameters
    (``SamplingParams.check``: int32 top_k, int64 seed, float32-finite reals), logprobs,
    min_tokens within max_tokens, stop token ids that are int32 ids."""
    if not params:
        raise RequestRejected("a request needs at least one choice (n >= 1)", "n")
    for p in params:
        try:
            p.sampling.check()
        except ParamError as exc:
            raise RequestRejected(str(exc), exc.field) from None
        if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= MAX_LOGPROBS):
            raise RequestRejected(f"logprobs must be in 0..{MAX_LOGPROBS}, got {p.logprobs!r}", "logprobs")
        if not (isinstance(p.min_tokens, int) and 0 <= p.min_tokens <= p.max_tokens):
            raise RequestRejected(f"min_tokens must be in 0..max_tokens ({p.max_tokens}), got "
                                  f"{p.min_tokens!r}", "min_tokens")
        bad = next((t for t in p.stop_token_ids if not (isinstance(t, int) and 0 <= t <= INT32_MAX)), None)
        if bad is not None:
            raise RequestRejected(f"stop_token_ids: {bad!r} is not a token id (0..{INT32_MAX})",
                                  "stop_token_ids")


def check_request(limits, num_prompt_tokens: int, max_tokens: int,
                  params: list[GenerationParams] | None = None, prompt_ids: list[int] | None = None) -> None:
    """Everything above for an engine whose sizes ``limits`` has (``max_model_len``,
    ``num_kv_blocks``, ``block_size``, ``vocab_size``: the engine, or its client in another
    process); ``params`` and ``prompt_ids`` when given."""
    check_lengths(num_prompt_tokens, max_tokens, max_model_len=limits.max_model_len,
                  num_kv_blocks=limits.num_kv_blocks, block_size=limits.block_size)
    if prompt_ids is not None:
        check_prompt_ids(prompt_ids, limits.vocab_size)
    if params is not None:
        check_params(params)
