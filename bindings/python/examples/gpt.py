#!/usr/bin/env python3
"""The character-level GPT of examples/gpt.c in Python, its data a NumPy array.

    python3 bindings/python/examples/gpt.py --steps 200

The text of Debian's fortunes package is read into a NumPy uint8 array and
given to dtrain without a copy (dt.Dataset.from_tokens): the first 90% as
windows at every position for training, the last 10% side by side for the
validation loss.  The model, its initialisation (nanoGPT's) and AdamW are the
C example's.
"""
import argparse
import os
import sys

import numpy as np

try:   # the installed module (pip install ./bindings/python) ...
    import dtrain as dt
except ImportError:   # ... or the source tree's, run from it
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dtrain as dt  # noqa: E402


def read_fortunes(d):
    parts = []
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if name.startswith(".") or name.endswith((".dat", ".u8")) or not os.path.isfile(p):
            continue
        parts.append(np.fromfile(p, dtype=np.uint8))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


class GPT:
    def __init__(self, ctx, layers, heads, embd, context, vocab=256):
        self.ctx, self.L, self.H, self.C, self.T = ctx, layers, heads, embd, context
        std, proj = 0.02, 0.02 / (2 * layers) ** 0.5
        self.wte = ctx.embedding_params("wte", vocab, embd)
        self.wpe = ctx.embedding_params("wpe", context, embd)
        dt.init_normal(self.wte, 0, std)
        dt.init_normal(self.wpe, 0, std)
        self.h = []
        for l in range(layers):
            b = {"ln1": ctx.layer_norm_params("h.%d.ln1" % l, embd),
                 "ln2": ctx.layer_norm_params("h.%d.ln2" % l, embd)}
            for name, i, o, s in (("attn", embd, 3 * embd, std), ("proj", embd, embd, proj),
                                  ("fc", embd, 4 * embd, std), ("fc2", 4 * embd, embd, proj)):
                w, bias = ctx.linear_params("h.%d.%s" % (l, name), i, o)
                dt.init_normal(w, 0, s)
                bias.copy_from(np.zeros(o, np.float32))
                b[name] = (w, bias)
            self.h.append(b)
        self.ln_f = ctx.layer_norm_params("ln_f", embd)

    def heads(self, x, B, T):
        return dt.contiguous(dt.transpose(dt.reshape(x, (B, T, self.H, self.C // self.H)), 1, 2))

    def forward(self, idx):
        B, T = idx.shape
        C = self.C
        pos = self.ctx.from_numpy(np.arange(T, dtype=np.int32), copy=True)
        # (B, T, C) throughout: linear and layer_norm work over the last dim
        x = dt.add(dt.embedding(self.wte, idx), dt.embedding(self.wpe, pos))
        for b in self.h:
            h = dt.linear(dt.layer_norm(x, *b["ln1"]), *b["attn"])
            q, k, v = (self.heads(dt.slice(h, 2, i * C, (i + 1) * C), B, T) for i in range(3))
            y = dt.reshape(dt.transpose(dt.attention(q, k, v, causal=True), 1, 2), (B, T, C))
            x = dt.add(x, dt.linear(y, *b["proj"]))
            h = dt.gelu_tanh(dt.linear(dt.layer_norm(x, *b["ln2"]), *b["fc"]))
            x = dt.add(x, dt.linear(h, *b["fc2"]))
        x = dt.layer_norm(x, *self.ln_f)
        return dt.linear(x, self.wte)   # tied: x wte^T, (B, T, vocab)


def main():
    p = argparse.ArgumentParser()
    for k, v in (("steps", 300), ("batch", 12), ("context", 64), ("layers", 4), ("heads", 4),
                 ("embd", 128), ("eval_every", 100), ("eval_batches", 20), ("threads", 1),
                 ("seed", 1337)):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    o = p.parse_args()
    text = read_fortunes(o.data)
    if text.size < 1000:
        sys.exit("gpt.py: no text in %s (apt-get install fortunes)" % o.data)
    cut = text.size * 9 // 10
    with dt.Context(threads=o.threads, seed=o.seed) as ctx:
        train = dt.Dataset.from_tokens(ctx, text, context=o.context, stride=1, count=cut)
        val = dt.Dataset.from_tokens(ctx, text, context=o.context, first=cut,
                                     count=text.size - cut)
        m = GPT(ctx, o.layers, o.heads, o.embd, o.context)
        # two parameter groups, as nanoGPT's: no decay on the biases and layer norms
        params = ctx.params()
        groups = [{"params": [p for p in params if p.ndim >= 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = dt.Optimizer(ctx, "adamw", groups, lr=o.lr, betas=(0.9, 0.99), weight_decay=0.1)
        ld = dt.Loader(ctx, train, batch=o.batch, seed=o.seed, drop_last=True)
        vl = dt.Loader(ctx, val, batch=o.batch, shuffle=False, drop_last=True)
        print("gpt.py: %d bytes of fortunes as a NumPy array, %d layers, %d heads, %d channels, "
              "context %d, batch %d" % (text.size, o.layers, o.heads, o.embd, o.context, o.batch))
        batches, epoch = ld.epoch(0), 0
        for step in range(1, o.steps + 1):
            b = next(batches, None)
            if b is None:
                epoch += 1
                batches = ld.epoch(epoch)
                b = next(batches)
            x, y = b
            loss = dt.cross_entropy(m.forward(x), y)
            ctx.backward(loss)
            opt.step()
            opt.zero_grad()
            train_loss = loss.item()
            ctx.step_reset()
            if step % o.eval_every == 0 or step == o.steps:
                ctx.grad_enabled = False
                vs = []
                for vx, vy in vl.epoch(0):
                    vs.append(dt.cross_entropy(m.forward(vx), vy).item())
                    ctx.step_reset()
                    if len(vs) == o.eval_batches:
                        break
                ctx.grad_enabled = True
                print("step %d: train loss %.4f, val loss %.4f" % (step, train_loss,
                                                                   float(np.mean(vs))))


if __name__ == "__main__":
    main()
