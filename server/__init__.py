"""server/: HTTP, the OpenAI protocol, the continuous-batching engine, scheduler, metrics, CLI.

Knows requests, sequences, token budgets and KV blocks as numbers; uses only
``models`` (ModelRunner, SamplingParams, SeqWork, StepOutput, load_model) and,
for metrics, the card's counters and allocator stats. One idea per file:

- ``sequence``: one generated sequence and how it stops;
- ``block_manager``: which KV blocks each sequence owns;
- ``scheduler``: which sequences compute which tokens next (FCFS, chunked
  prefill, preemption);
- ``engine``: the loop on its own thread (overlapped launches, stop checks,
  detokenization, results to the API);
- ``openai/``: the OpenAI API (FastAPI), one module per job (see its ``__init__``);
- ``metrics``: Prometheus; ``settings``: the one table of flags; ``cli``: ``spyre-serve``.
"""
