"""Kernel timers inside a program: where a launch's device time goes.

An entry that is given a timer array (int64[n], one slot per kernel it names, on the card)
brackets each kernel with `lap`: the time-stamp counter's ticks since the previous lap are
added to that kernel's slot. An empty array (length 0) turns timing off at the cost of one
branch per kernel. The host converts ticks to seconds with `ticks_per_second()`, measured
once against `time.perf_counter`.

    t = lap(timers, -1, 0)               # start: read the clock
    gemm_packed(...)
    t = lap(timers, K_GEMM, t)           # timers[K_GEMM] += now - t
"""

from __future__ import annotations

import functools
import time

from numba import njit

from spyre_serve.device.abi import cycle_counter


@njit(nogil=True, cache=True, inline="always")
def lap(timers, slot, since):
    """Add the ticks since `since` to timers[slot] (no slot when slot < 0); return now.
    Does nothing and returns 0 when timers is empty (timing off)."""
    if timers.shape[0] == 0:
        return 0
    now = cycle_counter()
    if slot >= 0:
        timers[slot] += now - since
    return now


@njit(nogil=True, cache=True)
def _ticks():
    return cycle_counter()


@functools.cache
def ticks_per_second() -> float:
    """The time-stamp counter's rate, measured over 50 ms against time.perf_counter."""
    _ticks()                                   # compile outside the measurement
    t0, c0 = time.perf_counter(), _ticks()
    time.sleep(0.05)
    t1, c1 = time.perf_counter(), _ticks()
    return (c1 - c0) / (t1 - t0)
