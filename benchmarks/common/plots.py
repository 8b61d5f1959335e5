"""The end-to-end benchmark's plots (matplotlib, file backend): throughput against concurrency,
latency CDFs, and throughput against replica count."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common.report import best_points


def pyplot():
    """matplotlib's pyplot on the file backend, or None (with a hint) where it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("no plots: pip install matplotlib (the `bench` extra)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: dict, out: Path) -> None:
    if (plt := pyplot()) is None:
        return
    import matplotlib.ticker

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, run in runs.items():
        for interface, points in run.get("mixed", {}).items():
            levels = sorted(points, key=int)
            left.plot(
                [int(c) for c in levels],
                [points[c]["tokens_per_s"] for c in levels],
                marker="o",
                label=f"{name} {interface}",
            )
            top = points[levels[-1]]["latencies_ms"]
            right.plot(top, np.linspace(0, 1, len(top)), label=f"{name} {interface} c={levels[-1]}")
    if "tokens_per_s" in runs.get("encoder", {}):
        left.axhline(runs["encoder"]["tokens_per_s"], color="black", linestyle="--", label="encoder alone")
    left.set(xlabel="concurrent callers", ylabel="vision tokens / s", xscale="log", yscale="log", title="throughput")
    right.set(
        xlabel="latency (ms)", ylabel="fraction of requests", xscale="log", title="latency CDF, highest concurrency"
    )
    # latencies span a decade or two: label 1-2-5 steps in ms (the default minor labels overlap)
    right.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    right.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "e2e.png", dpi=110)


def plot_scaling(runs: dict[int, dict], out: Path) -> None:
    """Best tokens/s against replica count per interface, beside linear scaling from the fewest."""
    if (plt := pyplot()) is None:
        return
    interfaces, best = best_points(runs)
    counts, fewest = sorted(runs), min(runs)
    figure, axis = plt.subplots(figsize=(6.5, 5))
    for interface in interfaces:
        shown = [n for n in counts if best[n, interface] is not None]
        (line,) = axis.plot(
            shown, [best[n, interface]["tokens_per_s"] for n in shown], marker="o", label=f"ours {interface}"
        )
        if best[fewest, interface] is not None:
            base = best[fewest, interface]["tokens_per_s"] / fewest
            axis.plot(
                counts,
                [base * n for n in counts],
                linestyle=":",
                color=line.get_color(),
                label=f"{interface}, linear from {fewest}",
            )
    axis.set(xlabel="encoder replicas (one GPU each)", ylabel="vision tokens / s", xticks=counts, title="scaling")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "scaling.png", dpi=110)


def plot_load_step(record: dict, path: Path) -> None:
    """A load step against time: scheduled callers, vision tokens/s, p50/p99 latency, and the
    encoder replicas by Serve's state with those at full speed, one value per window."""
    if (plt := pyplot()) is None:
        return
    rows = record["windows"]
    edges = [row["t0_s"] for row in rows] + [rows[-1]["t1_s"]] if rows else [0.0]
    figure, (load, rate, latency, replicas) = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    load.plot(*zip(*record["schedule"]), color="black", label="scheduled callers")
    load.stairs([row["callers"] for row in rows], edges, label="mean per window")
    rate.stairs([row["tokens_per_s"] for row in rows], edges, color="tab:green")
    for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
        shown = [row[key] if row[key] is not None else np.nan for row in rows]
        latency.stairs(shown, edges, linestyle=style, label=key.removesuffix("_ms"))
    errors = [(row["t0_s"], row["errors"]) for row in rows if row["errors"]]
    if errors:
        rate.scatter(*zip(*errors), color="red", marker="x", label="windows with errors")
        rate.legend(fontsize=7)
    states = sorted({state for row in rows for state in (row["replicas"] or {})})
    for state in states:
        replicas.stairs([(row["replicas"] or {}).get(state, 0) for row in rows], edges, label=state.lower())
    replicas.stairs([row["full_speed_replicas"] for row in rows], edges, color="black", linestyle=":")
    replicas.plot([], [], color="black", linestyle=":", label="at full speed")
    load.set(ylabel="callers", title=f"load step, {record['interface']}")
    rate.set(ylabel="vision tokens / s")
    latency.set(ylabel="latency (ms)", yscale="log")
    replicas.set(ylabel="encoder replicas", xlabel="seconds from the schedule's start")
    for axis in (load, latency, replicas):
        axis.legend(fontsize=7)
    rate.set_ylim(bottom=0)
    replicas.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
