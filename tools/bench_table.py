#!/usr/bin/env python3
"""Markdown tables from Google Benchmark JSON: one row per benchmark, the median of its
repetitions for each counter asked for.

    build/release/bin/bench_decode_step --benchmark_repetitions=3 --benchmark_format=json \\
        > decode_step.json
    tools/bench_table.py decode_step.json overhead catalyst moved_bytes_per_evicted live

Rows keep the order in which the benchmarks ran; a benchmark run once (no repetitions) is its own
median. Standard library only.
"""
import argparse
import json
import statistics


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_file", help="output of --benchmark_format=json (or --benchmark_out)")
    parser.add_argument("counters", nargs="+", help="counter names, or real_time / cpu_time")
    parser.add_argument("--digits", type=int, default=4, help="significant digits shown")
    args = parser.parse_args()

    with open(args.json_file, encoding="utf-8") as f:
        report = json.load(f)
    runs = {}
    for entry in report["benchmarks"]:
        if entry.get("run_type") == "aggregate":
            continue
        runs.setdefault(entry["run_name"], []).append(entry)

    print("| benchmark | " + " | ".join(args.counters) + " |")
    print("|---" * (len(args.counters) + 1) + "|")
    for name, entries in runs.items():
        cells = []
        for counter in args.counters:
            values = [e[counter] for e in entries if counter in e]
            cells.append(f"{statistics.median(values):.{args.digits}g}" if values else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    context = report.get("context", {})
    loads = context.get("load_avg")
    if loads:
        print(f"\nload average at the start: {', '.join(f'{x:.1f}' for x in loads)}")


if __name__ == "__main__":
    main()
