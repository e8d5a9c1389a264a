"""device/cache.py: the compile cache is keyed by the sources, so an edit never runs stale code."""

import numba

from spyre_serve.device.cache import source_key, use_source_keyed_cache
from spyre_serve.device.isa import current


def _package(root, text):
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "kernel.py").write_text(text)
    return pkg


def test_the_key_changes_when_any_source_file_changes(tmp_path):
    pkg = _package(tmp_path, "X = 1\n")
    before = source_key([pkg])
    assert source_key([pkg]) == before                      # stable
    (pkg / "sub" / "kernel.py").write_text("X = 2\n")
    assert source_key([pkg]) != before


def test_the_cache_directory_is_under_numba_cache_dir_named_by_the_key(tmp_path, monkeypatch):
    pkg = _package(tmp_path, "Y = 1\n")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    old = numba.config.CACHE_DIR
    try:
        path = use_source_keyed_cache(pkg)
        assert path == tmp_path / "cache" / f"{source_key([pkg])}-{current().level}"
        assert numba.config.CACHE_DIR == str(path)
    finally:
        numba.config.CACHE_DIR = old
