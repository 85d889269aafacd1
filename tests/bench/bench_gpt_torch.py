#!/usr/bin/python3
"""PyTorch peer of examples/gpt.c for tests/bench/gpt.sh: the same GPT (tied
embeddings, pre-norm blocks, causal attention, GPT-2's tanh gelu), AdamW
(betas 0.9, 0.99, weight decay 0.1), batches of random byte windows.

  bench_gpt_torch.py --layers L --heads H --embd C --context T --batch B
                     --vocab V --steps N --threads K [--device cuda] [--amp bf16]

--amp bf16 runs the forward under torch.autocast (bf16 products, f32 weights
and optimizer), as examples/gpt.c --amp bf16 does (tests/bench/gpu.sh);
--amp tf32 keeps f32 and lets matrix products use TF32 (allow_tf32).

--attn sdpa writes attention as F.scaled_dot_product_attention (PyTorch 2's
fused kernels: what a PyTorch user writes today), manual as nanoGPT does
without it; auto (the default) takes sdpa where this PyTorch has it.
--compile runs the model through torch.compile; on a GPU AdamW is the fused
one where this PyTorch has it (nanoGPT's choice).

Prints "gpt impl=torch ms=<mean ms per step after 5 warm-up steps> steps=N
maxrss_kb=<peak RSS> [max_alloc_mib=<torch.cuda.max_memory_allocated>]";
other lines start with '#'.

With --seconds S it trains on the text of --data (Debian's fortunes, read
and split 90/10 as examples/gpt.c does: random windows of the first 90%)
until its steps have taken S seconds, then prints "gpt impl=torch budget
steps=N seconds=S val_loss=L": the mean loss over the first --eval-batches
batches of validation windows laid side by side, as examples/gpt.c's
--seconds run reports.  Run with Debian's
/usr/bin/python3 (python3-torch 1.13, which has no F.scaled_dot_product_attention:
attention is written out, as nanoGPT does without flash attention).
"""
import argparse
import os
import resource
import time

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    sdpa = False   # F.scaled_dot_product_attention (set by main from --attn)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2)
                   for t in self.attn(self.ln1(x)).split(C, dim=2))
        if Block.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (C // self.H) ** -0.5
            y = F.softmax(att.masked_fill(mask[:T, :T], float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, H, C):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))
        for name, p in self.named_parameters():   # nanoGPT's init, as examples/gpt.c's
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" not in name:
                std = 0.02 / (2 * L) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x, self.mask)
        return self.ln_f(x) @ self.wte.weight.T


def read_fortunes(d):
    """Every plain fortune file of d in name order, as examples/gpt.c reads them."""
    parts = []
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if (name.startswith(".") or name.endswith((".dat", ".u8")) or not os.path.isfile(path)):
            continue
        with open(path, "rb") as f:
            parts.append(f.read())
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def val_loss(m, text, cut, a):
    """Mean loss over the first eval_batches batches of side-by-side windows."""
    T, B = a.context, a.batch
    starts = np.arange(cut, len(text) - T, T)[:a.eval_batches * B]
    total, k = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(starts) - B + 1, B):
            w = torch.from_numpy(np.stack([text[s:s + T + 1] for s in starts[i:i + B]]).astype(np.int64))
            total += F.cross_entropy(m(w[:, :-1]).reshape(-1, a.vocab), w[:, 1:].reshape(-1)).item()
            k += 1
    return total / k


def budget_run(m, opt, a):
    text = read_fortunes(a.data)
    cut = len(text) * 9 // 10
    g = np.random.default_rng(7)
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        starts = g.integers(0, cut - a.context, size=a.batch)
        w = torch.from_numpy(np.stack([text[s:s + a.context + 1] for s in starts]).astype(np.int64))
        loss = F.cross_entropy(m(w[:, :-1]).reshape(-1, a.vocab), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        steps += 1
    seconds = time.perf_counter() - t0
    print("gpt impl=torch budget steps=%d seconds=%.1f val_loss=%.4f" % (
        steps, seconds, val_loss(m, text, cut, a)))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    for k, v in (("layers", 4), ("heads", 4), ("embd", 128), ("context", 64), ("batch", 12),
                 ("vocab", 256), ("steps", 30), ("threads", 1)):
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=0)
    p.add_argument("--eval-batches", type=int, default=100)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--amp", choices=["off", "bf16", "tf32"], default="off")
    p.add_argument("--attn", choices=["auto", "sdpa", "manual"], default="auto")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    dev = torch.device(a.device)
    # tf32: f32 tensors, TF32 products (examples/gpt.c --amp tf32; llm.c's fp32 trainer)
    torch.backends.cuda.matmul.allow_tf32 = a.amp == "tf32"
    torch.backends.cudnn.allow_tf32 = a.amp == "tf32"
    have_sdpa = hasattr(F, "scaled_dot_product_attention")
    if a.attn == "sdpa" and not have_sdpa:
        p.error("--attn sdpa: this PyTorch (%s) has no F.scaled_dot_product_attention" % torch.__version__)
    Block.sdpa = a.attn == "sdpa" or (a.attn == "auto" and have_sdpa)
    m = GPT(a.vocab, a.context, a.layers, a.heads, a.embd).to(dev)
    fused = {}
    if dev.type == "cuda" and "fused" in torch.optim.AdamW.__init__.__code__.co_varnames:
        fused = {"fused": True}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, **fused)
    if a.compile and not hasattr(torch, "compile"):
        print("# torch %s has no torch.compile" % torch.__version__)
        print("gpt impl=torch unavailable=compile")
        return
    if a.compile:
        m = torch.compile(m)
    if a.seconds > 0:
        budget_run(m, opt, a)
        return
    g = torch.Generator().manual_seed(7)
    t5 = None
    for step in range(1, a.steps + 1):
        x = torch.randint(0, 256, (a.batch, a.context + 1), generator=g).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.amp == "bf16"):
            logits = m(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()   # the loss read every step, as examples/gpt.c does (a sync on a GPU)
        if step == 5:
            sync(dev)
            t5 = time.perf_counter()
    sync(dev)
    ms = (time.perf_counter() - t5) * 1e3 / (a.steps - 5)
    print("# torch %s, %d threads, %s, amp %s, attention %s, compile %d, fused AdamW %d, loss %.4f" % (
        torch.__version__, a.threads, dev, a.amp, "sdpa" if Block.sdpa else "manual", a.compile,
        bool(fused), loss.item()))
    mem = ""
    if dev.type == "cuda":
        mem = " max_alloc_mib=%.0f" % (torch.cuda.max_memory_allocated() / 2**20)
    print("gpt impl=torch ms=%.2f steps=%d maxrss_kb=%d%s" % (
        ms, a.steps, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, mem))


if __name__ == "__main__":
    main()
