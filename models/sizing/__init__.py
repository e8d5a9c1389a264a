"""What a model costs before and beside a run, from its config alone.

    fit.py         will it fit: device memory by the sizes the server places (weights, KV
                   cache, step buffers, LoRA slots), card by card; a real card's capacity
    projection.py  the real card's clock: a step's kernels priced by ``device.cost_model``,
                   and a request's projected TTFT and TPOT

Imports ``device.cost_model``, ``device.kernels.formats`` and ``models.config``. Imported by
``models.step`` (each launch projected), ``models.encoder``, ``models.parallel`` and, through
``spyre_serve.models``, ``spyre-serve plan``.
"""
