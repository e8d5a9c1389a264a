"""The engine's two seams, typed.

Below it, what the engine needs of the runner beside it (``StepRunner``; vLLM's
SchedulerInterface does the same for its scheduler): `models.ModelRunner` is one, the tests'
`FakeRunner` another. The engine reads nothing else of a runner; a runner missing one of these
fails at the engine's construction, not at the first request that needs it.

Above it, what the API layer asks of an engine (``EngineClient``): the in-process ``Engine``
(server/engine/core.py) and the engine process's client (``EngineProcessClient``,
server/engine/client.py) both satisfy it, and ``Serving`` holds one of them, typed so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from spyre_serve.models import SeqWork, StepOutput

if TYPE_CHECKING:
    from spyre_serve.server.engine.outputs import SeqUpdate
    from spyre_serve.server.sched.sequence import GenerationParams


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
    numerics: str                 # what a step computes with (responses' system_fingerprint)
    pooling: tuple[str, bool] | None   # (type, normalize): an embedding model pools, else None

    def launch(self, work: list[SeqWork]) -> PendingStep: ...

    def forget(self, seq_id: int) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the API layer sees it: its sizes, its counts, and requests in and out. Each
    request's updates come back through the ``on_update`` it was added with."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] | list[int]
    numerics: str                        # what a step computes with (system_fingerprint)
    pooling: tuple[str, bool] | None     # an embedding model's (type, normalize), else None
    accepting: bool                      # false while draining for shutdown
    error: BaseException | None          # why the engine died, once it has
    on_death: Callable[[BaseException], None] | None

    @property
    def alive(self) -> bool: ...

    @property
    def num_requests(self) -> int: ...

    @property
    def num_running_requests(self) -> int: ...

    @property
    def num_waiting_requests(self) -> int: ...

    @property
    def num_waiting_sequences(self) -> int: ...

    def check_request(self, num_prompt_tokens: int, max_tokens: int,
                      params: list[GenerationParams] | None = None,
                      prompt_ids: list[int] | None = None) -> None: ...

    def add_request(self, request_id: str, prompt_ids: list[int], params: list[GenerationParams],
                    on_update: Callable[[SeqUpdate], None]) -> None: ...

    def abort(self, request_id: str) -> None: ...

    async def lora_update(self, op: str, name: str, path: str | None) -> tuple[int, str] | None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


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
