#!/usr/bin/python3
"""The toy Llama of issue 5 in PyTorch (Debian's python3-torch 1.13), its attention masks, its
export to the safetensors + config.json layout kvevict's decoder loads, and its evaluation.

Architecture (what src/lib/model/decoder.cpp computes): token embedding; per layer RMSNorm ->
grouped-query attention with RoPE (Hugging Face's half_split layout: the pairs are (i, i + d/2))
-> residual, RMSNorm -> SwiGLU MLP (down(silu(gate(x)) * up(x))) -> residual; final RMSNorm;
output head (optionally tied to the embedding). No biases. Query head h reads KV head
h // (heads / kv_heads), as Hugging Face's repeat_kv and the C++ decoder do.

Attention masks (`mask` argument):
  causal  the ordinary lower-triangular mask (Eq. 3 of AnLLM; what the C++ decoder computes with
          a full cache).
  eq4     AnLLM's anchor-based mask, Eq. 4 of Pang et al. 2024, for token i of sentence k and
          token j <= i:
            i not an anchor, j not an anchor, j in a previous sentence -> blocked
            i an anchor, j in a previous sentence (anchor or not)      -> blocked
            otherwise (j in sentence k, or j an anchor of a previous sentence and i no anchor)
                                                                        -> allowed
          An anchor <AC> is the last token of its sentence, so sentence(i) = the number of
          anchors strictly before i.
  infer   what kvevict's decoder sees under the anllm policy when tokens are fed one at a time:
          the cache holds every earlier anchor plus the tokens after the newest anchor, and the
          decoder applies no mask; so an anchor also sees the earlier anchors (Eq. 4 blocks
          those). Used to evaluate toy-anchor as kvevict will run it, and for the C++ parity
          case of the anllm policy.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import toy_data as td

# Model sizes. "smoke" is for pipeline checks only.
PRESETS = {
    "smoke": dict(dim=64, hidden_dim=192, layers=2, heads=4, kv_heads=2),
    "small": dict(dim=128, hidden_dim=384, layers=4, heads=4, kv_heads=2),
    "medium": dict(dim=192, hidden_dim=512, layers=4, heads=6, kv_heads=2),
    "deep": dict(dim=128, hidden_dim=384, layers=6, heads=4, kv_heads=2),
}


@dataclass
class ToyConfig:
    dim: int = 128
    hidden_dim: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab_size: int = td.VOCAB
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        hd = c.head_dim
        self.c = c
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.q_proj = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.gate_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.down_proj = nn.Linear(c.hidden_dim, c.dim, bias=False)

    def forward(self, x, cos, sin, bias, want_attn=False):
        c = self.c
        B, T, _ = x.shape
        hd, KV, G = c.head_dim, c.kv_heads, c.heads // c.kv_heads
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, c.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, KV, hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, KV, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # The G query heads of a KV head are stacked along the rows: one [G*T, hd] x [hd, T]
        # product per (batch, KV head), with no copies of K or V.
        q = q.reshape(B, KV, G * T, hd)
        scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-1, -2))
        scores = scores.view(B, KV, G, T, T) + bias  # bias: [B or 1, 1, 1, T, T], 0 or -inf
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.view(B, KV, G * T, T), v).view(B, c.heads, T, hd)
        x = x + self.o_proj(out.transpose(1, 2).reshape(B, T, c.heads * hd))
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, (probs.reshape(B, c.heads, T, T) if want_attn else None)


class ToyLlama(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = None if c.tied_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        self._rope_cache: dict = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = std / math.sqrt(2 * self.c.layers) if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else std
                nn.init.normal_(p, 0.0, scale)

    def rope(self, T: int, device, dtype):
        key = (T, str(device), dtype)
        if key not in self._rope_cache:
            hd = self.c.head_dim
            inv = 1.0 / (self.c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            angles = torch.outer(torch.arange(T, dtype=torch.float64), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self._rope_cache[key] = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
        return self._rope_cache[key]

    def forward(self, tokens: torch.Tensor, bias: torch.Tensor, want_attn: bool = False):
        B, T = tokens.shape
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(T, x.device, x.dtype)
        attns = []
        for layer in self.layers:
            x, attn = layer(x, cos, sin, bias, want_attn)
            attns.append(attn)
        x = self.norm(x)
        if self.lm_head is None:
            logits = x @ self.embed_tokens.weight.t()
        else:
            logits = self.lm_head(x)
        return (logits, attns) if want_attn else logits


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------

def attention_bias(tokens: torch.Tensor, mode: str, dtype=torch.float32,
                   causal_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Additive bias [B or 1, 1, 1, T, T]: 0 where attention is allowed, -inf elsewhere.
    mode: causal | eq4 | infer (see the module docstring). causal_rows (bool [B]): rows that
    use the causal mask whatever the mode (toy-anchor's mixed training)."""
    B, T = tokens.shape
    device = tokens.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if mode == "causal":
        allowed = causal.view(1, T, T)
    else:
        is_ac = tokens == td.AC
        seg = torch.cumsum(is_ac.long(), dim=1) - is_ac.long()  # anchors strictly before
        same = seg.unsqueeze(2) == seg.unsqueeze(1)  # [B, i, j]
        j_anchor = is_ac.unsqueeze(1)
        if mode == "eq4":
            reach = j_anchor & ~is_ac.unsqueeze(2)
        elif mode == "infer":
            reach = j_anchor.expand(B, T, T)
        else:
            raise ValueError(f"unknown mask mode {mode!r}")
        allowed = causal & (same | reach)
        if causal_rows is not None:
            allowed = torch.where(causal_rows.view(B, 1, 1), causal.view(1, T, T), allowed)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias.unsqueeze(1).unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------

