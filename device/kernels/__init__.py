"""Numba kernels of the emulated card: plain arrays in, outputs first.

All are `@njit(nogil=True, cache=True)` and callable from other njit code (the model's step
program, models/step/program.py, is their one caller while serving). Import each from its
module; this package exports nothing, so importing it compiles nothing.
"""
