"""device/profile.py: kernel timers read the time-stamp counter inside njit code."""

import time

import numpy as np
from numba import njit

from spyre_serve.device.profile import lap, ticks_per_second


@njit(nogil=True)
def _two_kernels(timers, n):
    t = lap(timers, -1, 0)
    s = 0.0
    for i in range(n):                  # "kernel" 0: n steps
        s += np.sqrt(i)
    t = lap(timers, 0, t)
    for i in range(4 * n):              # "kernel" 1: four times the work
        s += np.sqrt(i)
    lap(timers, 1, t)
    return s


def test_lap_adds_each_kernels_ticks_to_its_slot():
    timers = np.zeros(2, np.int64)
    _two_kernels(timers, 2_000_000)
    assert 0 < timers[0] < timers[1]


def test_empty_timers_turn_timing_off():
    assert _two_kernels(np.zeros(0, np.int64), 1000) > 0


def test_ticks_per_second_converts_ticks_to_wall_time():
    timers = np.zeros(2, np.int64)
    _two_kernels(timers, 10)
    t0 = time.perf_counter()
    _two_kernels(timers, 3_000_000)
    wall = time.perf_counter() - t0
    measured = timers.sum() / ticks_per_second()
    assert 0.5 * wall < measured <= 1.05 * wall
