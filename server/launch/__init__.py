"""Starting a server: the flags, the processes, and what is built before the first request.

    cli.py          ``spyre-serve`` (serve, warmup, plan): builds the runner
                    (``models.build_runner``), the engine and the app, and runs uvicorn
    settings.py     Settings: one field per flag, parsed and checked once
    api_servers.py  --api-server-count N: N API processes on one port before one engine process
    plan.py         ``spyre-serve plan``: will a model fit, card by card, before any weight is read
    streams.py      stdout and stderr that drop what a full disk refuses instead of raising

Imports every other server package and ``spyre_serve.models``' public names. Imported by the
``spyre-serve`` entry point and the tests; nothing else in ``server/`` imports it but
``settings`` (the one table of flags), and the engine process's start (``engine/process.py``:
``cli.load_engine`` and ``streams``, imported there lazily).
"""
