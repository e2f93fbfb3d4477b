#!/usr/bin/env python3
"""Markdown tables of an eval grid run with a "kv_types" axis (issue 13), from its results.csv.

    tools/kv_types_table.py eval/results/kv-types-toy-base/results.csv

Rows are the policy entries and budgets; for each non-f32 storage type the table gives the
difference of its metric to the f32 cell of the same entry and budget (bits per byte for
stream_bpb, per-digit accuracy and exact match for passkey), then the peak K/V bytes per type.
Entries are paired by label: the eval harness labels the non-f32 ones "<label> kv=<type>".
"""
import csv
import sys
from collections import defaultdict

TYPES = ["f32", "f16", "bf16", "q8_0"]


def split_label(label):
    for kv_type in TYPES[1:]:
        suffix = " kv=" + kv_type
        if label.endswith(suffix):
            return label[: -len(suffix)], kv_type
    return label, "f32"


def main(path):
    rows = list(csv.DictReader(open(path, newline="")))
    task = rows[0]["task"]
    metrics = ["bits_per_byte"] if task == "stream_bpb" else ["per_digit", "exact"]
    # (entry, budget, variant) -> type -> row
    cells = defaultdict(dict)
    order = []
    for row in rows:
        entry, kv_type = split_label(row["label"])
        key = (entry, row["budget"], row["length"], row["depth"])
        if key not in cells:
            order.append(key)
        cells[key][kv_type] = row
    for metric in metrics:
        print(f"\n{metric}: f32, and each type minus f32\n")
        print("| policy | budget | variant | f32 | " + " | ".join(t + " − f32" for t in TYPES[1:]) + " |")
        print("|---|---|---|---|" + "---|" * (len(TYPES) - 1))
        for key in order:
            by_type = cells[key]
            if "f32" not in by_type:
                continue
            base = float(by_type["f32"][metric])
            diffs = []
            for kv_type in TYPES[1:]:
                row = by_type.get(kv_type)
                diffs.append(f"{float(row[metric]) - base:+.4f}" if row else "")
            entry, budget, length, depth = key
            variant = f"length {length} depth {depth}" if length else ""
            print(f"| {entry} | {budget or '—'} | {variant} | {base:.4f} | " + " | ".join(diffs) + " |")
    print("\npeak K/V bytes per type\n")
    print("| policy | budget | " + " | ".join(TYPES) + " |")
    print("|---|---|" + "---|" * len(TYPES))
    seen = set()
    for key in order:
        entry, budget = key[0], key[1]
        if (entry, budget) in seen:
            continue
        seen.add((entry, budget))
        by_type = cells[key]
        values = [by_type[t]["peak_kv_bytes"] if t in by_type else "" for t in TYPES]
        print(f"| {entry} | {budget or '—'} | " + " | ".join(values) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tools/kv_types_table.py eval/results/<grid>/results.csv")
    main(sys.argv[1])
