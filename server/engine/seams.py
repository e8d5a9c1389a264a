"""What the engine needs of the runner beside it, typed (vLLM's SchedulerInterface does the same
for its scheduler): `models.ModelRunner` is one, the tests' `FakeRunner` another. The engine
reads nothing else of a runner; a runner missing one of these fails at the engine's
construction, not at the first request that needs it.
"""

from __future__ import annotations

from typing import Protocol

from spyre_serve.models.step.interface import SeqWork, StepOutput


class ModelShape(Protocol):
    """The model facts the engine checks requests against."""

    vocab_size: int
    eos_token_id: int | list[int] | None


class PendingStep(Protocol):
    """A launched step: `result()` waits for its readback."""

    def result(self) -> StepOutput: ...


class StepRunner(Protocol):
    """Launches one step per call; remembers per-sequence state until `forget`."""

    config: ModelShape
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    t_buckets: list[int] | None   # the token counts a step is padded to (None: any)
    numerics: str                 # what a step computes with (responses' system_fingerprint)
    pooling: tuple[str, bool] | None   # (type, normalize): an embedding model pools, else None

    def launch(self, work: list[SeqWork]) -> PendingStep: ...

    def forget(self, seq_id: int) -> None: ...


def _members(protocol: type) -> list[str]:
    """A Protocol's attributes and methods, as declared above."""
    return [*protocol.__annotations__,
            *(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))]


def check_runner(runner: object) -> StepRunner:
    """`runner`, once it has every member of StepRunner (TypeError naming the missing)."""
    missing = [n for n in _members(StepRunner) if not hasattr(runner, n)]
    missing += [f"config.{n}" for n in _members(ModelShape)
                if hasattr(runner, "config") and not hasattr(runner.config, n)]
    if missing:
        raise TypeError(f"{type(runner).__name__} is not a StepRunner: it lacks {missing}")
    return runner  # type: ignore[return-value]
