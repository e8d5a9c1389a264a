"""The continuous-batching engine: one loop on its own thread, or in a process of its own.

    core.py             Engine: the loop (schedule, launch step N+1, read step N back, update)
    seams.py            its typed seams: StepRunner below it, EngineClient above it
    client.py           EngineProcessClient: the API process's side of the engine process
    process.py          the engine in its own process (EngineHost, its Outbox)
    inbox.py            how requests reach the loop from any thread
    open_requests.py    the requests taken and not answered in full
    step_work.py        a step's chunks and the SeqWork the runner receives
    output_processor.py the text and stop state of each sequence
    outputs.py          SeqUpdate: what a step adds to a sequence, as the API layer receives it
    stopping.py         when a sequence stops
    step_failures.py    which requests a failed step fails
    death.py            how the engine dies, once, and what then answers every request
    watchdog.py         a step that does not return; the test hook that injects faults
    stats.py            EngineStats: what the engine counts and times

Imports ``server.sched`` (what runs next), ``server.spec_decode``, ``server.structured_output``
(grammar masks), ``server.lora`` (the slot gate) and ``spyre_serve.models``' public names.
Imported by ``server.openai`` (through ``EngineClient``), ``server.metrics`` and ``server.launch``.
"""
