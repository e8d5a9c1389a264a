"""The kernels' ISA level: the host's best, a lower one forced by SPYRE_KERNEL_ISA (compiled for
that level's CPU, cached apart), a higher one refused."""

import os
import sys

import pytest

import spyre_serve.device as device
from spyre_serve.device.cache import use_source_keyed_cache
from spyre_serve.device.isa import LEVELS, ISAError, choose, current, host_level
from tests import background

ZEN4 = {f: True for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                          "avx512vnni", "avx512bf16")}
ZEN3 = {"avx2": True, "fma": True, "f16c": True, "avx512f": False}
ICELAKE = {**ZEN4, "avx512bf16": False}
SAPPHIRE = {**ZEN4, "amx-tile": True, "amx-bf16": True}


def test_the_host_level_is_the_highest_whose_features_are_all_there():
    assert host_level(ZEN4) == "avx512_bf16"
    assert host_level(ICELAKE) == "avx512_vnni"
    assert host_level(ZEN3) == "avx2"
    assert host_level({**ZEN4, "avx512vnni": False}) == "avx512"   # bf16 above a missing level
    assert host_level(SAPPHIRE) == "amx"
    assert host_level(SAPPHIRE, amx_granted=False) == "avx512_bf16"  # Linux kept the tile state
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


HERE = os.path.dirname(__file__)
LEVEL_TESTS = ("kernels/gemm/test_packed.py", "kernels/gemm/test_quantized.py", "kernels/attention/test_paged.py")


def _level_job(level: str):
    """The kernel tests in a fresh process at ``level`` (the level is chosen before Numba
    compiles, and its code cached apart: keyed by the level)."""
    def factory(scratch: str) -> background.Job:
        files = [os.path.join(HERE, f) for f in LEVEL_TESTS]
        return background.Job(
            [[sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout=2400", *files]],
            env={**os.environ, "SPYRE_KERNEL_ISA": level}, cwd=os.path.dirname(os.path.dirname(HERE)),
            seconds=130)
    return background.job(f"isa-{level}")(factory)


for _level in LEVELS:
    _level_job(_level)


def _below_the_host(level: str):
    """A level below the host's reads its background job; the others skip, saying why."""
    if LEVELS.index(level) < LEVELS.index(current().host_level):
        return pytest.param(level, marks=pytest.mark.background(f"isa-{level}"))
    return level


@pytest.mark.parametrize("level", [_below_the_host(level) for level in LEVELS])
def test_every_level_below_the_hosts_passes_the_gemm_tests(level):
    """Each level below the host's, in a fresh process started in the background when the
    suite's collection ended (tests/background.py): the GEMM tests of every tile family (float32,
    16-bit widened or by the level's dot products, 8- and 4-bit with float or int8 inputs)
    and the attention's (its tiles and wide tiles at the level's width) against their numpy
    references. The host's own level is the rest of the suite's."""
    host = current().host_level
    if LEVELS.index(level) > LEVELS.index(host):
        pytest.skip(f"this CPU runs at most {host}, not {level}")
    if level == host:
        pytest.skip(f"{level} is the host's level: the suite itself runs it")
    (out,) = background.result(f"isa-{level}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1], out.stdout[-500:]
