"""How many prompt tokens a step that already holds decodes may add (the scheduler's default
mode; under ``--spyre-compat`` no step mixes the two: server/sched/spyre_compat.py).

The device runs a step padded up to its token bucket (a power of two), so a step of 32
decodes and a 128-token prompt would compute 256 rows for 160 tokens. When the buckets are
known, the prefill chunks of a step are cut to end on the largest bucket at or below what
the step wants (there 128: the prompt's other 32 tokens go in the next step, which the
decodes make anyway), as long as that keeps at least half of the step's prefill; otherwise,
and in a step without decodes, the step takes what it wants and pads. With decodes in the
step, prefill takes at most ``max_prefill_with_decodes`` tokens, so that no decode waits long
for a prefill chunk (the inter-token latency; vLLM's chunked prefill bounds it the same way).
"""

from __future__ import annotations


def prefill_budget(sched, decoded: int, budget: int) -> int:
    """Prefill tokens for a step of ``sched`` (server.sched.scheduler.Scheduler) that already holds
    ``decoded`` decode tokens: the ``budget`` left, capped and cut as the module says."""
    if decoded and sched.max_prefill_with_decodes is not None:
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
    # cut only while the step keeps at least half of its prefill: 31 decodes beside a
    # 27-token remainder pad to 64 rather than trickle one token a step into bucket 32
    return floor - decoded if 2 * (floor - decoded) >= prefill else budget
