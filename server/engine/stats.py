"""What the engine counts and times: ``EngineStats`` (steps, failures, how busy the device
was, finish reasons) and the ``EngineObserver`` hooks the metrics implement
(``server/metrics.py``), fed per request and per token; and each step's and sequence's time on
a real card (``projected_of``, ``ProjectedTimes``: models/sizing/projection.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple


class EngineObserver:
    """Metrics hooks; the default does nothing (server/metrics.py implements them)."""

    def on_scheduled(self, queue_seconds: float, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_finished(self, reason: str, e2e_seconds: float) -> None: ...
    def on_step(self, num_tokens: int) -> None: ...  # a step launched with this many tokens
    def on_request_params(self, max_tokens: int) -> None: ...  # a request closed: its max_tokens
    def on_projected_step(self, seconds: float) -> None: ...  # a step launched: its real card's time


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    failed_steps: int = 0
    busy_wall_seconds: float = 0.0  # wall time while the engine had work
    busy_device_seconds: float = 0.0  # device compute time in those periods
    tokens_discarded: int = 0  # sampled for sequences that had already stopped
    finished: dict = field(default_factory=dict)
    spec_drafts: int = 0  # decodes read back with proposed tokens (speculative decoding)
    spec_draft_tokens: int = 0  # tokens those proposed
    spec_accepted_tokens: int = 0  # of them, kept (each equal to the sample at its row)

    def count_proposals(self, proposed: int, accepted: int) -> None:
        """A decode with ``proposed`` tokens was read back and ``accepted`` of them kept."""
        if proposed:
            self.spec_drafts += 1
            self.spec_draft_tokens += proposed
            self.spec_accepted_tokens += accepted

    @property
    def device_busy_fraction(self) -> float:
        if self.busy_wall_seconds <= 0:
            return 0.0
        return min(1.0, self.busy_device_seconds / self.busy_wall_seconds)

    def add_busy(self, wall_since: float, device_since: float, card) -> None:
        """An iteration that had work, begun at ``wall_since`` (``time.perf_counter``) when
        the card had computed ``device_since`` seconds (``device_seconds``)."""
        self.busy_wall_seconds += time.perf_counter() - wall_since
        self.busy_device_seconds += device_seconds(card) - device_since

    def count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def device_seconds(card) -> float:
    """The card's compute time so far (0 without a card)."""
    if card is None:
        return 0.0
    return float(card.counters["compute_seconds"])


def time_token(observer: EngineObserver, req, seq, now: float) -> None:
    """A token of ``seq`` (of request ``req``) arrived at ``now``: time to first token of
    the request, or the gap since the sequence's last token."""
    if seq.first_token_time is None:
        seq.first_token_time = now
        if req.first_token is None:
            req.first_token = now
            observer.on_first_token(now - req.arrival)
    elif seq.last_token_time is not None:
        observer.on_token_gap(now - seq.last_token_time)
    seq.last_token_time = now


class ProjectedTimes(NamedTuple):
    """A sequence's steps on a real card (each launch's ``projected_seconds``): those up to and
    including its first token, those after it, and how many after it. Immutable: an update
    carries the one it was made with."""

    ttft: float = 0.0
    later: float = 0.0
    later_steps: int = 0

    def after(self, seconds: float, first_token_seen: bool) -> ProjectedTimes:
        """These times with one more step of ``seconds``: a later one once the first token was seen."""
        if first_token_seen:
            return ProjectedTimes(self.ttft, self.later + seconds, self.later_steps + 1)
        return ProjectedTimes(self.ttft + seconds, self.later, self.later_steps)


def projected_of(handle, observer: EngineObserver) -> float | None:
    """A launched step's seconds on a real card (its handle's ``projected_seconds``: a
    ``models.ModelRunner`` step's; None from a runner that projects nothing), reported to
    ``observer``."""
    seconds = getattr(handle, "projected_seconds", None)
    if seconds is not None:
        observer.on_projected_step(seconds)
    return seconds
