"""Token and sequence buckets, and the step program of each, prepared once.

A step is padded up to the smallest (tokens, sequences) bucket that fits it and runs that
bucket's program, which computes the step's own token rows only (models/step/program.py):
the bucket sizes the buffers, the padding costs no arithmetic. Every bucket is a
`device.Program` of the same compiled `step_entry` (all shapes are dim slots) with its own
operand table on the card; what does not change between launches (model shapes and
addresses, the workspace fields) is bound once, at preparation.
`warmup` prepares them all before serving, so that serving never compiles.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Mapping

from spyre_serve.device import Card, Program, Slot
from spyre_serve.models.step.program import SLOTS, step_entry


def buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, and `limit` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


def bucket(sizes: list[int], n: int) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return sizes[bisect.bisect_left(sizes, n)]


class StepPrograms:
    """The prepared program of each (tokens, sequences) bucket, made on first use."""

    def __init__(self, card: Card, t_buckets: list[int], s_buckets: list[int],
                 static: Mapping, shapes: Mapping[str, int]):
        self.card = card
        self.t_buckets = t_buckets
        self.s_buckets = s_buckets
        self._static = dict(static)       # slot bindings shared by every launch
        self._shapes = dict(shapes)       # manifest shapes beside T and S (H, V)
        self.programs: dict[tuple[int, int], Program] = {}

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket: sequences never exceed tokens."""
        return [(t, s) for t in self.t_buckets for s in self.s_buckets if s <= t]

    def get(self, t: int, s: int) -> Program:
        """The prepared program of bucket (t, s)."""
        prog = self.programs.get((t, s))
        if prog is None:
            prog = Program(self.card, name=f"step_t{t}_s{s}", entry=step_entry,
                           slots=[Slot(n, k) for n, k in SLOTS], scratch_bytes=0,
                           shapes={"T": t, "S": s, **self._shapes})
            prog.prepare()
            prog.bind(self._static)
            self.programs[(t, s)] = prog
        return prog

    def warmup(self, run_padding: Callable[[int, int], None], progress: bool = True) -> None:
        """Compile (or load from Numba's disk cache) and prepare every bucket's program, and
        `run_padding(t, s)` once per token bucket (pages in the workspace, starts the thread
        pools). Every bucket shares one compiled entry."""
        from tqdm import tqdm

        shapes = self.bucket_shapes()
        # A terminal gets a live bar; a log file (docker logs, CI) a line at the start and
        # one at the end instead of a redraw per program.
        bar = tqdm(shapes, desc="preparing step programs", unit="program", disable=not progress,
                   mininterval=0.1 if sys.stderr.isatty() else 3600.0)
        for t, s in bar:
            bar.set_postfix_str(f"tokens {t} seqs {s}", refresh=False)
            self.get(t, s)
            if s == max(x for x in self.s_buckets if x <= t):   # once per token bucket
                run_padding(t, s)

    def release(self) -> None:
        """Give every program's table region back to the card."""
        for prog in self.programs.values():
            prog.release()
        self.programs.clear()
