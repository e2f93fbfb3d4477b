#!/usr/bin/python3
"""Quick self-checks of tools/ (seconds, one thread): the attention masks against a brute-force
reading of AnLLM's Eq. 4 and of kvevict's anllm inference view, the safetensors export round
trip, training rows of exact length with their answers intact, and determinism of the data.

  /usr/bin/python3 tools/selftest_toy.py
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_data as td  # noqa: E402
import toy_model as tm  # noqa: E402


def check_masks() -> None:
    tokens = torch.tensor([[td.BOS, 65, 66, td.AC, 67, 68, td.AC, 69, td.AC, 70, 71]])
    T = tokens.shape[1]
    anchor = [t == td.AC for t in tokens[0].tolist()]
    sentence, count = [], 0
    for a in anchor:
        sentence.append(count)
        count += a

    def eq4(i: int, j: int) -> bool:  # Pang et al. 2024, Eq. 4, case by case
        if j > i:
            return False
        earlier = sentence[j] < sentence[i]
        if not anchor[i] and not anchor[j] and earlier:
            return False
        if anchor[i] and earlier:
            return False
        return True

    def infer(i: int, j: int) -> bool:  # cache under anllm, one token per forward
        return j <= i and (sentence[j] == sentence[i] or anchor[j])

    for mode, rule in (("eq4", eq4), ("infer", infer)):
        allowed = tm.attention_bias(tokens, mode)[0, 0, 0] == 0
        expected = torch.tensor([[rule(i, j) for j in range(T)] for i in range(T)])
        assert torch.equal(allowed, expected), mode
    mixed = tm.attention_bias(torch.cat([tokens, tokens]), "eq4",
                              causal_rows=torch.tensor([True, False]))
    assert torch.equal(mixed[0, 0, 0] == 0, torch.ones(T, T, dtype=torch.bool).tril())
    assert torch.equal(mixed[1, 0, 0] == 0, tm.attention_bias(tokens, "eq4")[0, 0, 0] == 0)
    print("masks: eq4, infer and mixed rows match their definitions")


def check_export() -> None:
    torch.manual_seed(0)
    c = tm.ToyConfig(**tm.PRESETS["smoke"], context_length=64)
    model = tm.ToyLlama(c).eval()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tm.write_safetensors(d / "model.safetensors", tm.hf_state(model))
        (d / "config.json").write_text(json.dumps(tm.config_json(c)))
        loaded = tm.load_exported(d)
    x = torch.randint(0, td.VOCAB, (2, 40))
    bias = tm.attention_bias(x, "causal")
    assert torch.equal(model(x, bias), loaded(x, bias))
    print("export: safetensors + config.json round trip is exact")


def check_rows() -> None:
    expected_answers = {"passkey": lambda m: 1, "named": lambda m: len(m["asked"]),
                        "assoc": lambda m: len(m["asked"]), "grocery": lambda m: len(m["items"])}
    for anchors in (False, True):
        for length in (128, 256, 512):
            for task in ("passkey", "named", "assoc", "grocery", "repeat", "prose"):
                rng = np.random.default_rng(0)
                lost = 0
                for _ in range(50):
                    doc = td.training_doc(task, rng, length, anchors, 5.0)
                    assert len(doc) == length and len(doc.w) == length and len(doc.ans) == length
                    assert doc.tokens[0] == td.BOS
                    if task in expected_answers:
                        answers = len({a for a in doc.ans if a})
                        lost += answers < expected_answers[task](doc.meta)
                    assert anchors or td.AC not in doc.tokens
                assert lost <= 1, (task, length, anchors, lost)
    print("rows: exact lengths, BOS first, answers kept (at most 1 in 50 cut at 128 tokens)")


def check_determinism() -> None:
    a = td.training_doc("grocery", np.random.default_rng(5), 256, True, 5.0)
    b = td.training_doc("grocery", np.random.default_rng(5), 256, True, 5.0)
    assert a.tokens == b.tokens and a.w == b.w
    s1 = td.eval_sets(256, False, n=4)
    s2 = td.eval_sets(256, False, n=4)
    assert all(x.tokens == y.tokens for k in s1 for x, y in zip(s1[k], s2[k]))
    train_units = {u.strip() for u in td.corpus("train").units}
    overlap = sum(1 for u in td.corpus("heldout").units
                  if len(u.strip()) >= 30 and u.strip() in train_units)
    assert overlap == 0, overlap
    print("determinism: same seed, same documents; no held-out sentence (>= 30 bytes) in the "
          "train split")


def main() -> int:
    torch.set_num_threads(1)
    check_masks()
    check_export()
    check_rows()
    check_determinism()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
