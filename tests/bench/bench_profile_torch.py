#!/usr/bin/python3
"""PyTorch peer of bench_profile.c: what torch.profiler costs a training step.

Run it with Debian's interpreter (/usr/bin/python3, python3-torch):

  bench_profile_torch.py [--model mlp|cnn] [--pairs P] [--block-steps S]
                         [--warmup W] [--threads N] [--data DIR]

The same models as bench_torch.py (MLP 784-512-512-10 at batch 128, the
2-conv CNN at batch 64), trained on Fashion-MNIST held in memory (uint8,
normalised per batch, a shuffled epoch after another).  Steps are timed in
blocks of S, torch.profiler.profile(activities=[CPU]) off in one block of a
pair and on in the other, the order alternating from pair to pair; entering
and leaving the profiler (which processes its events) are outside the timed
steps.  A step is everything from slicing the batch to loss.item().

Output line (as bench_profile.c):
  profile impl=torch model=mlp off_ms=.. on_ms=.. ratio=.. pooled_ratio=..
          steps=.. prof_steps=.. events=.. dropped=0
prof_steps: the "ProfilerStep" count is not kept, so it is the steps run
under the profiler; events: the op events it recorded.
Other lines start with '#'.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import cnn, mlp, read_idx_gz  # noqa: E402  (the same models and reader)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    p.add_argument("--pairs", type=int, default=0)
    p.add_argument("--block-steps", type=int, default=0)
    p.add_argument("--warmup", type=int, default=-1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    is_mlp = a.model == "mlp"
    pairs = a.pairs or (20 if is_mlp else 12)
    S = a.block_steps or (20 if is_mlp else 4)
    warmup = a.warmup if a.warmup >= 0 else (30 if is_mlp else 6)
    torch.set_num_threads(a.threads)
    print(f"# torch {torch.__version__} threads={torch.get_num_threads()}", flush=True)

    images = read_idx_gz(os.path.join(a.data, "train-images-idx3-ubyte.gz"), 16)
    labels = read_idx_gz(os.path.join(a.data, "train-labels-idx1-ubyte.gz"), 8)
    xs = torch.from_numpy(images.reshape(-1, 1, 28, 28).copy())
    ys = torch.from_numpy(labels.astype(np.int64))
    n = xs.shape[0]
    batch = 128 if is_mlp else 64
    torch.manual_seed(1234)
    model = mlp() if is_mlp else cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    mean, std = 0.2860, 0.3530
    g = torch.Generator().manual_seed(1)
    state = {"perm": torch.randperm(n, generator=g), "pos": 0, "epochs": 1, "last": 0.0}

    def step():
        if state["pos"] + batch > n:  # drop the last partial batch, reshuffle
            state["perm"] = torch.randperm(n, generator=g)
            state["pos"] = 0
            state["epochs"] += 1
        idx = state["perm"][state["pos"]:state["pos"] + batch]
        state["pos"] += batch
        x = (xs[idx].float() / 255.0 - mean) / std
        if is_mlp:
            x = x.flatten(1)
        y = ys[idx]
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        state["last"] = loss.item()

    def block(steps, prof, out, counts):
        if prof:
            with profile(activities=[ProfilerActivity.CPU]) as pr:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    out.append(time.perf_counter() - t0)
            counts[0] += steps
            counts[1] += len(pr.events())
        else:
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                out.append(time.perf_counter() - t0)

    junk = []
    block(warmup, False, junk, [0, 0])
    block(S, True, junk, [0, 0])
    block(S, False, junk, [0, 0])
    first = state["last"]
    off, on, ratios, counts = [], [], [], [0, 0]
    for i in range(pairs):
        b_on, b_off = [], []
        for prof in ((True, False) if i & 1 else (False, True)):
            block(S, prof, b_on if prof else b_off, counts)
        ratios.append(statistics.median(b_on) / statistics.median(b_off))
        on += b_on
        off += b_off
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"# {a.model}: loss {first:.4f} -> {state['last']:.4f} over {2 * len(on)} timed steps "
          f"({state['epochs']} epochs started)")
    print(f"profile impl=torch model={a.model} off_ms={m_off * 1e3:.4f} on_ms={m_on * 1e3:.4f} "
          f"ratio={statistics.median(ratios):.4f} pooled_ratio={m_on / m_off:.4f} "
          f"steps={len(on)} prof_steps={counts[0]} events={counts[1]} dropped=0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
