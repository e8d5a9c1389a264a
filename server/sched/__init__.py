"""Scheduling: which sequences compute which tokens in the next step, in which KV blocks.

    scheduler.py       Scheduler: decodes first, then prefill chunks in the token budget;
                       preemption; prefix-cache hits; a failed step taken back
    sequence.py        one generated sequence: its tokens, blocks, status (and who writes which)
    block_manager.py   the KV blocks each sequence holds; the prefix cache (content-addressed)
    waiting.py         the waiting queue by policy (fcfs, priority) and whom preemption takes
    prefill_budget.py  the prefill beside decodes: a cap once streams flow
    admission.py       what a request must satisfy to be queued at all
    spyre_compat.py    --spyre-compat: the vLLM Spyre plugin's scheduling and admission rules

Imports ``server.spec_decode`` (proposals to schedule), ``server.engine.step_work`` (the
chunks it hands out) and ``spyre_serve.models``' public names (the step's limits). Imported by
``server.engine`` and ``server.launch``.
"""
