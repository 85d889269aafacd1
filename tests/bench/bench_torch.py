#!/usr/bin/python3
"""PyTorch peer of bench_train.c: the same MLP / CNN training steps and the
same one-epoch Fashion-MNIST MLP run for the peak-RSS comparison.

Run it with Debian's interpreter (/usr/bin/python3, python3-torch 1.13):

  bench_torch.py [--threads N] [--model all|mlp|cnn] [--warmup W]
                 [--mlp-steps S] [--cnn-steps S] [--max-seconds T]
  bench_torch.py --rss-epoch [--threads N] [--data DIR] [--model cnn] [--eval-batch B]
    (one epoch of the MLP, or the CNN; with --eval-batch, then the test set in
    batches of B under torch.no_grad, as examples/fashion_mnist.c evaluates)

Output lines match bench_train.c:
  mlp threads=1 ms=4.12 mean=4.20 min=4.01 steps=200
  rss_epoch impl=torch threads=1 batches=469 loss=.. seconds=.. maxrss_kb=..
Other lines start with '#'.
"""
import argparse
import gzip
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn


def mlp():
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3136, 128), nn.ReLU(),
        nn.Linear(128, 10))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def bench_model(name, args):
    torch.manual_seed(1234)
    if name == "mlp":
        model, batch, xshape, steps = mlp(), 128, (128, 784), args.mlp_steps
    else:
        model, batch, xshape, steps = cnn(), 64, (64, 1, 28, 28), args.cnn_steps
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(xshape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    lossf = nn.CrossEntropyLoss()
    opt = sgd(model)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    first = last = None
    for i in range(args.warmup):
        last = step()
        if i == 0:
            first = last
    times = []
    t_start = time.perf_counter()
    while len(times) < steps:
        t0 = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t0)
        if len(times) >= 5 and time.perf_counter() - t_start > args.max_seconds:
            break
    print(f"# {name}: loss {first:.4f} -> {last:.4f} (same batch each step)")
    print(f"{name} threads={args.threads} ms={statistics.median(times) * 1e3:.4f} "
          f"mean={statistics.fmean(times) * 1e3:.4f} min={min(times) * 1e3:.4f} "
          f"steps={len(times)}", flush=True)


def read_idx_gz(path, header):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header)


def rss_epoch(args):
    d = args.data
    images = read_idx_gz(os.path.join(d, "train-images-idx3-ubyte.gz"), 16)
    labels = read_idx_gz(os.path.join(d, "train-labels-idx1-ubyte.gz"), 8)
    # Keep the images as uint8 (as dtrain does) and normalise per batch.
    conv = args.model == "cnn"
    shape = (-1, 1, 28, 28) if conv else (-1, 784)
    xs = torch.from_numpy(images.reshape(shape).copy())
    ys = torch.from_numpy(labels.astype(np.int64))
    n = xs.shape[0]
    torch.manual_seed(1)
    model = cnn() if conv else mlp()
    opt = sgd(model)
    lossf = nn.CrossEntropyLoss()
    mean, std = 0.2860, 0.3530
    t0 = time.perf_counter()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    batches, loss_sum, last = 0, 0.0, 0.0
    for s in range(0, n, 128):
        idx = perm[s:s + 128]
        x = (xs[idx].float() / 255.0 - mean) / std
        y = ys[idx]
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        last = loss.item()
        loss_sum += last
        batches += 1
    if args.eval_batch > 0:
        timg = read_idx_gz(os.path.join(d, "t10k-images-idx3-ubyte.gz"), 16)
        tx = torch.from_numpy(timg.reshape(shape).copy())
        correct = 0
        with torch.no_grad():
            for s in range(0, tx.shape[0], args.eval_batch):
                x = (tx[s:s + args.eval_batch].float() / 255.0 - mean) / std
                correct += int((model(x).argmax(1) == 0).sum())   # the work, not the score
        del tx
    secs = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"rss_epoch impl=torch threads={args.threads} batches={batches} "
          f"loss={loss_sum / batches:.4f} last={last:.4f} seconds={secs:.3f} "
          f"maxrss_kb={rss}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="all", choices=["all", "mlp", "cnn"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mlp-steps", type=int, default=200)
    p.add_argument("--cnn-steps", type=int, default=50)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--rss-epoch", action="store_true")
    p.add_argument("--eval-batch", type=int, default=0)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__} threads={torch.get_num_threads()} "
          f"interop={torch.get_num_interop_threads()}", flush=True)
    if args.rss_epoch:
        rss_epoch(args)
        return 0
    for name in (["mlp", "cnn"] if args.model == "all" else [args.model]):
        bench_model(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
