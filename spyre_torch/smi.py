"""`spyre-smi`: IBM aiu-smi's view of the card, one line per card per interval.

    spyre-smi --url http://127.0.0.1:8000            # a running spyre-serve, via its /metrics
    spyre-smi --url http://127.0.0.1:8000 --once     # one sample (over one interval), then exit
    spyre-smi --interval 2 --count 10

    # time     card  busy%   mem used   mem peak  mem total   launch/s    h2d MB/s    d2h MB/s  compiles
    14:02:11      0   96.8%   812.4MiB   830.1MiB  4096.0MiB      266.0        1.20        0.03         0

Columns: the card's compute time over the interval's wall time; device memory allocated now,
its peak and the card's size; program launches, bytes copied host->device and device->host
per second over the interval; compilations since warm-up (a server's
`spyre_compiles_after_warmup`, which stays 0; in-process: since the monitor started).

In-process (cards of this process: torch's "spyre" cards by default, a line for each of the
`torch.spyre.device_count()` cards, each made if need be, named by its index):

    from spyre_torch import smi
    with smi.monitor(interval=1.0):        # prints a line per card per second on stderr while the block runs
        model.generate(...)
    smi.sample_card(card)                  # one reading, as a Sample

A server exports one card (one `model_name` label set); each label set of the spyre_* series
in /metrics is printed as a card of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from dataclasses import dataclass

MIB = 1 << 20
HEADER = (f"# {'time':8s} {'card':>5s} {'busy%':>7s} {'mem used':>10s} {'mem peak':>10s} "
          f"{'mem total':>10s} {'launch/s':>10s} {'h2d MB/s':>11s} {'d2h MB/s':>11s} {'compiles':>9s}")


@dataclass(frozen=True)
class Sample:
    """One reading of a card's counters (cumulative) and memory (now)."""
    card: str
    at: float                 # time.monotonic() of the reading
    compute_seconds: float
    launches: int
    h2d_bytes: int
    d2h_bytes: int
    mem_used: int
    mem_peak: int
    mem_total: int
    compiles: int             # since warm-up (server) or since the monitor started (in-process)


def line(before: Sample, after: Sample) -> str:
    """The interval between two readings of one card as one line."""
    wall = max(after.at - before.at, 1e-9)
    busy = 100.0 * min(1.0, max(0.0, (after.compute_seconds - before.compute_seconds) / wall))
    launches = (after.launches - before.launches) / wall
    h2d = (after.h2d_bytes - before.h2d_bytes) / wall / 1e6
    d2h = (after.d2h_bytes - before.d2h_bytes) / wall / 1e6
    return (f"  {time.strftime('%H:%M:%S')} {after.card:>5s} {busy:6.1f}% "
            f"{after.mem_used / MIB:7.1f}MiB {after.mem_peak / MIB:7.1f}MiB "
            f"{after.mem_total / MIB:7.1f}MiB {launches:10.1f} {h2d:11.2f} {d2h:11.2f} "
            f"{after.compiles:9d}")


# ---- a server's /metrics --------------------------------------------------------------------

SERIES = {
    "spyre_device_compute_seconds_total": "compute_seconds",
    "spyre_launches_total": "launches",
    "spyre_h2d_bytes_total": "h2d_bytes",
    "spyre_d2h_bytes_total": "d2h_bytes",
    "spyre_device_memory_used_bytes": "mem_used",
    "spyre_device_memory_peak_bytes": "mem_peak",
    "spyre_device_memory_total_bytes": "mem_total",
    "spyre_compiles_after_warmup": "compiles",
}
REQUIRED = ("spyre_launches_total", "spyre_device_compute_seconds_total",
            "spyre_device_memory_used_bytes")


