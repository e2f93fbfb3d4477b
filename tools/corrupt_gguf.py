#!/usr/bin/env python3
"""Runs a command over corrupted copies of a model file and counts how it ended.

kvevict's own readers are fuzzed (tests/fuzz, docs/reliability.md); kvevict-llama hands model
files to llama.cpp's loader, which is not. This checks what kvevict-llama makes of what llama.cpp
refuses: every run must end with status 0 (the corruption hit nothing that matters) or 2 (a
clear error), never a signal or a hang.

    /usr/bin/python3 tools/corrupt_gguf.py rand.gguf --runs 300 -- \
        build/release/bin/kvevict-llama stream --model {model} --input data/kjv-heldout.txt \
        --limit-bytes 50 --policy window --budget 16 -c 64

Corruptions, in turn: 1-4 random bytes of the first 20 KB (header, metadata, tensor infos); a
truncation at a random length; an 8-byte field of the first 20 KB set to 0, 2^31, 2^63 - 1 or all
ones. Inputs that crash or hang are kept as crash_<run>.gguf in --keep.
"""
import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile


def corrupt(base: bytes, run: int, rng: random.Random) -> bytes:
    data = bytearray(base)
    head = min(len(data), 20000)
    kind = run % 3
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(head)] = rng.randrange(256)
    elif kind == 1:
        data = data[: rng.randrange(8, len(data))]
    else:
        at = rng.randrange(8, head - 8)
        data[at : at + 8] = rng.choice(
            [b"\x00" * 8, (2**31).to_bytes(8, "little"), (2**63 - 1).to_bytes(8, "little"),
             b"\xff" * 8])
    return bytes(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", help="a model file the command reads")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--keep", default=".", help="where crashing inputs are kept")
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("give the command after --, with {model} for the corrupted file")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not any("{model}" in part for part in command):
        parser.error("the command must contain {model}")
    with open(args.base, "rb") as f:
        base = f.read()
    rng = random.Random(args.seed)
    outcomes = collections.Counter()
    bad = 0
    with tempfile.TemporaryDirectory() as work:
        model = os.path.join(work, "corrupted" + os.path.splitext(args.base)[1])
        for run in range(args.runs):
            with open(model, "wb") as f:
                f.write(corrupt(base, run, rng))
            try:
                status = subprocess.run([part.replace("{model}", model) for part in command],
                                        capture_output=True, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                status = "timeout"
            outcomes[status] += 1
            if status not in (0, 1, 2):
                bad += 1
                os.replace(model, os.path.join(args.keep, f"crash_{run}.gguf"))
    print(f"{args.runs} runs: " + ", ".join(f"status {k}: {v}" for k, v in sorted(
        outcomes.items(), key=lambda item: str(item[0]))))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
