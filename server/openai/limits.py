"""The caps on one request, from the server's settings, checked before any work is done.

A body under ``--max-body-bytes`` can still ask for a lot: hundreds of thousands of
one-token prompts, each with ``n`` choices; stop strings searched on the engine thread
after every token, as many and as long as the client likes. So each is capped (vLLM has
no such caps; the defaults are set well above what real clients send): the prompts of a
completion (``--max-prompts``), ``n`` (``--max-n``), the stop strings' count and length
(``--max-stop-strings``, ``--max-stop-length``), ``stop_token_ids`` (``--max-stop-token-ids``),
and the request's sequences (prompts x n): more than the waiting queue holds
(``--max-waiting``) could never be admitted. Each refusal is a 400 naming the limit's flag.
Whether the queue has room now is the 503 of ``Serving.check_admission``.
"""

from __future__ import annotations

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.protocol import CompletionRequest, SamplingRequest
from spyre_serve.server.settings import Settings


def num_prompts(req: SamplingRequest) -> int:
    """How many prompts the request holds: a completion's list of strings or of token-id
    lists is one per item; a string, a token-id list or a chat is one."""
    prompt = req.prompt if isinstance(req, CompletionRequest) else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def check_limits(req: SamplingRequest, prompts: int, settings: Settings) -> None:
    """400 for the first cap ``req`` (with ``prompts`` prompts) goes over."""
    s = settings
    if prompts > s.max_prompts:
        raise APIError(400, f"prompt is a list of {prompts} prompts, the limit is {s.max_prompts} (--max-prompts)",
                       "prompt")
    if req.n > s.max_n:
        raise APIError(400, f"n must be at most {s.max_n}, got {req.n}", "n")
    stop = req.stop or []
    if len(stop) > s.max_stop_strings:
        raise APIError(400, f"stop has {len(stop)} strings, the limit is {s.max_stop_strings} "
                            f"(--max-stop-strings)", "stop")
    for i, text in enumerate(stop):
        if len(text) > s.max_stop_length:
            raise APIError(400, f"stop string {i} is {len(text)} characters long, the limit is "
                                f"{s.max_stop_length} (--max-stop-length)", "stop")
    ids = req.stop_token_ids or []
    if len(ids) > s.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids has {len(ids)} ids, the limit is {s.max_stop_token_ids} "
                            f"(--max-stop-token-ids)", "stop_token_ids")
    sequences = prompts * req.n
    if sequences > s.max_waiting:
        raise APIError(400, f"this request asks for {sequences} sequences ({prompts} prompts x n = {req.n}), "
                            f"more than the {s.max_waiting} the waiting queue holds (--max-waiting)", "n")
