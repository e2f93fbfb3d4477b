#!/usr/bin/python3
"""Plots of `kvevict eval` results (results.json) as PNG, with Debian's python3-matplotlib.

    /usr/bin/python3 tools/plot_results.py eval/results/<name>/results.json [...] --out docs/results

One figure per task found in a results file, named <grid name>-<task>.png:
  stream_bpb  bits/byte per window of positions (a panel per budget) and overall bits/byte vs
              budget; the full cache is the dashed reference
  passkey     per-digit accuracy vs stream length (a panel per budget, mean over depths) and
              exact match; the full cache is dashed
  grocery     item recall vs budget (a panel per turn count)
  cost        tokens/s and process RSS vs tokens streamed (log x), a line per policy @ budget

Reads only what docs/eval.md documents; plotting is the only thing Python does here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Grids have up to ~16 policy rows: 20 distinct colours instead of the default 10.
plt.rcParams["axes.prop_cycle"] = plt.cycler(color=plt.cm.tab20.colors)


def budget_text(budget) -> str:
    return "unbounded" if budget is None else str(budget)


def bounded_budgets(cells) -> list[int]:
    return sorted({c["budget"] for c in cells if c["budget"] is not None})


def labels_in_order(cells) -> list[str]:
    seen: dict[str, int] = {}
    for c in cells:
        seen.setdefault(c["label"], c["policy_index"])
    return sorted(seen, key=seen.get)


def line_style(cells, label: str) -> dict:
    unbounded = all(c["budget"] is None for c in cells if c["label"] == label)
    return {"linestyle": "--", "color": "black"} if unbounded else {"marker": "o", "markersize": 3}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def panels(count: int, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return fig, list(axes[0])


def plot_vs_budget(ax, cells, metric: str) -> None:
    """`metric` against the budget, a line per label; an unbounded label is a dashed level."""
    for label in labels_in_order(cells):
        chosen = sorted((c for c in cells if c["label"] == label and c["budget"] is not None),
                        key=lambda c: c["budget"])
        if chosen:
            ax.plot([c["budget"] for c in chosen], [c["metrics"][metric] for c in chosen],
                    label=label, marker="o")
        else:
            unbounded = next(c for c in cells if c["label"] == label)
            ax.axhline(unbounded["metrics"][metric], label=label, linestyle="--", color="black")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (KV slots per head)")
    ax.grid(alpha=0.3)


def plot_stream_bpb(name: str, cells, out: Path) -> Path:
    budgets = bounded_budgets(cells) or [None]
    fig, axes = panels(len(budgets) + 1)
    for ax, budget in zip(axes, budgets):
        for label in labels_in_order(cells):
            chosen = [c for c in cells if c["label"] == label and c["budget"] in (budget, None)]
            if not chosen:
                continue
            windows = chosen[0]["details"]["windows"]
            xs = [w["first_position"] for w in windows if w["bytes"] > 0]
            ys = [w["bits_per_byte"] for w in windows if w["bytes"] > 0]
            ax.plot(xs, ys, label=label, **line_style(cells, label))
        ax.set_title(f"{name}: budget {budget_text(budget)}")
        ax.set_xlabel("first position of the window")
        ax.set_ylabel("bits per byte")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    plot_vs_budget(ax, cells, "bits_per_byte")
    ax.set_title("overall bits per byte vs budget")
    ax.set_ylabel("bits per byte")
    axes[0].legend(fontsize=7)
    return save(fig, out / f"{name}-stream_bpb.png")


def plot_passkey(name: str, cells, out: Path) -> Path:
    budgets = bounded_budgets(cells) or [None]
    fig, axes = panels(len(budgets))
    for ax, budget in zip(axes, budgets):
        for label in labels_in_order(cells):
            chosen = [c for c in cells if c["label"] == label and c["budget"] in (budget, None)]
            by_length = defaultdict(list)
            for c in chosen:
                by_length[c["variant"]["length"]].append(c["metrics"]["per_digit"])
            if not by_length:
                continue
            lengths = sorted(by_length)
            ax.plot(lengths, [mean(by_length[n]) for n in lengths], label=label,
                    **line_style(cells, label))
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(0.1, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{name}: budget {budget_text(budget)} (mean over depths)")
        ax.set_xlabel("stream length (tokens)")
        ax.set_ylabel("passkey per-digit accuracy (chance 0.1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save(fig, out / f"{name}-passkey.png")


def plot_grocery(name: str, cells, out: Path) -> Path:
    turn_counts = sorted({c["variant"]["turns"] for c in cells})
    fig, axes = panels(len(turn_counts))
    for ax, turns in zip(axes, turn_counts):
        plot_vs_budget(ax, [c for c in cells if c["variant"]["turns"] == turns], "item_recall")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{name}: {turns} turns")
        ax.set_ylabel("grocery item recall")
    axes[0].legend(fontsize=7)
    return save(fig, out / f"{name}-grocery.png")


def plot_cost(name: str, cells, out: Path) -> Path:
    fig, axes = panels(2)
    for c in cells:
        points = c["details"]["checkpoints"]
        label = f"{c['label']} @ {budget_text(c['budget'])}"
        xs = [p["tokens"] for p in points]
        axes[0].plot(xs, [p["interval_tokens_per_second"] for p in points], marker="o",
                     markersize=3, label=label)
        axes[1].plot(xs, [p["rss_bytes"] / 2**20 for p in points], marker="o", markersize=3,
                     label=label)
    for ax, what in zip(axes, ("tokens/s since the previous checkpoint", "process RSS (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens streamed")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{name}: speed")
    axes[1].set_title(f"{name}: memory")
    axes[0].legend(fontsize=6, ncol=2)
    return save(fig, out / f"{name}-cost.png")


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTTERS = {"stream_bpb": plot_stream_bpb, "passkey": plot_passkey, "grocery": plot_grocery,
            "cost": plot_cost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of kvevict eval")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        results = json.loads(path.read_text())
        by_task = defaultdict(list)
        for cell in results["cells"]:
            by_task[cell["task"]].append(cell)
        for task, cells in by_task.items():
            print(PLOTTERS[task](results["name"], cells, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
