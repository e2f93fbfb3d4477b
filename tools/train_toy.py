#!/usr/bin/python3
"""Trains a kvevict toy model (issue 5) on CPU (or CUDA), with a fixed step count and seed, and
exports it where kvevict's decoder loads it.

  toy-base    a byte-level Llama trained on synthetic long-range tasks embedded in prose
              (tools/toy_data.py) with a length curriculum, answers weighted.
  toy-anchor  the same data with <AC> after every sentence and AnLLM's anchor attention mask
              (Eq. 4 of Pang et al. 2024) on most rows; by default continued from toy-base
              (AnLLM continually pre-trains a full-attention model), <AC>'s embedding row
              initialised to the mean of the embedding matrix as in the paper (Sec. 4.1).

Outputs:
  --out DIR         model.safetensors, config.json (kvevict keys), SHA256SUMS, train_log.csv,
                    eval.json
  --expected FILE   expected logits for fixed prompts (tests/test_toy_models.cpp checks that the
                    C++ decoder reproduces them to 1e-4)
  --work DIR        checkpoints (resume with --resume) and the running log

Determinism: the weights depend only on --seed (torch init), the data only on --seed (numpy
Generators) and the step count; wall time never decides anything. The number of threads may
change floating-point summation order, so bit-identical reruns need the same --threads.

See tools/README.md for the recipe, the measured speed and the exact commands of the full runs.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a machine whose cores are also busy with other
# work, spinning threads made two-thread training 10x slower (tools/README.md). Override with
# OMP_WAIT_POLICY=ACTIVE on an otherwise idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_data as td  # noqa: E402
import toy_model as tm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Curricula: (end as a fraction of the steps, row length as a fraction of the context, task mix).
# Rows of one step hold batch_tokens tokens, so short phases have proportionally more rows (and
# more answers) per step.
CURRICULA = {
    # From scratch: short documents packed with copy targets first, so that induction / retrieval
    # heads form while the filler between key and query is short; then the full context, with
    # plain prose mixed in for language modelling.
    "default": [
        (0.25, 0.25, {"passkey": 3, "named": 2, "assoc": 2, "grocery": 1, "repeat": 2}),
        (0.55, 0.5, {"passkey": 3, "named": 2, "assoc": 2, "grocery": 2, "repeat": 1, "prose": 1}),
        (1.0, 1.0, {"passkey": 3, "named": 2, "assoc": 1, "grocery": 2, "repeat": 1, "prose": 3}),
    ],
    # Recipe probes (not for the real models): only the first phase's short rows.
    "probe": [
        (1.0, 0.25, {"passkey": 3, "named": 2, "assoc": 2, "grocery": 1, "repeat": 2}),
    ],
    # Continued training (toy-anchor from toy-base): the full context with a shorter warm-up
    # phase at half length.
    "continue": [
        (0.2, 0.5, {"passkey": 3, "named": 2, "assoc": 2, "grocery": 2, "repeat": 1, "prose": 1}),
        (1.0, 1.0, {"passkey": 3, "named": 2, "assoc": 1, "grocery": 2, "repeat": 1, "prose": 3}),
    ],
}


# Tasks with answers; the log shows the training-batch answer-byte accuracy of each.
TRAIN_TASKS = ("passkey", "named", "assoc", "grocery", "repeat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("base", "anchor"), required=True)
    p.add_argument("--name", help="model name (default toy-base / toy-anchor)")
    p.add_argument("--preset", choices=sorted(tm.PRESETS), default="small")
    p.add_argument("--ctx", type=int, default=512, help="trained context (row length)")
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 from "
                   "scratch, 1e-3 when continuing)")
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 4%%, <= 200)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--answer-weight", type=float, default=5.0)
    p.add_argument("--curriculum", choices=sorted(CURRICULA), default=None,
                   help="default: 'default' from scratch, 'continue' with --init")
    p.add_argument("--init", help="start from an exported model directory (toy-anchor: toy-base)")
    p.add_argument("--anchor-causal-frac", type=float, default=0.1,
                   help="toy-anchor: fraction of rows trained with the causal mask (anchors still "
                   "in the text) so that full-cache inference keeps working")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=16, help="documents per set, periodic eval")
    p.add_argument("--eval-length", type=int, default=None,
                   help="document length of the periodic eval (default --ctx)")
    p.add_argument("--final-eval-n", type=int, default=64)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--out", help="export directory (default models/<name>)")
    p.add_argument("--work", help="checkpoint directory (default /tmp/kvevict-train/<name>)")
    p.add_argument("--expected", help="expected-logits JSON (default "
                   "tests/data/models/<name>_expected_logits.json)")
    p.add_argument("--resume", action="store_true", help="continue from --work/checkpoint.pt")
    p.add_argument("--stop-after", type=int, default=0, metavar="STEP",
                   help="save a checkpoint and exit after STEP (the schedule still spans --steps; "
                   "continue later with --resume)")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--benchmark", type=float, default=0.0, metavar="SECONDS",
                   help="only measure steps/s of each curriculum phase for SECONDS each, then exit")
    args = p.parse_args(argv)
    args.name = args.name or f"toy-{args.model}"
    args.out = Path(args.out or REPO / "models" / args.name)
    args.work = Path(args.work or f"/tmp/kvevict-train/{args.name}")
    args.expected = Path(args.expected or
                         REPO / "tests" / "data" / "models" / f"{args.name}_expected_logits.json")
    args.eval_length = args.eval_length or args.ctx
    if args.curriculum is None:
        args.curriculum = "continue" if args.init else "default"
    if args.lr is None:
        args.lr = 1e-3 if args.init else 2e-3
    if args.warmup is None:
        args.warmup = min(200, max(1, args.steps // 25))
    return args


def phase_at(curriculum, step: int, steps: int):
    frac = step / max(1, steps)
    for index, (end, length_frac, mix) in enumerate(curriculum):
        if frac < end or index == len(curriculum) - 1:
            return index, length_frac, mix
    raise AssertionError


def lr_at(args, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cosine)


def make_batch(args, rng: np.random.Generator, length: int, mix: dict):
    rows = max(1, args.batch_tokens // length)
    tasks = sorted(mix)
    p = np.array([mix[t] for t in tasks], dtype=np.float64)
    p /= p.sum()
    anchors = args.model == "anchor"
    docs = [td.training_doc(tasks[int(rng.choice(len(tasks), p=p))], rng, length, anchors,
                            args.answer_weight) for _ in range(rows)]
    causal_rows = None
    if anchors:
        causal_rows = torch.from_numpy(rng.random(rows) < args.anchor_causal_frac)
    return docs, causal_rows


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def eval_modes(args) -> tuple[str, ...]:
    return ("eq4", "infer", "causal") if args.model == "anchor" else ("causal",)


def summary_keys(args, layers: int) -> list[str]:
    """Columns of the periodic-eval part of the CSV log."""
    L = args.eval_length
    keys = []
    for mode in eval_modes(args):
        keys.append(f"{mode}/prose@{L}/bpb")
        for depth in td.EVAL_DEPTHS:
            keys += [f"{mode}/passkey@{L}@{depth}/byte", f"{mode}/passkey@{L}@{depth}/exact"]
        keys += [f"{mode}/named@{L}/exact", f"{mode}/assoc@{L}/exact",
                 f"{mode}/grocery@{L}/exact", f"{mode}/grocery@{L}/all"]
        keys += [f"{mode}/sink_mean_L{i}" for i in range(layers)]
    return keys


def export(args, model: tm.ToyLlama, info: dict) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    extra = {"kvevict_model": {"name": args.name, **info}}
    tm.write_safetensors(out / "model.safetensors", tm.hf_state(model),
                         metadata={"format": "pt", "kvevict_model": args.name})
    (out / "config.json").write_text(json.dumps(tm.config_json(model.c, extra), indent=2) + "\n")
    lines = []
    for name in ("model.safetensors", "config.json"):
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()
        lines.append(f"{digest}  {name}\n")
    (out / "SHA256SUMS").write_text("".join(lines))


def expected_logits(args, model: tm.ToyLlama) -> dict:
    """Fixed prompts and the logits of a few positions, computed in float64 (the C++ decoder
    computes in f32; the test allows 1e-4). Cases: held-out prose (full cache, chunks of 64);
    a held-out passkey document up to the answer (full cache, chunks of 16); toy-anchor also a
    document with anchors under the anllm policy fed one token at a time (mask 'infer')."""
    anchors = args.model == "anchor"
    src = td.corpus("heldout")
    rng = np.random.default_rng([args.seed, 99])
    cases = []
    prose = td.Builder(anchors=False)
    td.add_prose(prose, 95, rng, src, start=10)
    L = min(args.ctx, 256)
    pk = td.passkey_doc(rng, L, src, anchors=anchors, depth=0.5)
    first_answer = pk.ans.index(next(a for a in pk.ans if a))
    pk_tokens = pk.tokens[:first_answer]
    cases.append(dict(name="prose", policy="full", params={}, chunk=64, mode="causal",
                      token_ids=prose.tokens))
    cases.append(dict(name="passkey", policy="full", params={}, chunk=16, mode="causal",
                      token_ids=pk_tokens))
    if anchors:
        doc = td.Builder(anchors=True)
        td.add_prose(doc, 120, rng, src, start=40)
        cases.append(dict(name="anllm_prose", policy="anllm", params={"anchor_ids": [td.AC]},
                          chunk=1, mode="infer", token_ids=doc.tokens))
    model64 = tm.ToyLlama(model.c).double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model64.eval()
    for case in cases:
        tokens = torch.tensor([case["token_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = model64(tokens, tm.attention_bias(tokens, case.pop("mode"), torch.float64))[0]
        n = tokens.shape[1]
        positions = sorted({0, 1, n // 3, n // 2, n - 2, n - 1})
        case["positions"] = positions
        case["logits"] = [[float(f"{x:.9g}") for x in logits[p].tolist()] for p in positions]
        case["argmax_last"] = int(logits[-1].argmax())
    try:
        model_dir = str(args.out.resolve().relative_to(REPO))
    except ValueError:
        model_dir = str(args.out.resolve())
    return {"format": "kvevict-expected-logits/1", "model_dir": model_dir,
            "model_sha256": hashlib.sha256((args.out / "model.safetensors").read_bytes()
                                           ).hexdigest(),
            "tolerance": 1e-4, "computed_in": "float64 (PyTorch)", "cases": cases}


def dump_expected(data: dict) -> str:
    """JSON with one line per case (the logits arrays stay on their case's line)."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append(' "cases": [')
    lines.append(",\n".join("  " + json.dumps(case, separators=(",", ":"))
                            for case in data["cases"]))
    lines.append(" ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save_checkpoint(args, step, model, opt, rng, log_rows, running):
    """Everything a resumed run needs to continue bit-exactly (same --threads): weights,
    optimizer, data generator state, log, and the running sums of the current log interval."""
    args.work.mkdir(parents=True, exist_ok=True)
    tmp = args.work / "checkpoint.pt.tmp"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "rng": rng.bit_generator.state, "log": log_rows, "running": running,
                "args": {k: str(v) for k, v in vars(args).items()}}, tmp)
    os.replace(tmp, args.work / "checkpoint.pt")


def benchmark(args, model, opt) -> int:
    rng = np.random.default_rng([args.seed, 7])
    curriculum = CURRICULA[args.curriculum]
    total = 0.0
    print(f"benchmark: preset {args.preset}, {sum(p.numel() for p in model.parameters())} "
          f"parameters, {args.threads} threads, {args.batch_tokens} tokens/step")
    for index, (end, length_frac, mix) in enumerate(curriculum):
        length = int(args.ctx * length_frac)
        start = (curriculum[index - 1][0] if index else 0.0)
        steps_done, t0, data_s = 0, None, 0.0
        while True:
            d0 = time.perf_counter()
            docs, causal_rows = make_batch(args, rng, length, mix)
            tokens, w, _ = tm.collate(docs, args.device)
            data_s += time.perf_counter() - d0
            bias = tm.attention_bias(tokens, "eq4" if args.model == "anchor" else "causal",
                                     causal_rows=causal_rows)
            loss, _ = tm.weighted_loss(model(tokens, bias), tokens, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if t0 is None:  # the first step warms up allocators
                t0, data_s, steps_done = time.perf_counter(), 0.0, 0
                continue
            steps_done += 1
            if time.perf_counter() - t0 >= args.benchmark:
                break
        rate = steps_done / (time.perf_counter() - t0)
        share = end - start
        total += share / rate
        print(f"phase {index}: rows of {length} tokens, {steps_done} steps in "
              f"{time.perf_counter() - t0:.1f} s = {rate:.3f} steps/s "
              f"(data {data_s / max(1, steps_done) * 1000:.0f} ms/step), {share:.0%} of the steps")
    print(f"mean: {1 / total:.3f} steps/s -> {5400 / total:.0f} steps in 90 minutes")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    preset = dict(tm.PRESETS[args.preset])
    c = tm.ToyConfig(**preset, context_length=args.ctx, tied_embeddings=args.tied)
    model = tm.ToyLlama(c)
    info = {"model": args.model, "preset": args.preset, "steps": args.steps, "seed": args.seed,
            "curriculum": args.curriculum, "batch_tokens": args.batch_tokens, "lr": args.lr,
            "answer_weight": args.answer_weight, "git_commit": git_commit(),
            "corpus_sha256": td.corpus_digest(), "heldout_kjv_books": list(td.HELDOUT_KJV_BOOKS),
            "heldout_fortune_files": list(td.HELDOUT_FORTUNE_FILES)}
    if args.model == "anchor":
        info["anchor_mask"] = "AnLLM Eq. 4"
        info["anchor_causal_frac"] = args.anchor_causal_frac
    if args.init:
        init = tm.load_exported(Path(args.init))
        if init.c != c:
            raise SystemExit(f"--init {args.init}: configuration {init.c} differs from {c}")
        model.load_state_dict(init.state_dict())
        if args.model == "anchor":  # AnLLM-AC: <AC> starts as the mean embedding (Sec. 4.1)
            with torch.no_grad():
                model.embed_tokens.weight[td.AC] = model.embed_tokens.weight[:256].mean(0)
        info["init"] = str(args.init)
        info["init_sha256"] = hashlib.sha256(
            (Path(args.init) / "model.safetensors").read_bytes()).hexdigest()
    model.to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in model.parameters())
    info["parameters"] = n_params
    if args.benchmark > 0:
        return benchmark(args, model, opt)

    rng = np.random.default_rng([args.seed, 7])
    curriculum = CURRICULA[args.curriculum]
    start_step, log_rows, resumed = 0, [], None
    ckpt = args.work / "checkpoint.pt"
    if args.resume:
        if not ckpt.exists():
            raise SystemExit(f"--resume: no {ckpt}")
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        start_step, log_rows, resumed = state["step"], state["log"], state["running"]
        print(f"resumed at step {start_step}")

    anchors = args.model == "anchor"
    periodic_sets = td.eval_sets(args.eval_length, anchors, n=args.eval_n)
    keys = summary_keys(args, c.layers)
    fields = ["step", "phase", "row_tokens", "tokens_seen", "lr", "loss", "answer_byte_acc",
              "elapsed_s"] + [f"train_acc_{t}" for t in TRAIN_TASKS] + keys
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"{args.name}: preset {args.preset} {c}, {n_params} parameters, {args.steps} steps, "
          f"curriculum {args.curriculum}, {args.threads} threads", flush=True)

    loss_sum, loss_n, hit_sum, hit_n = 0.0, 0, 0, 0
    task_hits: dict[str, int] = {}
    task_n: dict[str, int] = {}
    tokens_seen, elapsed = 0, 0.0
    if resumed:
        (loss_sum, loss_n, hit_sum, hit_n, task_hits, task_n, tokens_seen,
         elapsed) = resumed
    t_start = time.perf_counter() - elapsed

    def running():
        return (loss_sum, loss_n, hit_sum, hit_n, dict(task_hits), dict(task_n), tokens_seen,
                time.perf_counter() - t_start)
    model.train()
    for step in range(start_step, args.steps):
        phase, length_frac, mix = phase_at(curriculum, step, args.steps)
        length = int(args.ctx * length_frac)
        docs, causal_rows = make_batch(args, rng, length, mix)
        tokens, w, ans = tm.collate(docs, args.device)
        bias = tm.attention_bias(tokens, "eq4" if anchors else "causal",
                                 causal_rows=causal_rows.to(args.device)
                                 if causal_rows is not None else None)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        logits = model(tokens, bias)
        loss, _ = tm.weighted_loss(logits, tokens, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        tokens_seen += tokens.numel()
        loss_sum += float(loss)
        loss_n += 1
        with torch.no_grad():
            mask = ans[:, 1:] > 0
            if mask.any():
                hits = (logits[:, :-1].argmax(-1) == tokens[:, 1:]) & mask
                hit_sum += int(hits.sum())
                hit_n += int(mask.sum())
                row_hits, row_n = hits.sum(1).tolist(), mask.sum(1).tolist()
                for doc, h, n in zip(docs, row_hits, row_n):
                    task_hits[doc.task] = task_hits.get(doc.task, 0) + h
                    task_n[doc.task] = task_n.get(doc.task, 0) + n
        done = step + 1
        row = None
        if done % args.log_every == 0 or done == args.steps or done % args.eval_every == 0:
            row = {"step": done, "phase": phase, "row_tokens": length, "tokens_seen": tokens_seen,
                   "lr": f"{lr_at(args, step):.3e}", "loss": round(loss_sum / loss_n, 4),
                   "answer_byte_acc": round(hit_sum / max(1, hit_n), 4),
                   "elapsed_s": round(time.perf_counter() - t_start, 1)}
            for task in TRAIN_TASKS:
                if task_n.get(task):
                    row[f"train_acc_{task}"] = round(task_hits[task] / task_n[task], 4)
            loss_sum, loss_n, hit_sum, hit_n = 0.0, 0, 0, 0
            task_hits, task_n = {}, {}
        if row is not None and (done % args.eval_every == 0 or done == args.steps):
            metrics = tm.evaluate(model, periodic_sets, eval_modes(args))
            for k in keys:
                row[k] = round(metrics.get(k, float("nan")), 4)
        if row is not None:
            log_rows.append(row)
            shown = " ".join(f"{k.split('/', 1)[-1] if '/' in k else k}={v}"
                             for k, v in row.items() if k in fields[:8] or
                             k.startswith("train_acc_") or
                             (k in keys and ("exact" in k or "bpb" in k) and
                              k.startswith(eval_modes(args)[0])))
            print(shown, flush=True)
            with open(args.work / "train_log.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(log_rows)
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            save_checkpoint(args, done, model, opt, rng, log_rows, running())
        if args.stop_after and done == args.stop_after and done < args.steps:
            save_checkpoint(args, done, model, opt, rng, log_rows, running())
            print(f"stopped after step {done}; continue with --resume", flush=True)
            return 0

    train_seconds = time.perf_counter() - t_start
    info["train_seconds"] = round(train_seconds, 1)
    info["tokens_seen"] = tokens_seen
    save_checkpoint(args, args.steps, model, opt, rng, log_rows, running())
    print(f"trained {args.steps} steps in {train_seconds:.0f} s; final evaluation", flush=True)
    final_sets = td.eval_sets(args.ctx, anchors, n=args.final_eval_n,
                              lengths=(args.ctx // 2, args.ctx))
    final = tm.evaluate(model.cpu(), final_sets, eval_modes(args))
    result = {"name": args.name, "info": info, "config": tm.config_dict(c), "metrics": final}
    (args.work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    for k, v in final.items():
        if "sink_top" not in k:
            print(f"  {k:40s} {v:.4f}")
    if args.no_export:
        return 0
    export(args, model.cpu(), info)
    for name in ("train_log.csv", "eval.json"):
        (args.out / name).write_bytes((args.work / name).read_bytes())
    args.expected.parent.mkdir(parents=True, exist_ok=True)
    args.expected.write_text(dump_expected(expected_logits(args, model.cpu())))
    print(f"exported {args.out} and {args.expected}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
