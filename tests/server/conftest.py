"""Shared fixtures for server tests."""

from __future__ import annotations

import dataclasses

import models

# Until models/ exports the runner's dataclasses, define them from docs/interfaces.md
# so the scheduler and engine can be unit-tested against the fake runner.
if not hasattr(models, "SeqWork"):  # pragma: no cover - removed once models/ lands

    @dataclasses.dataclass(slots=True)
    class SamplingParams:
        temperature: float = 1.0
        top_k: int = 0
        top_p: float = 1.0
        min_p: float = 0.0
        seed: int | None = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        repetition_penalty: float = 1.0
        logprobs: int = 0

    @dataclasses.dataclass(slots=True)
    class SeqWork:
        seq_id: int
        token_ids: list
        start_pos: int
        block_table: list
        sample: bool
        sampling: SamplingParams
        num_generated: int = 0
        from_device: bool = False
        prompt_logprobs: bool = False
        penalty_token_ids: list | None = None

    @dataclasses.dataclass
    class StepOutput:
        seq_ids: list
        token_ids: object
        logprobs: object
        top_ids: object
        top_logprobs: object
        prompt_logprobs: dict

    models.SamplingParams = SamplingParams
    models.SeqWork = SeqWork
    models.StepOutput = StepOutput
