"""Imported first by every kernel module: points Numba's on-disk cache at the directory keyed
by the sources of device/ and of this folder (device/cache.py says why), before any kernel
here is decorated."""

from pathlib import Path

import device
from device.cache import use_source_keyed_cache

CACHE_DIR = use_source_keyed_cache(Path(device.__file__).parent, Path(__file__).parent)
