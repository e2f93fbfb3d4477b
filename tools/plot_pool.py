#!/usr/bin/python3
"""Every sequence's live cells over time in a shared KV pool, from bench_llama --pool-trace.

    build/release/bin/bench_llama --budgets 128 --pool-trace pool.csv
    /usr/bin/python3 tools/plot_pool.py pool.csv --out docs/results/pool-16-sequences.png

Top: the cells of each sequence stacked, under the pool's size (all sequences together never
exceed it). Bottom: each sequence's cells on its own, with its minimum (what a cut leaves it).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    with args.csv.open() as f:
        rows = list(csv.DictReader(f))
    steps = sorted({int(r["step"]) for r in rows})
    cells: dict[int, dict[int, int]] = defaultdict(dict)
    policy: dict[int, str] = {}
    minimum: dict[int, int] = {}
    for r in rows:
        sequence = int(r["sequence"])
        cells[sequence][int(r["step"])] = int(r["live_cells"])
        policy[sequence] = r["policy"]
        minimum[sequence] = int(r["minimum"])
    pool = int(rows[0]["pool_cells"])
    sequences = sorted(cells)

    figure, (stacked, each) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    series = [[cells[s].get(step, 0) for step in steps] for s in sequences]
    stacked.stackplot(steps, series, labels=[f"{s} {policy[s]}" for s in sequences])
    stacked.axhline(pool, color="black", linestyle="--", label=f"pool ({pool} cells)")
    stacked.set_ylabel("cells held, stacked")
    stacked.set_title(f"{len(sequences)} sequences in one KV pool of {pool} cells")
    stacked.legend(fontsize=6, ncol=4, loc="lower right")
    for s, values in zip(sequences, series):
        line = each.plot(steps, values, linewidth=0.8)[0]
        each.axhline(minimum[s], color=line.get_color(), linewidth=0.4, linestyle=":")
    each.set_xlabel("step")
    each.set_ylabel("cells per sequence (dotted: minimum)")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
