#!/usr/bin/python3
"""Training curves of the toy models from their committed logs (models/<name>/train_log.csv).

    /usr/bin/python3 tools/plot_training.py models/toy-base models/toy-anchor --out docs/results

One PNG per model, <name>-training.png: the weighted training loss, held-out bits/byte, passkey
per-digit accuracy at depths 0.1/0.5/0.9 and the other tasks' exact match (periodic evaluations
with a full causal cache at the trained context; toy-anchor's under its Eq. 4 training mask), and
the attention mass on token 0 per layer.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def column(rows, name):
    points = [(int(r["step"]), float(r[name])) for r in rows if r.get(name, "") != ""]
    return [p[0] for p in points], [p[1] for p in points]


def plot(model_dir: Path, out: Path) -> Path:
    with open(model_dir / "train_log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    header = rows[0].keys()
    # Evaluation columns are "<mask>/<metric>"; use the mask the model was trained with.
    masks = sorted({h.split("/")[0] for h in header if "/" in h})
    mask = "eq4" if "eq4" in masks else masks[0]
    fig, axes = plt.subplots(1, 4, figsize=(20, 3.8))
    axes[0].plot(*column(rows, "loss"), linewidth=0.8)
    axes[0].set_title("weighted training loss")
    bpb = [h for h in header if h.startswith(f"{mask}/prose@") and h.endswith("/bpb")]
    for h in bpb:
        axes[1].plot(*column(rows, h), marker="o", markersize=3, label=h)
    axes[1].set_title("held-out bits/byte")
    for h in header:
        if h.startswith(f"{mask}/passkey@") and h.endswith("/byte"):
            axes[2].plot(*column(rows, h), marker="o", markersize=3,
                         label="passkey per-digit @" + h.split("@")[-1].split("/")[0])
        if h.startswith(f"{mask}/") and h.split("/")[-1] == "exact" and "passkey" not in h:
            axes[2].plot(*column(rows, h), linestyle="--", label=h.split("/")[1] + " exact")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].set_title("task accuracy (evaluation sets)")
    for h in header:
        if h.startswith(f"{mask}/sink_mean_L"):
            axes[3].plot(*column(rows, h), marker="o", markersize=3, label="layer " + h[-1])
    axes[3].set_title("attention mass on token 0")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{model_dir.name} ({mask} mask in the evaluations)")
    fig.tight_layout()
    path = out / f"{model_dir.name}-training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for model_dir in args.models:
        print(plot(model_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
