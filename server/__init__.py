"""server/: HTTP, the OpenAI protocol, the continuous-batching engine, scheduler, metrics, CLI.

Knows requests, sequences, token budgets and KV blocks as numbers. Reaches the model layer only
through ``spyre_serve.models``' public names (``build_runner``, ``SamplingParams``, ``SeqWork``,
``StepOutput``, ...: never one of its submodules), and the card only for its counters and
allocator stats (metrics). Imported by nothing but its entry points (``spyre-serve``) and tests.

    launch/             the command line, the flags (Settings), the processes, ``plan``
    engine/             the loop: launches, readbacks, updates; its process and its client
    sched/              the scheduler, sequences, KV blocks and the prefix cache, admission
    spec_decode/        speculative decoding: ngram and draft-model proposals
    lora/               LoRA adapters: names, slots, runtime load and unload
    structured_output/  grammars (llguidance) and a request's fields as one
    openai/             the OpenAI API (FastAPI): shared pieces, and a package per endpoint family
    metrics.py          Prometheus: vLLM's names, and the card's own under ``spyre_``

The flow is one way: ``openai`` -> ``engine`` (through ``engine.seams.EngineClient``) ->
``sched`` -> ``models`` (through ``engine.seams.StepRunner``).
"""
