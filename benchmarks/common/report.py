"""The end-to-end benchmark's report tables (Markdown) from saved records: every system per
interface and concurrency, and the best point per replica count."""

from __future__ import annotations

from benchmarks.common.service_counters import run_shares


def table(runs: dict) -> str:
    levels = sorted({c for run in runs.values() for p in run.get("mixed", {}).values() for c in p}, key=int)
    lines = [
        f"{name}: {run['environment']}" + ("" if run.get("complete", True) else " (stopped early)")
        for name, run in runs.items()
        if "environment" in run
    ]
    lines += [
        "",
        "| system | interface | " + " | ".join(f"c={c}: tok/s (p50 ms)" for c in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for name, run in runs.items():
        for interface, points in run.get("mixed", {}).items():
            cells = [
                f"{points[c]['tokens_per_s']:.0f} ({points[c]['p50_ms']:.0f})" if c in points else "" for c in levels
            ]
            lines.append(f"| {name} | {interface} | " + " | ".join(cells) + " |")
    if "tokens_per_s" in runs.get("encoder", {}):
        lines.append(
            f"| encoder alone | same items, router's packing | {runs['encoder']['tokens_per_s']:.0f} |"
            + " |" * (len(levels) - 1)
        )
    ours = runs.get("ours", {})
    packing = [
        f"{interface} c={c}: {point['service_window']['requests_per_forward']}"
        for interface, points in ours.get("mixed", {}).items()
        for c, point in points.items()
        if "requests_per_forward" in point.get("service_window", {})
    ]
    if packing:
        lines.append("\nRequests per forward (an encoder run; over each point): " + ", ".join(packing))
    for interface, points in ours.get("single_448", {}).items():
        lines.append(
            f"\nOne 448x448 image, concurrency 1, {interface}: p50 {points['1']['p50_ms']:.1f} ms, "
            f"p99 {points['1']['p99_ms']:.1f} ms"
        )
    if "failover" in ours:
        shown = {k: v for k, v in ours["failover"].items() if k != "tokens_per_second_from_kill"}
        lines.append(f"\nOne encoder replica killed under handle load: {shown}")
    for tag, startup in ours.get("startup", {}).items():
        shown = {k: v for k, v in startup.items() if k.endswith("_s") or k == "encoder_before_constructor"}
        lines.append(f"\nStartup ({tag}): {shown}")
    return "\n".join(lines)


def best_points(runs: dict[int, dict]) -> tuple[list[str], dict]:
    """The interfaces, and each one's best point (most tokens/s over concurrency) per replica count."""
    interfaces = sorted({i for run in runs.values() for i in run.get("mixed", {})})
    best = {
        (n, i): max(run.get("mixed", {}).get(i, {}).values(), key=lambda p: p["tokens_per_s"], default=None)
        for n, run in runs.items()
        for i in interfaces
    }
    return interfaces, best


def scaling_table(runs: dict[int, dict]) -> str:
    """Each interface's best point per replica count, and its ratio to the fewest replicas' best."""
    fewest = min(runs)
    interfaces, best = best_points(runs)
    lines = [
        "| replicas | "
        + " | ".join(f"{i}: tok/s (c, p50 ms) | x{fewest}" for i in interfaces)
        + " | routers' cores (with decode workers; the host's busy cores where recorded)"
        + f" | each replica's share of the {interfaces[0]} window |",
        "|---|" + "---|---|" * len(interfaces) + "---|---|",
    ]
    for n in sorted(runs):
        cells, cores = [], []
        for i in interfaces:
            point, base = best[n, i], best[fewest, i]
            if point is None:
                cells += ["", ""]
                continue
            level = next(c for c, p in runs[n]["mixed"][i].items() if p is point)
            ratio = f"{point['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
            cells += [f"{point['tokens_per_s']:.0f} ({level}, {point['p50_ms']:.0f})", ratio]
            used = point["cores_used"]
            host = f"; host {point['host_busy_cores']:.1f}" if "host_busy_cores" in point else ""
            cores.append(f"{i} {used.get('EncoderRouter', 0) + used.get('decode_worker', 0):.1f}{host}")
        first = best[n, interfaces[0]]
        shares = run_shares(first.get("service_window", {})) if first else ""
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {', '.join(cores)} | {shares} |")
    killed = [(n, run["failover"]) for n, run in runs.items() if "failover" in run]
    for n, result in killed:
        shown = {k: v for k, v in result.items() if k != "tokens_per_second_from_kill"}
        lines.append(f"\nOne of {n} encoder replicas killed under handle load: {shown}")
    return "\n".join(lines)
