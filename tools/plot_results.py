#!/usr/bin/python3
"""Plots of `kvevict eval` results (results.json) as PNG, with Debian's python3-matplotlib.

    /usr/bin/python3 tools/plot_results.py <eval output>/results.json [...] [--out DIR]

The figures go to build/plots unless --out says where; `--out docs/results` over
eval/results/*/results.json redraws the committed figures.

One figure per task found in a results file, named <grid name>-<task>.png:
  stream_bpb  bits/byte per window of positions (a panel per budget) and overall bits/byte vs
              budget; an unbounded row (the full cache) is a level line
  passkey     per-digit accuracy vs stream length (a panel per budget, mean over depths)
  grocery     item recall vs budget (a panel per turn count)
  cost        tokens/s and process RSS vs tokens streamed (log x), a line per policy @ budget

A grid whose budgets are bytes ("budget_bytes") also gets <grid name>-allocation.png: quality
(bits/byte, or passkey per-digit accuracy with a row of panels per length) against the measured
peak K/V bytes, a panel per score rule (h2o, tova, snapkv: pyramidkv and adakv are SnapKV under
pyramid and adaptive) and a line per allocation (uniform solid, pyramid dashed, adaptive dotted);
other rows (window, the full cache) are drawn in every panel as references.

Styles: every policy has one colour and one marker in every figure (POLICY_STYLES); rows of the
same policy in one figure (labels, or budgets in the cost figure) differ by line style and then
by hollow markers, so no two series look alike. The legend sits right of the panels.

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

# One colour and marker per policy, the same in every figure. The full cache is the black
# reference; the others take tab10 colours.
POLICY_STYLES = {
    "full": ("black", "s"),
    "window": ("tab:gray", "x"),
    "streaming_llm": ("tab:blue", "o"),
    "h2o": ("tab:orange", "^"),
    "tova": ("tab:green", "v"),
    "sirllm": ("tab:red", "D"),
    "random_llm": ("tab:pink", "P"),
    "interval_llm": ("tab:olive", "*"),
    "anllm": ("tab:purple", "p"),
    "infinipot": ("tab:brown", "X"),
    "knorm": ("tab:cyan", "h"),
    "keydiff": ("darkblue", "<"),
}
UNKNOWN_POLICY_STYLE = ("gold", "d")
# Rows of one policy in a figure: line style first, then hollow markers (8 distinct variants).
VARIANT_LINESTYLES = ["-", "--", ":", "-."]


class Styles:
    """Matplotlib keyword arguments for each series of one figure, by (policy, series key)."""

    def __init__(self) -> None:
        self.variants: dict[str, list] = defaultdict(list)

    def __call__(self, policy: str, key, with_marker: bool = True) -> dict:
        variants = self.variants[policy]
        if key not in variants:
            variants.append(key)
        variant = variants.index(key)
        if variant >= 2 * len(VARIANT_LINESTYLES):
            print(f"plot_results.py: more than {2 * len(VARIANT_LINESTYLES)} rows of policy "
                  f"{policy} in one figure: some look alike", file=sys.stderr)
        colour, marker = POLICY_STYLES.get(policy, UNKNOWN_POLICY_STYLE)
        hollow = (variant // len(VARIANT_LINESTYLES)) % 2 == 1
        style = {"color": colour, "linestyle": VARIANT_LINESTYLES[variant % len(VARIANT_LINESTYLES)]}
        if with_marker:
            style.update(marker=marker, markersize=4,
                         markerfacecolor="white" if hollow else colour)
        return style


def budget_text(budget) -> str:
    return "unbounded" if budget is None else str(budget)


def bounded_budgets(cells) -> list[int]:
    return sorted({c["budget"] for c in cells if c["budget"] is not None})


def labels_in_order(cells) -> list[str]:
    seen: dict[str, int] = {}
    for c in cells:
        seen.setdefault(c["label"], c["policy_index"])
    return sorted(seen, key=seen.get)


def policy_of(cells, label: str) -> str:
    return next(c["policy"] for c in cells if c["label"] == label)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def panels(count: int, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return fig, list(axes[0])


def plot_vs_budget(ax, cells, metric: str, styles: Styles) -> None:
    """`metric` against the budget, a line per label; an unbounded label is a level line."""
    for label in labels_in_order(cells):
        style = styles(policy_of(cells, label), label)
        chosen = sorted((c for c in cells if c["label"] == label and c["budget"] is not None),
                        key=lambda c: c["budget"])
        if chosen:
            ax.plot([c["budget"] for c in chosen], [c["metrics"][metric] for c in chosen],
                    label=label, **style)
        else:
            unbounded = next(c for c in cells if c["label"] == label)
            style.pop("marker", None)
            ax.axhline(unbounded["metrics"][metric], label=label, **style)
    ax.set_xscale("log", base=2)
    in_bytes = any(c.get("budget_unit") == "bytes" for c in cells)
    ax.set_xlabel("budget (bytes of keys and values)" if in_bytes else "budget (KV slots per head)")
    ax.grid(alpha=0.3)


def plot_stream_bpb(name: str, cells, out: Path) -> Path:
    budgets = bounded_budgets(cells) or [None]
    fig, axes = panels(len(budgets) + 1)
    styles = Styles()
    for ax, budget in zip(axes, budgets):
        for label in labels_in_order(cells):
            chosen = [c for c in cells if c["label"] == label and c["budget"] in (budget, None)]
            if not chosen:
                continue
            windows = chosen[0]["details"]["windows"]
            xs = [w["first_position"] for w in windows if w["bytes"] > 0]
            ys = [w["bits_per_byte"] for w in windows if w["bytes"] > 0]
            ax.plot(xs, ys, label=label, **styles(chosen[0]["policy"], label))
        ax.set_title(f"{name}: budget {budget_text(budget)}")
        ax.set_xlabel("first position of the window")
        ax.set_ylabel("bits per byte")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    plot_vs_budget(ax, cells, "bits_per_byte", styles)
    ax.set_title("overall bits per byte vs budget")
    ax.set_ylabel("bits per byte")
    return save(fig, out / f"{name}-stream_bpb.png")


def plot_passkey(name: str, cells, out: Path) -> Path:
    budgets = bounded_budgets(cells) or [None]
    fig, axes = panels(len(budgets))
    styles = Styles()
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
                    **styles(chosen[0]["policy"], label))
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(0.1, color="grey", linewidth=0.8, linestyle=(0, (1, 3)))
        ax.set_title(f"{name}: budget {budget_text(budget)} (mean over depths)")
        ax.set_xlabel("stream length (tokens)")
        ax.set_ylabel("passkey per-digit accuracy (chance 0.1)")
        ax.grid(alpha=0.3)
    return save(fig, out / f"{name}-passkey.png")


def plot_grocery(name: str, cells, out: Path) -> Path:
    turn_counts = sorted({c["variant"]["turns"] for c in cells})
    fig, axes = panels(len(turn_counts))
    styles = Styles()
    for ax, turns in zip(axes, turn_counts):
        plot_vs_budget(ax, [c for c in cells if c["variant"]["turns"] == turns], "item_recall",
                       styles)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{name}: {turns} turns")
        ax.set_ylabel("grocery item recall")
    return save(fig, out / f"{name}-grocery.png")


def plot_cost(name: str, cells, out: Path) -> Path:
    fig, axes = panels(2)
    styles = Styles()
    for c in cells:
        points = c["details"]["checkpoints"]
        label = f"{c['label']} @ {budget_text(c['budget'])}"
        style = styles(c["policy"], label)
        xs = [p["tokens"] for p in points]
        axes[0].plot(xs, [p["interval_tokens_per_second"] for p in points], label=label, **style)
        axes[1].plot(xs, [p["rss_bytes"] / 2**20 for p in points], label=label, **style)
    for ax, what in zip(axes, ("tokens/s since the previous checkpoint", "process RSS (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens streamed")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{name}: speed")
    axes[1].set_title(f"{name}: memory")
    return save(fig, out / f"{name}-cost.png")


# SnapKV under the three allocations is three registry policies.
SNAPKV_ALLOCATIONS = {"snapkv": "uniform", "pyramidkv": "pyramid", "adakv": "adaptive"}
ALLOCATION_LINESTYLES = {"uniform": "-", "pyramid": "--", "adaptive": ":"}


def rule_and_allocation(cell) -> tuple[str, str]:
    """("h2o", "pyramid"): the score rule and the allocation a cell ran."""
    if cell["policy"] in SNAPKV_ALLOCATIONS:
        return "snapkv", SNAPKV_ALLOCATIONS[cell["policy"]]
    return cell["policy"], cell["config"]["policy"].get("allocation", "uniform")


def plot_allocation(name: str, cells, out: Path) -> Path:
    """Quality against measured peak K/V bytes, a panel per score rule, a line per allocation."""
    task = cells[0]["task"]
    metric = "bits_per_byte" if task == "stream_bpb" else "per_digit"
    rules = [r for r in ("h2o", "tova", "snapkv")
             if any(rule_and_allocation(c)[0] == r for c in cells)]
    lengths = sorted({c["variant"]["length"] for c in cells}) if task == "passkey" else [None]
    fig, grid = plt.subplots(len(lengths), len(rules), figsize=(4.6 * len(rules),
                             3.4 * len(lengths)), squeeze=False)
    for row, length in zip(grid, lengths):
        chosen = [c for c in cells if length is None or c["variant"]["length"] == length]
        for ax, rule in zip(row, rules):
            for label in labels_in_order(chosen):
                mine = [c for c in chosen if c["label"] == label]
                by_budget = defaultdict(list)
                for c in mine:
                    by_budget[c["budget"]].append(c)
                points = sorted((max(c["metrics"]["peak_kv_bytes"] for c in group) / 1024,
                                 mean(c["metrics"][metric] for c in group))
                                for group in by_budget.values())
                cell_rule, allocation = rule_and_allocation(mine[0])
                if cell_rule == rule:
                    colour, marker = POLICY_STYLES.get("tova" if rule == "tova" else
                                                       "h2o" if rule == "h2o" else "keydiff",
                                                       UNKNOWN_POLICY_STYLE)
                    if "per layer" in label:  # TOVA's own per-layer form: hollow, thin
                        ax.plot(*zip(*points), color=colour, marker=marker, markersize=4,
                                markerfacecolor="white", linewidth=0.8, linestyle="-.",
                                label=label)
                        continue
                    ax.plot(*zip(*points), color=colour, marker=marker, markersize=4,
                            linestyle=ALLOCATION_LINESTYLES[allocation], label=label)
                elif mine[0]["budget"] is None:
                    # The full cache: a reference for retrieval; on a stream past the trained
                    # context its bits/byte are off the scale of the bounded rows.
                    if metric == "per_digit":
                        ax.axhline(points[0][1], color="black", linewidth=0.8, label=label)
                elif cell_rule not in ("h2o", "tova", "snapkv"):
                    ax.plot(*zip(*points), color="tab:gray", marker="x", markersize=4,
                            linewidth=0.8, label=label)
            ax.set_xscale("log", base=2)
            ticks = sorted({c["budget"] / 1024 for c in chosen if c["budget"] is not None})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xlabel("peak K/V bytes (KiB; ticks at the budgets)")
            ax.set_ylabel("bits per byte" if metric == "bits_per_byte"
                          else "passkey per-digit accuracy")
            where = f", {length} tokens" if length is not None else ""
            ax.set_title(f"{name}: {rule}{where}")
            ax.grid(alpha=0.3)
    return save(fig, out / f"{name}-allocation.png")


def save(fig, path: Path) -> Path:
    """One legend for the figure, right of the panels (never over the data)."""
    handles = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.tight_layout()
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


PLOTTERS = {"stream_bpb": plot_stream_bpb, "passkey": plot_passkey, "grocery": plot_grocery,
            "cost": plot_cost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of kvevict eval")
    parser.add_argument("--out", type=Path, default=Path("build/plots"),
                        help="directory of the figures (default: build/plots, outside the "
                        "committed folders; --out docs/results redraws the committed figures)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        results = json.loads(path.read_text())
        by_task = defaultdict(list)
        for cell in results["cells"]:
            by_task[cell["task"]].append(cell)
        for task, cells in by_task.items():
            print(PLOTTERS[task](results["name"], cells, args.out))
            if task in ("stream_bpb", "passkey") and any(
                    c.get("budget_unit") == "bytes" for c in cells):
                print(plot_allocation(results["name"], cells, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
