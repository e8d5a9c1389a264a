"""How many prompt tokens a step that already holds decodes may add (the scheduler's default
mode; under ``--spyre-compat`` no step mixes the two: server/sched/spyre_compat.py).

The device runs a step padded up to its token bucket (a power of two), so a step of 32
decodes and a 128-token prompt would compute 256 rows for 160 tokens. When the buckets are
known, the prefill chunks of a step that holds decodes are cut to end on the largest bucket at
or below what the step wants (there 128: the prompt's other 32 tokens go in the next step,
which the decodes make anyway: 128 + 64 rows for the two steps instead of 256 + 32) when that
saves at least an eighth of the two steps' rows. A cut that saves less is not worth it: it
moves prompt tokens into a later step that also holds every decode, so every decoding stream
waits for prefill twice (a burst of 32 prompts beside 17 decodes under a 2,048 budget: 1,809
tokens cut to 1,007, then 487, 227, 73, four steps of stalled decodes, for 2,048 rows against
2,080). In a step without decodes the step takes what it wants and pads. With decodes in the
step, prefill takes at most ``max_prefill_with_decodes`` tokens once a stream in it is flowing
(has FLOWING_TOKENS output tokens), so that no such stream waits long for a prefill chunk (the
inter-token latency). Streams that have not got that far are the burst the prompts came in:
the first of 32 prompts arriving together decodes while the others are still arriving, and
capping the others' prefill for its sake made the burst a chunk per step beside every
earlier prompt's decodes (SmolLM2 bf16, 32 prompts: 37 steps, ITL p99 125-145 ms; uncapped,
two steps).
"""

from __future__ import annotations

from spyre_serve.models import bucket


def prefill_budget(sched, decoded: int, budget: int) -> int:
    """Prefill tokens for a step of ``sched`` (server.sched.scheduler.Scheduler) that already holds
    ``decoded`` decode tokens: the ``budget`` left, capped and cut as the module says."""
    if decoded and sched.max_prefill_with_decodes is not None and _flowing(sched):
        budget = min(budget, sched.max_prefill_with_decodes)
    if not sched.token_buckets or budget == 0 or decoded == 0:
        return budget               # without decodes, padding beats another step
    wanted = 0                      # prefill tokens the running and first waiting want
    for seq in sched.running:
        if sched.ready(seq):
            target, _ = sched.target(seq)
            if target - seq.num_computed > 1:
                wanted += target - seq.num_computed
    slots = sched.max_num_seqs - len(sched.running)
    for seq in sched.waiting:
        if slots == 0 or wanted >= budget:
            break
        target, _ = sched.target(seq)
        wanted += max(0, target - seq.num_computed)
        slots -= 1
    prefill = min(wanted, budget)
    floor = max((b for b in sched.token_buckets if b <= decoded + prefill), default=0)
    if floor <= decoded:
        return budget               # the cut would leave no prefill: pad
    def rows(n: int) -> int:       # what a step of n tokens computes (past the last bucket: n)
        return bucket(sched.token_buckets, n) if n <= sched.token_buckets[-1] else n

    whole = rows(decoded + prefill) + rows(decoded)               # this step padded, then decodes
    cut = floor + rows(decoded + prefill - (floor - decoded))     # the cut, then its remainder
    return floor - decoded if CUT_SAVES * cut <= (CUT_SAVES - 1) * whole else budget


CUT_SAVES = 8   # a cut must save at least 1 / CUT_SAVES of the rows of the two steps
FLOWING_TOKENS = 8   # output tokens after which a running stream's decodes cap prefill beside them


def _flowing(sched) -> bool:
    """Whether a running sequence has streamed FLOWING_TOKENS output tokens (known on the host)."""
    return any(seq.num_generated >= FLOWING_TOKENS for seq in sched.running)