def parse_metrics(text: str, at: float) -> list[Sample]:
    """The cards in a Prometheus exposition: one Sample per label set of the spyre_* series."""
    from prometheus_client.parser import text_string_to_metric_families

    cards: dict[tuple, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SERIES:
                key = tuple(sorted(s.labels.items()))
                cards.setdefault(key, {})[s.name] = s.value
    samples = []
    for i, (labels, values) in enumerate(sorted(cards.items())):
        missing = [m for m in REQUIRED if m not in values]
        if missing:
            raise ValueError(f"/metrics lacks {missing} for {dict(labels) or 'the card'}: "
                             f"is this a spyre-serve server?")
        fields = {SERIES[name]: value for name, value in values.items()}
        samples.append(Sample(
            card=str(i), at=at, compute_seconds=float(fields.get("compute_seconds", 0.0)),
            launches=int(fields.get("launches", 0)), h2d_bytes=int(fields.get("h2d_bytes", 0)),
            d2h_bytes=int(fields.get("d2h_bytes", 0)), mem_used=int(fields.get("mem_used", 0)),
            mem_peak=int(fields.get("mem_peak", 0)), mem_total=int(fields.get("mem_total", 0)),
            compiles=int(fields.get("compiles", 0))))
    if not samples:
        raise ValueError("/metrics has no spyre_* series: is this a spyre-serve server?")
    return samples


def read_url(url: str, timeout: float = 10.0) -> list[Sample]:
    import httpx

    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    r = httpx.get(target, timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text, time.monotonic())


# ---- a card of this process ------------------------------------------------------------------

def sample_card(card=None, compiles_at_start: int = 0, name: str = "0") -> Sample:
    """A reading of `card` (default: torch's current "spyre" card, made if need be)."""
    if card is None:
        from spyre_torch.api import card as torch_card

        card = torch_card()
    c = card.counters.snapshot()
    s = card.allocator.stats()
    return Sample(card=name, at=time.monotonic(), compute_seconds=float(c["compute_seconds"]),
                  launches=int(c["launches"]), h2d_bytes=int(c["h2d_bytes"]),
                  d2h_bytes=int(c["d2h_bytes"]), mem_used=s.allocated, mem_peak=s.peak,
                  mem_total=s.capacity, compiles=int(c["compiles"]) - compiles_at_start)


def torch_cards() -> dict[str, object]:
    """torch's "spyre" cards by name ("0", "1", ...): all `device_count()` of them, made if need be."""
    from spyre_torch.api import card as torch_card
    from spyre_torch.runtime import device_count

    return {str(i): torch_card(i) for i in range(device_count())}


@contextlib.contextmanager
def monitor(card=None, interval: float = 1.0, out=None):
    """Print a line per card per `interval` seconds while the block runs (and one at its end):
    `card`'s, or each of torch's "spyre" cards'."""
    out = out or sys.stderr
    cards = torch_cards() if card is None else {"0": card}
    start = {name: c.counters["compiles"] for name, c in cards.items()}
    stop = threading.Event()

    def read() -> list[Sample]:
        return [sample_card(c, start[name], name) for name, c in cards.items()]

    def run():
        before = read()
        print(HEADER, file=out, flush=True)
        while not stop.wait(interval):
            after = read()
            for b, a in zip(before, after, strict=True):
                print(line(b, a), file=out, flush=True)
            before = after
        for b, a in zip(before, read(), strict=True):
            print(line(b, a), file=out, flush=True)

    thread = threading.Thread(target=run, name="spyre-smi", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ---- the command -----------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="spyre-smi",
        description="One line per card per interval: busy %, memory used / peak / total, "
                    "launches per second, host<->device MB per second, compiles since warm-up; "
                    "read from a running spyre-serve's /metrics.")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server (its /metrics is read)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between lines")
    p.add_argument("--once", action="store_true", help="print one sample (one interval) and exit")
    p.add_argument("--count", type=int, default=0, help="stop after this many lines (0: never)")
    p.add_argument("--no-header", action="store_true", help="omit the header line")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error(f"--interval must be positive, got {args.interval}")
    count = 1 if args.once else args.count
    try:
        before = read_url(args.url)
        if not args.no_header:
            print(HEADER, flush=True)
        printed = 0
        while not count or printed < count:
            time.sleep(args.interval)
            after = read_url(args.url)
            for b, a in zip(before, after, strict=False):
                print(line(b, a), flush=True)
            before = after
            printed += 1
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - said in the user's words, then exit 1
        print(f"spyre-smi: cannot read {args.url}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
