"""Numba's on-disk cache, keyed by every source file it was compiled from.

Numba checks a cached function against its own file only: a kernel compiled into a step
program is not recompiled when the kernel's file changes, nor when a module-level constant
it imports from another file does, and a stale cache runs the old code silently. So the
cache lives in a directory named by a hash of the sources of the packages that compile
together; any change to any of them starts a fresh directory, and an unchanged tree (a
restart, the Docker image's build-time warm-up) finds its compiled code again.

    $NUMBA_CACHE_DIR (or ~/.cache/spyre-serve/numba) / <sha256 of the sources, 16 hex>-<ISA> / ...

keyed by the kernels' ISA level too (device/isa.py), so code compiled for one level, or on a
CPU of another level, is never loaded for another.

`use_source_keyed_cache(*packages)` must run before the modules whose functions are cached
are imported: Numba fixes a function's cache directory when it is decorated.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

DEFAULT_BASE = Path.home() / ".cache" / "spyre-serve" / "numba"


def source_key(package_dirs: list[Path]) -> str:
    """sha256 (16 hex digits) of every .py file below the given package directories."""
    h = hashlib.sha256()
    for root in package_dirs:
        for path in sorted(Path(root).rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def use_source_keyed_cache(*package_dirs: Path) -> Path:
    """Point Numba's cache at base/<key of these packages' sources>-<ISA level>; returns that
    directory."""
    from spyre_serve.device.isa import current

    base = Path(os.environ.get("NUMBA_CACHE_DIR") or DEFAULT_BASE)
    path = base / f"{source_key([Path(p) for p in package_dirs])}-{current().level}"
    numba.config.CACHE_DIR = str(path)
    return path
