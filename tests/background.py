"""Long subprocesses the suite starts when collection ends and reads at its end.

A few tests are one long subprocess each, mostly single-threaded compiling into a cache of
their own (a lower ISA level's kernels, ``spyre-serve warmup`` into an empty cache): minutes
of one core while the rest of the suite, itself mostly one compiling core, leaves the other
idle. Such a test registers its commands as a job (``job``) and is marked
``@pytest.mark.background("name")``; conftest starts the marked tests' jobs once collection
ends, on two threads of their own (a job's commands one after another), every process niced
(the suite's own work comes first), and moves the marked tests to the end of the run, where
``result`` waits for their job and hands back what each command printed. A test deselected
with ``-k`` starts nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """Commands run in order (each after the previous one exited, whatever its code)."""
    commands: list[list[str]]
    env: dict[str, str]
    cwd: str | None = None
    timeout: float = 2400     # a command's limit: niced, it may wait for the suite's cores
    seconds: float = 60       # about how long it runs on an idle machine: lanes are balanced by it
    results: list[subprocess.CompletedProcess] = field(default_factory=list)
    scratch: str = ""         # the folder the factory was given (set by ``start``)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


_FACTORIES: dict[str, Callable[[str], Job]] = {}   # name -> makes the job, given a scratch folder
_JOBS: dict[str, Job] = {}
_SCRATCH: list[str] = []
_PROCS: list[subprocess.Popen] = []
_STOPPING = threading.Event()
_LOCK = threading.Lock()   # a process is started and listed, or the session has ended: never both


def job(name: str):
    """Register ``factory(scratch_dir) -> Job`` as the background job ``name``."""
    def register(factory: Callable[[str], Job]) -> Callable[[str], Job]:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"background job {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory
    return register


def start(names: list[str], lanes: int = 2) -> None:
    """Make the named jobs and run them on ``lanes`` threads, each running its jobs one after
    another (the longest jobs spread first), every process niced."""
    todo = []
    for name in dict.fromkeys(names):
        if name not in _FACTORIES:
            raise KeyError(f"no background job {name!r} (known: {sorted(_FACTORIES)})")
        if name not in _JOBS:
            scratch = tempfile.mkdtemp(prefix=f"spyre-bg-{name}-")
            _SCRATCH.append(scratch)
            _JOBS[name] = _FACTORIES[name](scratch)
            _JOBS[name].scratch = scratch
            todo.append(_JOBS[name])
    queues: list[list[Job]] = [[] for _ in range(max(1, lanes))]
    for j in sorted(todo, key=lambda j: -j.seconds):
        min(queues, key=lambda q: sum(x.seconds for x in q)).append(j)
    for i, q in enumerate(queues):
        if q:
            threading.Thread(target=_run_all, args=(q,), name=f"background-{i}", daemon=True).start()


def _run_all(jobs: list[Job]) -> None:
    for j in jobs:
        try:
            for cmd in j.commands:
                with _LOCK:
                    if _STOPPING.is_set():
                        raise RuntimeError("the session ended first")
                    p = subprocess.Popen(["nice", "-n", "10", *cmd], env=j.env, cwd=j.cwd, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    _PROCS.append(p)
                try:
                    out, err = p.communicate(timeout=j.timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = p.communicate()
                    err += f"\n[background: killed after {j.timeout:.0f} s]"
                j.results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
        except BaseException as e:    # told to the test, which fails with it
            j.error = e
        finally:
            j.done.set()


def result(name: str, timeout: float = 3600) -> list[subprocess.CompletedProcess]:
    """Wait for job ``name`` (started by ``start``) and return each command's outcome."""
    if name not in _JOBS:
        raise KeyError(f"background job {name!r} was never started: is its test marked "
                       f"@pytest.mark.background({name!r})?")
    j = _JOBS[name]
    if not j.done.wait(timeout):
        raise TimeoutError(f"background job {name!r} still running after {timeout:.0f} s")
    if j.error is not None:
        raise RuntimeError(f"background job {name!r} could not run") from j.error
    return j.results


def scratch(name: str) -> Path:
    """The folder job ``name`` was made with (it lasts until the session ends)."""
    return Path(_JOBS[name].scratch)


def stop() -> None:
    """Kill what still runs, start nothing more, and remove the scratch folders (the
    session's end)."""
    with _LOCK:
        _STOPPING.set()
        for p in _PROCS:
            if p.poll() is None:
                p.kill()
    for d in _SCRATCH:
        shutil.rmtree(d, ignore_errors=True)
