"""Importing the project's packages changes nothing of the process; `configure()` (what each
entry point calls first) sets the threads, the threading layer, the ISA level and the compile
cache, once."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import os, numba
def state():
    return (numba.config.CACHE_DIR, numba.config.THREADING_LAYER, numba.config.CPU_NAME,
            os.environ.get("OPENBLAS_THREAD_TIMEOUT"), os.environ.get("OMP_WAIT_POLICY"))
before = state()
import spyre_serve.device, spyre_serve.models, spyre_serve.server.engine.core
import spyre_serve.server.openai.app, spyre_serve.models.step.program
assert state() == before, (state(), before)
from spyre_serve.device.process import configure
isa = configure()
after = state()
assert after != before and after[3] == "4" and after[1] == "threadsafe", after
assert "-" + isa.level in after[0], after[0]
assert configure() is isa and state() == after       # once
print("ok")
"""


def test_imports_change_nothing_and_configure_sets_the_process_once():
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "ok"
