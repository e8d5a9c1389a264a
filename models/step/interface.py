"""What crosses the runner's boundary: one SeqWork per sequence in, one StepOutput out.

The scheduler's decisions arrive as a list of SeqWork (each with its SamplingParams); the
step's results leave as one StepOutput. These are the only types the server builds or reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KMAX = 20  # most top logprobs per sampled token (vLLM's default max_logprobs; OpenAI's chat top_logprobs)
MAX_LOGPROBS = KMAX
INT32_MAX = 2**31 - 1             # the step's integer fields (top_k, token ids, ...) are int32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)   # its real ones are float32
LOGIT_BIAS_MAX = 100.0            # OpenAI's and vLLM's range of a logit_bias value


class ParamError(ValueError):
    """A sampling parameter the step cannot take: `field` names it, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SeqWorkError(ValueError):
    """Work items a launch refuses: `reasons` maps each one's seq_id to why (`seq_ids` are
    its keys); the rest of the step is not at fault."""

    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__("; ".join(reasons.values()))
        self.reasons = dict(reasons)
        self.seq_ids = tuple(reasons)


def _real(name: str, value, low: float, high: float, interval: str) -> None:
    """ParamError unless value is a number in [low, high] that float32 holds (finite)."""
    if not (isinstance(value, (int, float, np.number)) and math.isfinite(value)
            and low <= value <= high and abs(value) <= FLOAT32_MAX):
        raise ParamError(name, f"{name} must be a finite number in {interval}, got {value!r}")


def _integer(name: str, value, low: int, high: int, meaning: str = "") -> None:
    """ParamError unless value is an integer in [low, high]."""
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and low <= value <= high):
        raise ParamError(name, f"{name} must be an integer in {low}..{high}{meaning}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0      # 0 -> greedy
    top_k: int = 0                # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    top_n_sigma: float = -1.0     # llama.cpp's: keep logits >= max - n * std; <= 0 -> off
    seed: int | None = None       # None -> the runner derives one for the request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = 0             # top-n alternatives per sampled token (0..20)
    logit_bias: dict[int, float] | None = None   # OpenAI's: token id -> bias in [-100, 100],
                                                 # added to its logit before the penalties

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def check(self) -> None:
        """ParamError (a ValueError naming the field) unless every value fits the step's
        int32/int64/float32 fields and means something."""
        _real("temperature", self.temperature, 0.0, FLOAT32_MAX, "[0, 3.4e38]")
        _integer("top_k", self.top_k, 0, INT32_MAX, " (0 = off)")
        _real("top_p", self.top_p, 0.0, 1.0, "(0, 1]")
        if not np.float32(self.top_p) > 0.0:     # 5e-324 is > 0, but 0 on the card
            raise ParamError("top_p", f"top_p must be in (0, 1] as a float32, got {self.top_p!r}")
        _real("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        _real("top_n_sigma", self.top_n_sigma, -FLOAT32_MAX, FLOAT32_MAX, "float32's range")
        if self.seed is not None:
            _integer("seed", self.seed, INT64_MIN, INT64_MAX)
        _real("presence_penalty", self.presence_penalty, -FLOAT32_MAX, FLOAT32_MAX, "float32's range")
        _real("frequency_penalty", self.frequency_penalty, -FLOAT32_MAX, FLOAT32_MAX, "float32's range")
        _real("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX, "(0, 3.4e38]")
        if not np.float32(self.repetition_penalty) > 0.0:
            raise ParamError("repetition_penalty", f"repetition_penalty must be > 0 as a float32, "
                             f"got {self.repetition_penalty!r}")
        _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for token, bias in (self.logit_bias or {}).items():
            _integer("logit_bias", token, 0, INT32_MAX, " (a token id)")
            _real("logit_bias", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX, "[-100, 100]")


@dataclass(slots=True)
class SeqWork:                    # one sequence's share of a step
    seq_id: int
    token_ids: list[int]          # tokens computed this step (prefill chunk, or 1 decode token)
    start_pos: int                # tokens of this sequence already in the KV cache
    block_table: list[int]        # covers start_pos + len(token_ids)
    sample: bool                  # chunk reaches the last known token: sample the next one
    sampling: SamplingParams
    num_generated: int = 0        # tokens generated so far: the RNG counter for seeded sampling
    from_device: bool = False     # decode token is the one this seq sampled in the previous launch
    prompt_logprobs: bool = False # return logprobs of this chunk's prompt tokens (echo)
    num_prompt: int | None = None # prompt length, needed when sampling has penalties: tokens at
                                  # positions below it count as the prompt's, the others as output
    banned_token_ids: list[int] | None = None   # tokens this step's sample may not pick (the
                                                # server's min_tokens: EOS and stop tokens)
    token_mask: np.ndarray | None = None        # int32[ceil(V/32)]: the only tokens this step's
                                                # sample may pick (a grammar's bitmask, bit t%32
                                                # of word t//32), or None
    pool: bool = False            # an embedding: the whole prompt in this chunk, pooled (a
                                  # pooling runner's work; it samples nothing)
    num_draft: int = 0            # speculative decoding: the last num_draft of token_ids are
                                  # proposed tokens; each of the last num_draft + 1 rows samples
                                  # (row j as output token num_generated + j), and the step keeps
                                  # the samples up to the first that differs from its proposal
    lora: str | None = None       # the LoRA adapter its rows run with (registered in the
                                  # runner's `lora` arena), None: the base model


@dataclass
class StepOutput:
    seq_ids: list[int]            # the sequences that sampled, in order
    token_ids: np.ndarray         # int32[NS]: one per sampling row (row i is seq_ids[i]'s unless
                                  # a sequence had proposals: see `first_rows`)
    logprobs: np.ndarray          # float32[NS], logprob of the sampled token (raw distribution)
    top_ids: np.ndarray           # int32[NS, K]   K = max logprobs asked in the step (0 if none)
    top_logprobs: np.ndarray      # float32[NS, K]
    prompt_logprobs: dict = field(default_factory=dict)
    # seq_id -> (float32[n], int32[n, K], float32[n, K], int32[n]): logprob of each prompt
    # token at position >= 1 computed in this step (the first token of a later chunk is scored
    # by the previous chunk's last row, so results must be read in launch order), its top-K,
    # and its rank (models/step/prompt_logprobs.py `of_chunk`).
    logits: dict | None = None    # seq_id -> float32[n, V] of every row, when launch(return_logits=True)
    pooled: np.ndarray | None = None   # a pooling runner's: float32[S, H], one row per seq_ids entry
    first_rows: list[int] | None = None  # with proposals (SeqWork.num_draft): each seq_ids entry's
    accepted: list[int] | None = None    # first sampling row, and how many of its rows it keeps

    def rows_of(self, i: int) -> range:
        """The sampling rows seq_ids[i] keeps, in order: one, or its accepted speculation."""
        if self.first_rows is None:
            return range(i, i + 1)
        return range(self.first_rows[i], self.first_rows[i] + self.accepted[i])

