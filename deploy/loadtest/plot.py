"""``--plot``: latency against output throughput over a sweep, as a PNG.

One point per load point, labelled with its concurrency; median and p99 of
TTFT, TPOT and E2EL. matplotlib is imported here only (the [bench] extra), so
the client runs without it.
"""

from __future__ import annotations


def plot_sweep(points: list[dict], path: str) -> None:
    """``points``: the ``"points"`` list of the JSON result."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'spyre-serve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["metrics"]["output_throughput"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, [("ttft_ms", "Time to first token"),
                                       ("tpot_ms", "Time per output token"),
                                       ("e2el_ms", "End-to-end latency")], strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(xs, [p["metrics"][key][stat] for p in points], style, label=stat)
        for x, p in zip(xs, points, strict=True):
            ax.annotate(f"c={p['concurrency']}", (x, p["metrics"][key]["median"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
