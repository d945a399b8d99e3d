#!/usr/bin/env python3
"""The tiny GPT of reference/TINY_GPT.md in PyTorch, for measuring
PyTorch's training speed on the machine loom runs on.

It implements the spec's data generator, model and AdamW, starts from the
fixture's init.* parameters, checks the step-1 loss and the 200-step loss
curve against tiny_gpt.json (so that the speed measured is that of the
reference computation, not of something else), and prints one line per run
with tokens/s over the whole run, the median step's tokens/s, and the
threads PyTorch used.

Usage (Debian's python3-torch is PyTorch 1.13.1):

    apt-get install -y python3-torch
    /usr/bin/python3 cmd/loombench/pytorch/tiny_gpt.py --threads 1 --runs 3

cmd/loombench/compare_pytorch.sh runs it alternately with loom's
BenchmarkTrain200.
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


def lcg(seed):
    s = seed & 0xFFFFFFFF
    while True:
        s = (1664525 * s + 1013904223) & 0xFFFFFFFF
        yield s


class Rand:
    def __init__(self, seed):
        self.g = lcg(seed)

    def randint(self, m):
        return (next(self.g) >> 8) % m


WORDS = ("the a model rank tensor shard ring tree mesh device gradient reduces gathers "
         "scatters sends receives fast slow large small every each layer head token batch "
         "step loss is and with over").split()


def corpus(cfg):
    r = Rand(cfg["corpus_seed"])
    out = []
    n_bytes = 0
    while n_bytes < cfg["corpus_len"]:
        n = 3 + r.randint(8)
        w = r.randint(32)
        ws = [w]
        for _ in range(n - 1):
            w = (5 * w + 1 + r.randint(4)) % 32
            ws.append(w)
        s = " ".join(WORDS[i] for i in ws)
        s = s[0].upper() + s[1:] + "."
        s += "\n" if r.randint(4) == 0 else " "
        out.append(s)
        n_bytes += len(s)
    return np.frombuffer("".join(out).encode("ascii")[: cfg["corpus_len"]], dtype=np.uint8)


def batches(cfg, text):
    r = Rand(cfg["batch_seed"])
    t, b = cfg["T"], cfg["batch"]
    while True:
        offs = [r.randint(cfg["corpus_len"] - t - 1) for _ in range(b)]
        x = np.stack([text[o: o + t] for o in offs]).astype(np.int64)
        y = np.stack([text[o + 1: o + t + 1] for o in offs]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


def read_safetensors(path, prefix):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, meta in header.items():
            if not name.startswith(prefix) or meta["dtype"] != "F32":
                continue
            b0, b1 = meta["data_offsets"]
            f.seek(base + b0)
            a = np.frombuffer(f.read(b1 - b0), dtype="<f4").reshape(meta["shape"])
            out[name[len(prefix):]] = torch.from_numpy(a.copy())
        return out


class GPT(torch.nn.Module):
    """Pre-LayerNorm GPT exactly as reference/TINY_GPT.md §3 describes it."""

    def __init__(self, cfg, params, order):
        super().__init__()
        self.cfg = cfg
        self.order = order
        self.p = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(params[n].clone()) for n in order})

    def w(self, name):
        return self.p[name.replace(".", "_")]

    def forward(self, idx, y):
        c = self.cfg
        b, t = idx.shape
        d, h = c["D"], c["H"]
        dh = d // h
        x = self.w("wte")[idx] + self.w("wpe")[:t]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for l in range(c["L"]):
            p = lambda n: self.w(f"h.{l}.{n}")
            a = F.layer_norm(x, (d,), p("ln1.weight"), p("ln1.bias"), c["ln_eps"])
            qkv = F.linear(a, p("attn.qkv.weight"), p("attn.qkv.bias"))
            q, k, v = qkv.split(d, dim=2)
            q = q.view(b, t, h, dh).transpose(1, 2)
            k = k.view(b, t, h, dh).transpose(1, 2)
            v = v.view(b, t, h, dh).transpose(1, 2)
            s = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
            s = s.masked_fill(mask, float("-inf"))
            o = (F.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = x + F.linear(o, p("attn.proj.weight"), p("attn.proj.bias"))
            m = F.layer_norm(x, (d,), p("ln2.weight"), p("ln2.bias"), c["ln_eps"])
            u = F.gelu(F.linear(m, p("mlp.fc.weight"), p("mlp.fc.bias")))
            x = x + F.linear(u, p("mlp.proj.weight"), p("mlp.proj.bias"))
        x = F.layer_norm(x, (d,), self.w("ln_f.weight"), self.w("ln_f.bias"), c["ln_eps"])
        logits = F.linear(x, self.w("lm_head.weight"))
        return F.cross_entropy(logits.view(b * t, -1), y.view(b * t))


def run(cfg, ref, init, text):
    model = GPT(cfg, init, ref["param_order"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]),
                            eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    data = batches(cfg, text)
    curve, step_s = {}, []
    start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        x, y = next(data)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        curve[step] = loss.item()
    return time.perf_counter() - start, step_s, curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--reference", default=os.path.join(here, "..", "..", "..", "reference"), help="the folder of tiny_gpt.json (default: the repository's reference/)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (intra-op threads)")
    ap.add_argument("--runs", type=int, default=1, help="200-step runs, each from the fixture's init")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    ref = json.load(open(os.path.join(args.reference, "tiny_gpt.json")))
    cfg = ref["config"]
    init = read_safetensors(os.path.join(args.reference, ref["safetensors"]), "init.")
    text = corpus(cfg)
    tol = ref["tolerances"]
    tokens = cfg["batch"] * cfg["T"]
    for i in range(args.runs):
        secs, step_s, curve = run(cfg, ref, init, text)
        # The computation must be the reference's: its step-1 loss and its
        # curve, within the tolerances reference/TINY_GPT.md §7 gives loom.
        if abs(curve[1] - ref["loss_step1"]) > tol["loss_step1_rel"] * ref["loss_step1"]:
            sys.exit(f"step-1 loss {curve[1]!r}, reference {ref['loss_step1']!r}: not the reference model")
        worst = 0.0
        for s, want in zip(ref["loss_curve_every_20_steps"], ref["loss_curve_every_20"]):
            limit = tol["loss_curve_abs_steps_le_100"] if s <= 100 else tol["loss_curve_abs_steps_gt_100"]
            if s == cfg["steps"]:
                limit = min(limit, tol["loss_curve_abs_last_step"])
            if abs(curve[s] - want) > limit:
                sys.exit(f"loss at step {s} {curve[s]:.6f}, reference {want:.6f}: beyond the tolerance {limit}")
            worst = max(worst, abs(curve[s] - want))
        step_s.sort()
        print(f"pytorch {torch.__version__} threads={torch.get_num_threads()} run={i + 1}: "
              f"{tokens * len(step_s) / secs:.0f} tokens/s over {len(step_s)} steps, "
              f"median step {tokens / step_s[len(step_s) // 2]:.0f} tokens/s, "
              f"loss@{cfg['steps']} {curve[cfg['steps']]:.6f}, largest |Δ| from the reference curve {worst:.4f}", flush=True)


if __name__ == "__main__":
    main()
