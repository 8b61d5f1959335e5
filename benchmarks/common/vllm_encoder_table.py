"""The vLLM encoder benchmark's Markdown report, from its saved record: one row per system, and
where it was measured (`--kernel-time`), each system's kernel time by kind."""

from __future__ import annotations

from benchmarks.common.kernel_time import kernel_table


def cell(system: dict, key: str, spec: str) -> str:
    """A table cell: the system's value formatted, or empty where it was not measured."""
    return "" if system.get(key) is None else format(system[key], spec)


def format_table(record: dict) -> str:
    """The record as Markdown: settings, a row per system, then kernel time by kind where measured."""
    stream, single = record["stream"], record["single"]
    lines = [
        f"Device {record['device']}, torch {record['torch']}, vLLM {record['vllm']}, transformers "
        f"{record['transformers']}, {record['dtype']}, peak {record['peak_bf16_tflops']:.0f} TFLOP/s, {record['date']}",
        f"Command: {record['command']}",
        f"Stream: {stream['items']} items, {stream['tokens']} tokens ({stream['requests']} requests of e2e_bench), "
        f"rounds: {len(next(iter(record['systems'].values()))['stream_seconds'])} (medians); "
        f"single: one 448x448 photo ({single['tokens']} tokens). MFU: {record['flop_formula']}.",
        "",
        "| system | stream tokens/s | stream MFU | calls | tokens/call | call p50 / p90 ms | 448x448 ms "
        "| 448x448 MFU | max rel. err vs ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in record["systems"].items():
        if "stream_tokens_per_s" not in s:
            lines.append(f"| {name} | | | | | | {s['single_448_ms']:.2f} | {s['single_448_mfu']:.1%} | |")
            continue
        lat = s["latency"]
        err = s.get("agreement_with_ours")
        lines.append(
            f"| {name} | {s['stream_tokens_per_s']:,.0f} | {s['stream_mfu']:.1%} | {s['calls_per_stream']} "
            f"| {lat['tokens_per_call']:.0f} | {lat['p50_ms']:.2f} / {lat['p90_ms']:.2f} "
            f"| {cell(s, 'single_448_ms', '.2f')} | {cell(s, 'single_448_mfu', '.1%')} "
            f"| {'' if err is None else f'{err:.3g}'} |"
        )
    kernels = kernel_table(record["systems"])
    if kernels:  # one profiled stream pass per system
        lines += [
            "",
            "GPU kernel time over one stream pass (ms; `--kernel-time`); SM clock, power and the share of samples "
            f"the power cap held the clock down: over the system's throughput passes (limit "
            f"{record.get('gpu_power_limit_w') or '?'} W):",
            "",
            kernels,
        ]
    return "\n".join(lines)
