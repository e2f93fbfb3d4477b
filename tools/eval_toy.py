#!/usr/bin/python3
"""PyTorch-side evaluation of an exported toy model (models/<name>/ as written by train_toy.py):
held-out bits/byte, passkey per-digit and exact-match accuracy at depths 0.1/0.5/0.9, recall on
the named-key, associative-recall and grocery tasks, and the attention mass on token 0 per layer.
Every document is built from held-out prose only (tools/toy_data.py).

  /usr/bin/python3 tools/eval_toy.py models/toy-base
  /usr/bin/python3 tools/eval_toy.py models/toy-anchor --anchors --modes eq4,infer,causal
  /usr/bin/python3 tools/eval_toy.py models/toy-base --lengths 256,512 --n 64 --json out.json

Metrics (teacher forcing; see toy_model.answer_metrics): byte = accuracy over answer bytes,
exact = answers whose bytes are all argmax-correct (what greedy decoding produces), all =
documents with every answer exact. Mask modes: causal (full cache, what the C++ decoder computes
with the full policy), eq4 (AnLLM's training mask), infer (kvevict's anllm policy fed one token at
a time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a machine whose cores are also busy with other
# work, spinning threads made two-thread training 10x slower (tools/README.md). Override with
# OMP_WAIT_POLICY=ACTIVE on an otherwise idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_data as td  # noqa: E402
import toy_model as tm  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--anchors", action="store_true",
                   help="insert <AC> after every sentence (toy-anchor)")
    p.add_argument("--modes", default=None,
                   help="comma-separated mask modes (default causal; eq4,infer,causal with "
                   "--anchors)")
    p.add_argument("--lengths", default=None, help="document lengths (default ctx/2,ctx)")
    p.add_argument("--n", type=int, default=64, help="documents per set")
    p.add_argument("--seed", type=int, default=20240905)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the metrics here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = tm.load_exported(Path(args.model_dir))
    ctx = model.c.context_length
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else (ctx // 2, ctx)
    modes = tuple(args.modes.split(",")) if args.modes else (
        ("eq4", "infer", "causal") if args.anchors else ("causal",))
    sets = td.eval_sets(ctx, args.anchors, n=args.n, seed=args.seed, lengths=lengths)
    metrics = tm.evaluate(model, sets, modes)
    for key, value in metrics.items():
        print(f"{key:44s} {value:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model_dir": args.model_dir, "lengths": lengths,
                                               "n": args.n, "metrics": metrics}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
