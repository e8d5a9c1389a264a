"""The text and stop state of each sequence, kept by one object (vLLM v1's OutputProcessor):
the scheduler owns a sequence's tokens and blocks, this its detokenizer, grammar matcher,
logprobs and timing. The engine calls `start` when a sequence arrives and `on_token` for every
token the scheduler has appended; `on_token` returns why the sequence stops, or None; `on_pooled`
keeps an embedding's vector; `on_step` counts a step it took part in into its time on a real card.
"""

from __future__ import annotations

from collections.abc import Callable

from spyre_serve.models import IncrementalDetokenizer
from spyre_serve.server.engine.open_requests import EngineRequest
from spyre_serve.server.engine.outputs import RequestFault, token_logprob
from spyre_serve.server.engine.stats import EngineObserver, ProjectedTimes, time_token
from spyre_serve.server.engine.stopping import check_stop
from spyre_serve.server.sched.sequence import Sequence
from spyre_serve.server.structured_output.grammars import grammar_stop


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int,
                 observer: Callable[[], EngineObserver], requests: dict[str, EngineRequest]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._observer = observer
        self._requests = requests

    def start(self, seq: Sequence) -> None:
        """A new sequence: its detokenizer, and its grammar's matcher when it has one."""
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids,
                                           skip_special_tokens=seq.params.skip_special_tokens)
        if seq.params.grammar is not None:
            seq.matcher = seq.params.grammar.matcher()

    def on_token(self, seq: Sequence, out, i: int, now: float) -> tuple | None:
        """The scheduler has added the token of ``out``'s row ``i`` to ``seq``: time it, keep its
        logprobs, detokenize it and check the stop conditions (the grammar's too); returns the
        stop (reason, detail) or None."""
        token = seq.token_ids[-1]
        time_token(self._observer(), self._requests[seq.request_id], seq, now)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(token_logprob(out, i, token, seq.params.logprobs))
        stop = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
        # a matcher whose mask could not be made (llguidance gave up) failed whatever was sampled
        if seq.matcher is not None and (stop is None or seq.matcher.failed):
            stop = grammar_stop(seq, token) or stop
            if stop is not None and stop[0] == "error":      # the grammar gave up: the request's fault
                stop = "error", RequestFault(stop[1])
        return stop

    def on_tokens(self, seq: Sequence, out, rows: range, now: float, keep) -> tuple[tuple | None, int]:
        """The token of ``out``'s first row of ``rows`` was added to ``seq``, and the others are its
        kept proposals (speculative decoding): ``keep(seq, token)`` adds each while the sequence
        goes on and is not stopped. Returns the stop (or None) and the tokens taken."""
        stop, n = self.on_token(seq, out, rows[0], now), 1
        while stop is None and n < len(rows) and keep(seq, int(out.token_ids[rows[n]])):
            stop, n = self.on_token(seq, out, rows[n], now), n + 1
        return stop, n

    def on_step(self, seq: Sequence, seconds: float | None) -> None:
        """``seq`` took part in a step read back (its token kept, if it sampled) that takes
        ``seconds`` on a real card (None: not projected): counted toward its projected TTFT up to
        and including its first token (call it before ``on_token``), then toward its later steps."""
        if seconds is not None:
            seq.projected = (seq.projected or ProjectedTimes()).after(seconds, seq.first_token_time is not None)

    def on_pooled(self, seq: Sequence, out, i: int, now: float) -> None:
        """``seq``'s whole prompt was pooled into ``out``'s row ``i`` (an embedding): keep it, timed
        as a first token."""
        time_token(self._observer(), self._requests[seq.request_id], seq, now)
        seq.embedding = out.pooled[i].copy()
