"""Overlap is real: device commands release the GIL, launches are asynchronous,
and parallel kernels on two streams do not crash the process."""

import threading
import time

import numba
import numpy as np
from numba import njit, prange

from spyre_serve.device import Program, Slot
from spyre_serve.device.abi import f32_at

SPIN = 60_000_000  # iterations of the spin kernel: a few hundred ms


@njit(nogil=True)
def spin(out, n):
    # out[1]: a value that depends on every iteration, so the loop is not optimized away
    acc = 0.0
    for i in range(n):
        acc = acc * 0.999999 + (i & 7)
    out[0] = acc


@njit
def spin_holding_gil(out, n):
    acc = 0.0
    for i in range(n):
        acc = acc * 0.999999 + (i & 7)
    out[0] = acc


@njit(nogil=True)
def spin_entry(f32, i32, i64, u16, table):
    spin(f32_at(f32, table[0], 1), table[1])


@njit(nogil=True, parallel=True)
def parallel_scale(out, x, a):
    for i in prange(x.shape[0]):
        out[i] = a * x[i]


def _host_iterations_while(card, kernel):
    """Python loop iterations the host makes during the first half of `kernel`'s run on a stream.

    Only the first half counts: after a GIL-holding kernel returns, the host may grab
    the GIL before the worker reports completion, and that must not count as overlap.
    """
    out = np.zeros(1)
    kernel(out, 10)  # compile outside the measurement
    t0 = time.perf_counter()
    kernel(out, SPIN)
    alone = time.perf_counter() - t0
    s = card.new_stream("s")
    started, finished, stamp = threading.Event(), threading.Event(), []
    s.enqueue(lambda: (started.set(), stamp.append(time.perf_counter()), kernel(out, SPIN), finished.set()),
              compute=False)
    started.wait()  # the worker is entering the kernel
    times = []
    while not finished.is_set():
        times.append(time.perf_counter())
    s.synchronize()
    start = stamp[0]
    return sum(1 for t in times if start <= t <= start + alone / 2)


def test_host_thread_makes_progress_while_a_device_command_runs(card):
    assert _host_iterations_while(card, spin) > 1000


def test_probe_sees_no_progress_when_a_command_holds_the_gil(card):
    # the same measurement against a kernel that keeps the GIL: the host is stuck
    assert _host_iterations_while(card, spin_holding_gil) < 1000


def test_launch_returns_before_the_device_has_finished(card):
    prog = Program(card, "spin", spin_entry, [Slot("out", "address"), Slot("n", "dim")]).prepare()
    out = card.zeros((1,), np.float32)
    s = card.new_stream("compute")
    gate = threading.Event()
    s.enqueue(gate.wait, compute=False)  # the device is busy with earlier work
    handle = prog.launch(s, {"out": out, "n": SPIN})
    assert not handle.done()  # launch has returned; the program has not run
    gate.set()
    handle.wait()
    assert handle.done() and out.numpy()[0] > 0


def test_two_streams_run_parallel_kernels_at_once_without_crashing(card):
    x = np.arange(100_000, dtype=np.float32)
    outs = [np.empty_like(x) for _ in range(4)]
    parallel_scale(outs[0], x, 1.0)  # compile
    a, b = card.new_stream("a"), card.new_stream("b")
    barrier = threading.Barrier(2, timeout=30)
    for s in (a, b):
        s.enqueue(barrier.wait, compute=False)  # both streams busy from here on
    for _ in range(50):
        # outside the compute lock: the threading layer itself must be thread-safe
        a.enqueue(parallel_scale, outs[0], x, 2.0, compute=False)
        b.enqueue(parallel_scale, outs[1], x, 3.0, compute=False)
        # and under it, as programs run
        a.enqueue(parallel_scale, outs[2], x, 4.0)
        b.enqueue(parallel_scale, outs[3], x, 5.0)
    card.synchronize()
    for out, k in zip(outs, (2.0, 3.0, 4.0, 5.0), strict=True):
        np.testing.assert_array_equal(out, k * x)
    assert numba.threading_layer() in ("omp", "tbb")