def collate(docs: list[td.Doc], device="cpu"):
    """Right-pads with EOS (weight 0). Returns tokens [B, T] long, w [B, T] float, ans [B, T]."""
    T = max(len(d) for d in docs)
    tokens = np.full((len(docs), T), td.EOS, dtype=np.int64)
    w = np.zeros((len(docs), T), dtype=np.float32)
    ans = np.zeros((len(docs), T), dtype=np.int64)
    for i, d in enumerate(docs):
        tokens[i, :len(d)] = d.tokens
        w[i, :len(d)] = d.w
        ans[i, :len(d)] = d.ans
    return (torch.from_numpy(tokens).to(device), torch.from_numpy(w).to(device),
            torch.from_numpy(ans).to(device))


def weighted_loss(logits, tokens, w):
    """Mean of w * cross-entropy over targets 1..T-1 (normalised by the weights)."""
    V = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1),
                         reduction="none").view(tokens.shape[0], -1)
    weights = w[:, 1:]
    return (ce * weights).sum() / weights.sum().clamp_min(1e-9), ce


# ---------------------------------------------------------------------------------------------
# Export: safetensors + config.json (+ SHA256SUMS)
# ---------------------------------------------------------------------------------------------

def hf_state(model: ToyLlama) -> dict[str, np.ndarray]:
    """Tensors under Hugging Face Llama names, f32, PyTorch [out, in] layout."""
    out: dict[str, np.ndarray] = {}
    sd = {k: v.detach().to("cpu", torch.float32).contiguous().numpy() for k, v in
          model.state_dict().items()}
    out["model.embed_tokens.weight"] = sd["embed_tokens.weight"]
    for i in range(model.c.layers):
        p = f"layers.{i}."
        q = f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[q + f"self_attn.{name}.weight"] = sd[p + f"{name}.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[q + f"mlp.{name}.weight"] = sd[p + f"{name}.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    if not model.c.tied_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def load_hf_state(model: ToyLlama, tensors: dict[str, np.ndarray]) -> None:
    sd = {}
    sd["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    for i in range(model.c.layers):
        p = f"layers.{i}."
        q = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = tensors[q + "input_layernorm.weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"{name}.weight"] = tensors[q + f"self_attn.{name}.weight"]
        sd[p + "post_attention_layernorm.weight"] = tensors[q + "post_attention_layernorm.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"{name}.weight"] = tensors[q + f"mlp.{name}.weight"]
    sd["norm.weight"] = tensors["model.norm.weight"]
    if not model.c.tied_embeddings:
        sd["lm_head.weight"] = tensors["lm_head.weight"]
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()})


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """The safetensors format: u64 LE header length, JSON header (padded with spaces to a
    multiple of 8), then the tensors' bytes back to back (all F32 here, so all aligned)."""
    header: dict = {}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            raise ValueError(f"{name}: only F32 is read here, got {entry['dtype']}")
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(raw[base + begin:base + end], dtype="<f4").reshape(
            entry["shape"])
    return out


def config_json(c: ToyConfig, extra: dict | None = None) -> dict:
    result = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.context_length,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tied_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": td.BOS,
        "eos_token_id": td.EOS,
        "anchor_token_id": td.AC,
        "kvevict_tokenizer": "bytes",
    }
    if extra:
        result.update(extra)
    return result


def load_exported(model_dir: Path) -> ToyLlama:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    c = ToyConfig(dim=cfg["hidden_size"], hidden_dim=cfg["intermediate_size"],
                  layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                  kv_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"],
                  context_length=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
                  norm_eps=cfg["rms_norm_eps"], tied_embeddings=cfg["tie_word_embeddings"])
    model = ToyLlama(c)
    load_hf_state(model, read_safetensors(model_dir / "model.safetensors"))
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def score_docs(model: ToyLlama, docs: list[td.Doc], mode: str, batch: int = 16):
    """Per document: (logp of each target [T-1], argmax == target [T-1]) as numpy arrays."""
    results = []
    for start in range(0, len(docs), batch):
        chunk = docs[start:start + batch]
        tokens, _, _ = collate(chunk, next(model.parameters()).device)
        logits = model(tokens, attention_bias(tokens, mode))
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target = tokens[:, 1:]
        lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu()
        hit = (logp.argmax(-1) == target).cpu()
        for i, d in enumerate(chunk):
            n = len(d) - 1
            results.append((lp[i, :n].numpy(), hit[i, :n].numpy()))
    return results


def answer_metrics(docs: list[td.Doc], scored) -> dict[str, float]:
    """byte: accuracy over answer bytes (teacher forcing); exact: fraction of answers whose
    bytes are all argmax-correct (= greedy decoding gets the answer, given a correct prefix);
    all: fraction of documents with every answer exact."""
    byte_hits, byte_total, exact, answers, docs_all = 0, 0, 0, 0, 0
    for d, (_, hit) in zip(docs, scored):
        ans = np.asarray(d.ans[1:])
        ids = [a for a in np.unique(ans) if a]
        ok_doc = True
        for a in ids:
            h = hit[ans == a]
            byte_hits += int(h.sum())
            byte_total += len(h)
            answers += 1
            exact += int(h.all())
            ok_doc &= bool(h.all())
        docs_all += int(ok_doc and bool(ids))
    return {"byte": byte_hits / max(1, byte_total), "exact": exact / max(1, answers),
            "all": docs_all / max(1, len(docs))}


def bits_per_byte(docs: list[td.Doc], scored) -> float:
    """-log2 p summed over byte targets (ids < 256; anchors and padding excluded) / bytes."""
    bits, count = 0.0, 0
    for d, (lp, _) in zip(docs, scored):
        target = np.asarray(d.tokens[1:])
        keep = target < 256
        bits += float(-lp[keep].sum()) / math.log(2)
        count += int(keep.sum())
    return bits / max(1, count)


@torch.no_grad()
def sink_mass(model: ToyLlama, docs: list[td.Doc], mode: str, skip: int = 16):
    """Attention probability on token 0 (BOS) per layer: mean over heads and over query positions
    >= skip, and the largest single head's mean."""
    tokens, _, _ = collate(docs, next(model.parameters()).device)
    _, attns = model(tokens, attention_bias(tokens, mode), want_attn=True)
    mean, top = [], []
    for a in attns:  # [B, H, T, T]
        per_head = a[:, :, skip:, 0].mean(dim=(0, 2))
        mean.append(float(per_head.mean()))
        top.append(float(per_head.max()))
    return mean, top


def evaluate(model: ToyLlama, sets: dict[str, list[td.Doc]], modes: tuple[str, ...],
             batch: int = 16) -> dict[str, float]:
    """Metrics per set and mask mode: keys like 'causal/passkey@512@0.1/exact',
    'causal/prose@512/bpb', 'causal/sink_mean_L0'."""
    model.eval()
    out: dict[str, float] = {}
    for mode in modes:
        for name, docs in sets.items():
            scored = score_docs(model, docs, mode, batch)
            if name.startswith("prose"):
                out[f"{mode}/{name}/bpb"] = bits_per_byte(docs, scored)
            else:
                for key, value in answer_metrics(docs, scored).items():
                    out[f"{mode}/{name}/{key}"] = value
        prose = next((docs for name, docs in sets.items() if name.startswith("prose")), None)
        if prose:
            mean, top = sink_mass(model, prose[:8], mode)
            for layer, (m, t) in enumerate(zip(mean, top)):
                out[f"{mode}/sink_mean_L{layer}"] = m
                out[f"{mode}/sink_top_L{layer}"] = t
    model.train()
    return out


def config_dict(c: ToyConfig) -> dict:
    return asdict(c)
