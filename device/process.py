"""The process settings the card's kernels need, made once by each entry point (the CLI, the
tests' conftest, the benchmarks, spyre_torch's autoload) before any kernel is imported:

    from spyre_serve.device.process import configure
    configure()          # idempotent; returns the kernels' ISA level (device/isa.py)

Importing a package of this project changes nothing of the process; `configure` does, in this
order: the threading runtime (TBB, else OpenMP asleep when idle; OpenBLAS's idle workers
asleep), Numba's thread-safe threading layer, the kernels' ISA level, and Numba's on-disk
cache pointed at a directory keyed by the sources of every package that compiles kernels
(device/cache.py). A Card made without it configures the runtime itself; the cache is then
keyed only if no kernel was imported yet (Numba fixes a function's cache when decorating it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("spyre_serve.device")

# Numba's parallel kernels run on Intel TBB (the `tbb` wheel, a dependency) when it loads, else on
# OpenMP. Every kernel of a step is a parallel loop on every core (models/step/threads.py), ~30 a
# layer. TBB's workers spin briefly and then sleep, and a thread that is running takes the
# chunks of one that is not (work stealing), where OpenMP's static split waits for it. SmolLM2-135M
# shape, decode step ms (batch 1 / batch 32), one process per setting, on an idle machine and
# beside one busy process:
#     OpenMP, OMP_WAIT_POLICY=PASSIVE      56 / 151      idle     39-41 / 172-182   busy
#     OpenMP, GOMP_SPINCOUNT=1e4           22 / 115               158 / 387
#     OpenMP, GOMP_SPINCOUNT=1e5           23 / 118               > 80 s for the run
#     TBB                                  22-26 / 111-120        33 / 189
# The tbb wheel puts libtbb.so.12 in <prefix>/lib, which the loader does not search: load it
# before Numba opens its TBB pool. Without TBB, OpenMP's idle workers sleep (PASSIVE), slower
# on an idle machine but never the 10-100x of spinning beside another process.
# The same for OpenBLAS's pool: its idle workers spin (sched_yield) for 2**28 cycles after a
# GEMM by default, through the Numba kernels that follow it; 2**4 puts them to sleep at once.
# granite-tiny 512-token prefill, same process, interleaved: 157-159 ms -> 139-153 ms, with
# OpenBLAS's spinning at 14% of CPU samples before (perf) and gone after. Beside a busy
# process of the same priority (`yes`): prefill 312-331 -> 273-288 ms, batch-32 decode step
# 59-60 -> 39-41 ms.

# the packages whose Numba functions are cached: one key over all their sources
KERNEL_PACKAGES = ("spyre_serve.device", "spyre_serve.models", "spyre_torch")
_done: dict[str, object] = {}


def _package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it (None when absent)."""
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def _load_tbb() -> bool:
    import ctypes

    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(lib):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                pass
    return False


def configure_runtime():
    """Threads, threading layer and ISA level (once); returns the ISA level."""
    if "isa" in _done:
        return _done["isa"]
    if not _load_tbb():
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    import numba

    from spyre_serve.device.isa import current

    isa = current()    # before anything compiles: it points Numba's code generation at the level
    # Numba's default "workqueue" threading layer aborts when parallel kernels run from two
    # threads at once; every stream is a thread, so pick a thread-safe layer (tbb, loaded above,
    # else omp) unless the user chose one.
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "threadsafe"
    _done["isa"] = isa
    return isa


def configure():
    """Everything above, and the compile cache keyed by the kernels' sources (once)."""
    isa = configure_runtime()
    if "cache" not in _done:
        from spyre_serve.device.cache import use_source_keyed_cache

        imported = sorted(m for m in sys.modules
                          if m.startswith(("spyre_serve.device.kernels", "spyre_serve.device.abi",
                                           "spyre_serve.device.program", "spyre_serve.device.profile",
                                           "spyre_serve.models.step.program",
                                           "spyre_serve.models.eager", "spyre_torch.kernels")))
        if imported:
            log.warning("kernels imported before device.process.configure() (%s): their compile "
                        "cache is not keyed by the sources", ", ".join(imported[:3]))
        dirs = [d for d in map(_package_dir, KERNEL_PACKAGES) if d is not None]
        _done["cache"] = use_source_keyed_cache(*dirs)
    return isa
