#!/usr/bin/env python3
"""tests/gpt_crosscheck.py GPT_BINARY - examples/gpt.c's model, initial weights
and batches in PyTorch (Debian's python3-torch): 20 AdamW steps on each side,
then every parameter compared.

    /usr/bin/python3 tests/gpt_crosscheck.py build/test/gpt_O2 [--steps 20]

It runs the dtrain example with --save-init (the initial weights), --dump (every
step's batch) and --save (the weights after the steps), rebuilds the same GPT in
torch (the same names: wte, wpe, h.L.ln1, h.L.attn, h.L.proj, h.L.ln2, h.L.fc,
h.L.fc2, ln_f; tied output weights; causal scaled-dot-product attention; GPT-2's
tanh gelu), loads the initial weights, trains on the dumped batches with
torch.optim.AdamW (the example's lr, betas (0.9, 0.99), eps 1e-8) in the example's
two parameter groups (weight decay 0.1 on the matrices, none on the biases and layer
norms), and compares: for every parameter, max |dtrain - torch| over
max |torch| must be at most 1e-4.  Prints one line per step (both losses) and the
worst parameter; exits 1 when one is off.

    /usr/bin/python3 tests/gpt_crosscheck.py build/gpt --bf16

--bf16: dtrain trains with bf16 parameters, f32 master weights and autocast bf16
(--params bf16 --amp bf16), torch with f32 parameters under
torch.autocast("cpu", bfloat16), the mixed precision users compare with.  The two
round different things (dtrain also the layer norms' and embeddings' weights, torch
its autocast ops' inputs only), and Adam turns a gradient's rounding noise into
lr-sized steps where the gradient is near zero, so the tolerance is in steps: every
step's loss within 1% of torch's, and every saved master within 5 lr (absolute) of
torch's parameter.  For scale it prints how far torch's own f32 run ends from its
autocast run.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F


def load_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n].decode("utf-8"))
    h.pop("__metadata__", None)
    buf = b[8 + n:]
    out = {}
    for k, v in h.items():
        s, e = v["data_offsets"]
        assert v["dtype"] == "F32", (k, v["dtype"])
        out[k] = np.frombuffer(buf[s:e], "<f4").reshape(v["shape"]).copy()
    return out


class GPT(torch.nn.Module):
    def __init__(self, w, layers, heads):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.from_numpy(v)) for k, v in w.items()
             if not k.startswith("optim.")})
        self.layers, self.heads = layers, heads

    def g(self, name):
        return self.p[name.replace(".", "_")]

    def forward(self, idx):
        B, T = idx.shape
        C = self.g("wte.weight").shape[1]
        x = self.g("wte.weight")[idx] + self.g("wpe.weight")[:T]
        for l in range(self.layers):
            pre = "h.%d." % l
            h = F.layer_norm(x, (C,), self.g(pre + "ln1.weight"), self.g(pre + "ln1.bias"), 1e-5)
            qkv = F.linear(h, self.g(pre + "attn.weight"), self.g(pre + "attn.bias"))
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in qkv.split(C, dim=2))
            att = (q @ k.transpose(-2, -1)) / float(C // self.heads) ** 0.5
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v   # (Debian's torch 1.13 has no F.sdpa)
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + F.linear(y, self.g(pre + "proj.weight"), self.g(pre + "proj.bias"))
            h = F.layer_norm(x, (C,), self.g(pre + "ln2.weight"), self.g(pre + "ln2.bias"), 1e-5)
            h = F.gelu(F.linear(h, self.g(pre + "fc.weight"), self.g(pre + "fc.bias")),
                       approximate="tanh")
            x = x + F.linear(h, self.g(pre + "fc2.weight"), self.g(pre + "fc2.bias"))
        x = F.layer_norm(x, (C,), self.g("ln_f.weight"), self.g("ln_f.bias"), 1e-5)
        return x @ self.g("wte.weight").T


def groups(model):
    """gpt.c's two parameter groups (make_optim): decay on the matrices, none on the
    biases and layer norms."""
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2]},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def main():
    gpt = sys.argv[1]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 20
    bf16 = "--bf16" in sys.argv
    extra = ["--params", "bf16", "--amp", "bf16"] if bf16 else []
    B, T, layers, heads, embd, lr = 4, 32, 2, 4, 64, 1e-3
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        init, final, dump = (os.path.join(d, n) for n in ("init.st", "final.st", "batches"))
        out = subprocess.run([gpt, "--steps", str(steps), "--batch", str(B), "--context", str(T),
                              "--layers", str(layers), "--heads", str(heads), "--embd", str(embd),
                              "--lr", str(lr), "--eval-every", "1", "--eval-batches", "1",
                              "--sample", "0", "--save-init", init, "--dump", dump,
                              "--save", final] + extra, check=True, capture_output=True, text=True,
                             env=dict(os.environ, OPENBLAS_NUM_THREADS="1")).stdout
        dt_losses = [float(l.split("train loss ")[1].split(",")[0]) for l in out.splitlines()
                     if l.startswith("step ")]
        w0, w1 = load_safetensors(init), load_safetensors(final)
        batches = np.fromfile(dump, "<i4").reshape(steps, 2, B, T)
    model = GPT(w0, layers, heads)
    opt = torch.optim.AdamW(groups(model), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref = GPT({k: v.copy() for k, v in w0.items()}, layers, heads) if bf16 else None   # f32
    ref_opt = torch.optim.AdamW(groups(ref), lr=lr, betas=(0.9, 0.99), eps=1e-8,
                                weight_decay=0.1) if bf16 else None
    loss_off = False
    for s in range(steps):
        x, y = (torch.from_numpy(batches[s, i].astype(np.int64)) for i in (0, 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step %d: loss dtrain %.6f torch %.6f" % (s + 1, dt_losses[s], loss.item()))
        if bf16 and abs(dt_losses[s] - loss.item()) > 0.01 * loss.item():
            loss_off = True
        if bf16:
            ref_loss = F.cross_entropy(ref(x).reshape(-1, 256), y.reshape(-1))
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
    worst, name, scale = 0.0, "", 0.0
    for k, v in w1.items():
        if k.startswith("optim."):
            continue
        t = model.g(k).detach().numpy()
        if k.endswith("attn.bias"):
            # the key bias adds q.b_k to every score of a query's row, which softmax
            # cancels: its gradient is 0 up to rounding on both sides, and Adam turns
            # rounding noise into lr-sized steps.  Compared apart, not counted.
            C = t.shape[0] // 3
            kb = float(np.max(np.abs(v[C:2 * C] - t[C:2 * C])))
            print("  %s: key part (gradient 0 in exact arithmetic) differs by %.3g" % (k, kb))
            v, t = np.concatenate([v[:C], v[2 * C:]]), np.concatenate([t[:C], t[2 * C:]])
        r = float(np.max(np.abs(v - t)) / max(float(np.max(np.abs(t))), 1e-12))
        if bf16:   # in units of lr, absolute
            r = float(np.max(np.abs(v - t))) / lr
            f32 = ref.g(k).detach().numpy()
            if k.endswith("attn.bias"):
                f32 = np.concatenate([f32[:C], f32[2 * C:]])
            scale = max(scale, float(np.max(np.abs(f32 - t))) / lr)
        if r > worst:
            worst, name = r, k
    tol = 5.0 if bf16 else 1e-4
    ok = worst <= tol and not loss_off
    if bf16:
        print("crosscheck (bf16 parameters + f32 masters against torch.autocast bf16): %d "
              "parameters after %d AdamW steps; largest difference %.3g lr (%s, at most %g; "
              "torch f32 against torch autocast: %.3g lr)%s: %s"
              % (len(model.p), steps, worst, name, tol, scale,
                 "; a step's loss more than 1% off" if loss_off else "", "ok" if ok else "OFF"))
        return 0 if ok else 1
    print("crosscheck: %d parameters after %d AdamW steps; largest difference %.3g of the "
          "tensor's largest value (%s): %s" % (len(model.p), steps, worst, name,
                                              "ok" if ok else "OFF"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
