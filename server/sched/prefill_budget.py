"""How many prompt tokens a step that already holds decodes may add (the scheduler's default
mode; under ``--spyre-compat`` no step mixes the two: server/sched/spyre_compat.py).

A step takes what its prompts want up to the budget: the device pads a step to its token
bucket but computes only the step's own rows (models/step/program.py), so a step is never cut
to end on a bucket (a cut only moved prompt tokens into a later step that also holds every
decode, so every decoding stream waited for prefill twice). With decodes in the step, prefill
takes at most ``max_prefill_with_decodes`` tokens once a stream in it is flowing (has
FLOWING_TOKENS output tokens), so that no such stream waits long for a prefill chunk (the
inter-token latency). Streams that have not got that far are the burst the prompts came in:
the first of 32 prompts arriving together decodes while the others are still arriving, and
capping the others' prefill for its sake made the burst a chunk per step beside every
earlier prompt's decodes (SmolLM2 bf16, 32 prompts: 37 steps, ITL p99 125-145 ms; uncapped,
two steps).
"""

from __future__ import annotations

FLOWING_TOKENS = 8   # output tokens after which a running stream's decodes cap prefill beside them


def prefill_budget(sched, decoded: int, budget: int) -> int:
    """Prefill tokens for a step of ``sched`` (server.sched.scheduler.Scheduler) that already holds
    ``decoded`` decode tokens: the ``budget`` left, capped as the module says."""
    if decoded and sched.max_prefill_with_decodes is not None and _flowing(sched):
        return min(budget, sched.max_prefill_with_decodes)
    return budget


def _flowing(sched) -> bool:
    """Whether a running sequence has streamed FLOWING_TOKENS output tokens (known on the host)."""
    return any(seq.num_generated >= FLOWING_TOKENS for seq in sched.running)
