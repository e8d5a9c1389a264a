"""The decoder's step: a list of SeqWork in, one program launch, a StepOutput back.

    interface.py      what crosses the runner's boundary: SeqWork, SamplingParams, StepOutput
    runner.py         ModelRunner: packs, picks the bucket's program, launches, reads back
    inputs.py         the host side: SeqWork checked and packed into one INPUTS buffer
    buffer_layout.py  a buffer declared once as a table of fields, and what derives from it
    program.py        step_entry: the whole batched step as one compiled device program
    buckets.py        token and sequence buckets, and the prepared program of each
    weights.py        a checkpoint's tensors placed on the card, in the kernels' layout
    kv_cache.py       the paged KV cache on the card
    memory_plan.py    the card's memory: step buffers first, then the KV cache from the rest
    penalty_slots.py  the card's penalty tables, one row per sequence with penalties
    prompt_logprobs.py  prompt logprobs (echo), chunk by chunk
    threads.py        how many cores a step's kernels use

Imports ``device`` (card, programs, kernels), ``models.config``, ``models.lora`` (the step
applies adapters) and ``models.sizing.projection`` (each launch priced on a real card).
Imported by ``models.build``, ``models.parallel``, ``models.encoder`` (shared pieces) and,
through ``spyre_serve.models``, by the server.
"""
