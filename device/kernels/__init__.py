"""Numba kernels of the emulated card: plain arrays in, outputs first.

All are `@njit(nogil=True, cache=True)` and callable from other njit code (the model's step
program, models/step/program.py, is their one caller while serving). Import each from its
module; this package exports nothing, so importing it compiles nothing.

    gemm/       the GEMM on weights placed once, one tile kind per ISA feature
    attention/  paged attention (write_kv, attention) and the online softmax
    sampling/   the step's sampler: one parameter record per row
    simd.py     the vector geometry of the ISA level, and the IR helpers the tiles use
    formats.py  the weights' number formats and their packed layout
    fastexp.py  a float32 exp in full vectors (softmax, SiLU, GELU)
    the layers: norm.py (RMSNorm), rope.py, activation.py (SwiGLU), residual.py,
                gather.py (the embedding lookup), softmax.py (log-softmax), pooling.py,
                encoder.py (the encoder's own), lora.py (each row's adapter update)
    mamba.py    Granite 4.0's Mamba-2 mixer: the causal conv1d and the SSM scan from each
                sequence's states, the gated RMSNorm
    moe.py      mixture of experts: route (top-k, softmax), group rows by expert, each
                expert's packed GEMMs, combine

Imports ``numba``, ``numpy`` and ``device.isa``; nothing above ``device``.
"""
