"""Speculative decoding (`--speculative-config`, vLLM's JSON): which tokens to propose.

    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    spec = Speculator(config, max_model_len)
    spec.propose(seq, most)          # tokens to verify after seq's last known one, or []

A proposal rides in the sequence's decode (`ScheduledChunk.draft`): the step computes the
known last token and the proposed ones, every row samples, and the runner keeps the samples up
to the first that differs from the proposal (models/step/runner.py `accepted_counts`). Each row
draws with the RNG counter of the output token it stands for, so the output is exactly what
one token a step gives, greedy or sampled (no rejection sampling needed: the proposals are
one-hot, and a row's draw does not depend on what was proposed).

The `ngram` method is prompt lookup (vLLM's): the longest suffix of the known tokens, of
`prompt_lookup_min`..`prompt_lookup_max` tokens, that occurred before; the tokens that followed
its latest earlier occurrence are proposed. Sequences whose next tokens depend on state a
proposal would advance are not proposed for: penalties (the card counts tokens), a grammar,
logit_bias, bans (`min_tokens` not reached yet), and no proposal is made while more than
`disable_by_batch_size` sequences run (vLLM's key; a full batch gains little from proposals
and loses the step overlap: a proposing sequence waits for its last token on the host). After a
lookup that finds nothing, a sequence's next decode keeps the overlap, and the one after looks again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:      # settings import this module: no model (and so no kernel) imported here
    from spyre_serve.server.sched.sequence import Sequence

METHODS = ("ngram", "draft_model")
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "model"}
DEFAULT_LOOKUP = 5          # vLLM's: both lookup bounds 5 when neither is given
DEFAULT_DISABLE_BY_BATCH = 16  # ours (vLLM: none): more running sequences than this: no proposals
# (SmolLM2 quoting its prompt, benchmarks/speculative.py: proposals at 8 running are 1.35x the
# tokens/s; at 32 1.03x, but ITL p99 2.5x: a proposing sequence gives up the step overlap)


class SpeculativeConfigError(ValueError):
    """A --speculative-config the server cannot take: the message names the key."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH
    model: str | None = None    # draft_model: its checkpoint (the same tokenizer as the served one)

    @classmethod
    def parse(cls, text: str | dict) -> SpeculativeConfig:
        """The config of a JSON object (vLLM's keys); SpeculativeConfigError naming what is wrong."""
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"--speculative-config must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - KEYS)
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown keys {unknown} (known: {sorted(KEYS)})")
        method = raw.get("method", "ngram" if "model" not in raw else "draft_model")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config: method {method!r} is not supported; "
                                         f"supported: {list(METHODS)}")
        model = raw.get("model")
        if (method == "draft_model") != isinstance(model, str) or model == "":
            raise SpeculativeConfigError(f"--speculative-config: method {method!r} "
                                         f"{'needs' if method == 'draft_model' else 'takes no'} \"model\" "
                                         f"(a draft checkpoint), got {model!r}")
        k = _positive(raw, "num_speculative_tokens", None)
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo = _positive({"prompt_lookup_min": hi if lo is None else lo}, "prompt_lookup_min", None)
        hi = _positive({"prompt_lookup_max": lo if hi is None else hi}, "prompt_lookup_max", None)
        if lo > hi:
            raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min ({lo}) exceeds "
                                         f"prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi, _positive(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH), model)


def _positive(raw: dict, key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SpeculativeConfigError(f"--speculative-config: {key} must be a positive integer, got {value!r}")
    return value


def can_propose(seq: Sequence) -> bool:
    """Whether proposals can be verified for ``seq`` (no per-token state they would advance)."""
    p = seq.params
    return (p.grammar is None and not p.uses_penalties and not p.sampling.logit_bias
            and not p.pooling and seq.num_generated >= p.min_tokens)


def ngram_proposal(tokens: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (of ``lo``..``hi`` tokens) found before; [] when none occurs."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n:]
        # windows starting at 0..n_tok-n-1 (the suffix itself excluded), latest first
        starts = np.flatnonzero(tokens[:n_tok - n] == suffix[0])[::-1]
        for s in starts:
            if s + n < n_tok and np.array_equal(tokens[s:s + n], suffix):
                return tokens[s + n:s + n + k].tolist()
    return []


class Speculator:
    """What the scheduler asks for a decode: tokens to propose after the last known one."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # seq_id -> its output tokens when the lookup last found nothing: its next decode reads its
        # token on the card (the step overlap kept), the one after looks again
        self._missed: dict[int, int] = {}

    def proposes_for(self, seq: Sequence, num_running: int) -> bool:
        """Whether ``seq``'s decodes get proposals with ``num_running`` sequences running (then
        each waits for its last token on the host, instead of reading it on the card)."""
        return (num_running <= self.config.disable_by_batch_size and can_propose(seq)
                and seq.params.max_tokens - seq.num_generated_total > 1
                and self._missed.get(seq.seq_id) != seq.num_generated_total - 1)

    def most(self, seq: Sequence, most: int) -> int:
        """Tokens ``seq`` may be proposed: ``most``, within k, its positions and its max_tokens."""
        room = self.max_model_len - len(seq.token_ids)   # positions the proposals may take
        return max(0, min(most, self.config.num_speculative_tokens, room,
                          seq.params.max_tokens - seq.num_generated - 1))

    def prepare(self, seqs: list[Sequence]) -> None:
        """The sequences about to decode with proposals (a draft model computes theirs at once)."""

    def propose(self, seq: Sequence, most: int) -> list[int]:
        """At most ``most`` tokens to verify in ``seq``'s next decode (its last token known)."""
        c = self.config
        most = self.most(seq, most)
        if most <= 0:
            return []
        got = ngram_proposal(np.asarray(seq.token_ids, np.int64), most, c.prompt_lookup_min, c.prompt_lookup_max)
        if not got:
            self._missed[seq.seq_id] = seq.num_generated_total
        return got

    def forget(self, seq_id: int) -> None:
        """``seq_id`` ended or was preempted (what a draft model keeps for it goes)."""
        self._missed.pop(seq_id, None)


def speculator_for(settings, runner, draft_runner=None) -> Speculator | None:
    """The server's Speculator (--speculative-config; ``draft_runner``: the draft model's, on the
    same card), or None; ValueError for a runner that cannot verify proposals (a pooling one) or
    --spyre-compat (the plugin does not speculate)."""
    config = settings.speculative_config
    if config is None:
        return None
    if runner.pooling or settings.spyre_compat:
        raise ValueError("--speculative-config: speculative decoding needs a generating runner "
                         "without --spyre-compat (the vLLM Spyre plugin has none)")
    if config.method == "draft_model":
        from spyre_serve.server.spec_decode.draft_model import DraftSpeculator

        return DraftSpeculator(config, runner.max_model_len, draft_runner)
    return Speculator(config, runner.max_model_len)
