"""What crosses the runner's boundary: one SeqWork per sequence in, one StepOutput out.

The scheduler's decisions arrive as a list of SeqWork (each with its SamplingParams); the
step's results leave as one StepOutput. These are the only types the server builds or reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from models.step_program import KMAX

MAX_LOGPROBS = KMAX


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0      # 0 -> greedy
    top_k: int = 0                # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None       # None -> the runner derives one for the request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = 0             # top-n alternatives per sampled token (0..5)

    def check(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")


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
    penalty_token_ids: list[int] | None = None  # tokens counted by the penalties
    banned_token_ids: list[int] | None = None   # tokens this step's sample may not pick (the
                                                # server's min_tokens: EOS and stop tokens)


@dataclass
class StepOutput:
    seq_ids: list[int]            # the sequences that sampled, in order
    token_ids: np.ndarray         # int32[S]
    logprobs: np.ndarray          # float32[S], logprob of the sampled token (raw distribution)
    top_ids: np.ndarray           # int32[S, K]   K = max logprobs asked in the step (0 if none)
    top_logprobs: np.ndarray      # float32[S, K]
    prompt_logprobs: dict = field(default_factory=dict)
    # seq_id -> (float32[n], int32[n, K], float32[n, K]): logprob of each prompt token at
    # position >= 1 computed in this step (the first token of a later chunk is scored by the
    # previous chunk's last row, so results must be read in launch order), and its top-K.
    logits: dict | None = None    # seq_id -> float32[n, V] of every row, when launch(return_logits=True)

