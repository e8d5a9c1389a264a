"""The card's counters: what was compiled, prepared, launched and moved.

Increments come from host threads (launch) and stream workers (copies,
compute), so every update takes one small lock. `snapshot()` is what metrics
read: a plain dict of numbers.
"""

from __future__ import annotations

import threading


class Counters:
    FIELDS = (
        "compiles",  # real Numba compilations triggered by Program.prepare in this process
        "cache_loads",  # entries loaded from Numba's on-disk cache by Program.prepare
        "compile_seconds",  # wall time of those compilations and loads
        "prepares",  # Program.prepare calls that placed a program
        "launches",  # Program.launch calls
        "bytes_patched",  # bytes of operand tables written by launches
        "launch_host_seconds",  # host time spent inside Program.launch
        "compute_seconds",  # time in Compute steps, inside the compute lock
        "h2d_bytes",  # bytes copied host -> device (copies and H2D steps)
        "d2h_bytes",  # bytes copied device -> host
        "failed_commands",  # stream commands that raised
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, name: str, amount=1) -> None:
        with self._lock:
            self._values[name] += amount

    def add_launch(self, bytes_patched: int, host_seconds: float) -> None:
        with self._lock:
            v = self._values
            v["launches"] += 1
            v["bytes_patched"] += bytes_patched
            v["launch_host_seconds"] += host_seconds

    def add_plan(self, h2d_bytes: int, d2h_bytes: int, compute_seconds: float) -> None:
        with self._lock:
            v = self._values
            v["h2d_bytes"] += h2d_bytes
            v["d2h_bytes"] += d2h_bytes
            v["compute_seconds"] += compute_seconds

    def __getitem__(self, name: str):
        return self._values[name]

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._values)
