"""The kernels' ISA level: the host's best, a lower one forced by SPYRE_KERNEL_ISA (compiled for
that level's CPU, cached apart), a higher one refused."""

import os
import subprocess
import sys

import pytest

import spyre_serve.device as device
from spyre_serve.device.cache import use_source_keyed_cache
from spyre_serve.device.isa import LEVELS, ISAError, choose, current, host_level

ZEN4 = {f: True for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                          "avx512vnni", "avx512bf16")}
ZEN3 = {"avx2": True, "fma": True, "f16c": True, "avx512f": False}
ICELAKE = {**ZEN4, "avx512bf16": False}


def test_the_host_level_is_the_highest_whose_features_are_all_there():
    assert host_level(ZEN4) == "avx512_bf16"
    assert host_level(ICELAKE) == "avx512_vnni"
    assert host_level(ZEN3) == "avx2"
    assert host_level({**ZEN4, "avx512vnni": False}) == "avx512"   # bf16 above a missing level
    with pytest.raises(ISAError, match="lacks fma"):
        host_level({"avx2": True, "f16c": True})


def test_a_lower_level_can_be_forced_a_higher_one_is_refused():
    isa = choose(ZEN4, "znver4", "avx2")
    assert (isa.level, isa.host_level, isa.forced) == ("avx2", "avx512_bf16", True)
    assert not isa.at_least("avx512") and isa.at_least("avx2")
    assert choose(ZEN4, "znver4", None).level == "avx512_bf16"
    assert not choose(ZEN3, "znver3", "AVX2").forced           # the host's own level
    with pytest.raises(ISAError, match="at most avx2"):
        choose(ZEN3, "znver3", "avx512")
    with pytest.raises(ISAError, match="not one of"):
        choose(ZEN3, "znver3", "sse2")


def test_this_process_runs_a_level_the_host_has_and_caches_by_it(tmp_path, monkeypatch):
    isa = current()
    assert isa.level in LEVELS and LEVELS.index(isa.level) <= LEVELS.index(isa.host_level)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    import numba
    before = numba.config.CACHE_DIR
    try:
        path = use_source_keyed_cache(*[p for p in [os.path.dirname(device.__file__)]])
        assert path.name.endswith(f"-{isa.level}")
    finally:
        numba.config.CACHE_DIR = before


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_the_host_runs_computes_the_same_gemm(level):
    """Each level at or below the host's, in a fresh process (the level is chosen before Numba
    compiles): the quantized and float GEMMs give the numpy reference's values."""
    if LEVELS.index(level) > LEVELS.index(current().host_level):
        pytest.skip(f"this CPU runs at most {current().host_level}, not {level}")
    code = """
import numpy as np
from spyre_serve.device.process import configure
isa = configure()
from spyre_serve.device.kernels.gemm import ACT_F32, FMT_F32, FMT_Q4_1, gemm_packed
from spyre_serve.device.layout import QuantizedWeight, pack, pack_quantized
rng = np.random.default_rng(0)
q = rng.integers(0, 16, (33, 64)).astype(np.int8)
d = (rng.standard_normal((33, 2)) * .01).astype(np.float16)
qw = QuantizedWeight(FMT_Q4_1, q, d, d)
a = rng.standard_normal((3, 64), dtype=np.float32)
out, ref = np.empty((3, 33), np.float32), np.empty((3, 33), np.float32)
gemm_packed(out, a, pack_quantized(qw).reshape(-1), 64, 33, FMT_Q4_1, ACT_F32)
gemm_packed(ref, a, pack(np.ascontiguousarray(qw.dequantize().T), FMT_F32).reshape(-1), 64, 33, FMT_F32, ACT_F32)
assert np.array_equal(out, ref)
np.testing.assert_allclose(out, a.astype(np.float64) @ qw.dequantize().T, rtol=1e-4, atol=1e-4)
print(isa.level)
"""
    env = {**os.environ, "SPYRE_KERNEL_ISA": level}   # its own cache directory: keyed by the level
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == level
