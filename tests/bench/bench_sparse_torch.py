#!/usr/bin/python3
"""PyTorch baseline for examples/ps_sparse.c: the same click-through model
on the same data, trained in one process with a sparse embedding table.

  build/ps_sparse --dump /tmp/clicks.bin
  bench_sparse_torch.py --data /tmp/clicks.bin [--batch 512] [--epochs 1]
                        [--threads 1] [--samples N] [--seed 1]

The model is ps_sparse.c's: nn.Embedding(rows, 16, sparse=True) initialised
uniform(-0.05, 0.05); the sample's `fields` rows concatenated (8 x 16 = 128)
-> Linear(128, 64) -> ReLU -> Linear(64, 2) -> cross-entropy (mean).
AdaGrad (lr 0.05, lr_decay 0, eps 1e-10, initial accumulator 0) for all
parameters, like the C servers.  The training samples are read in file
order, without shuffling, like the C example's single worker.

The data file ("DTCLICK1", little-endian): int64 n_train, n_test, fields,
rows; then per split (train, then test) int32 ids (n x fields) and uint8
labels (n).

Only the training loop is timed (not the loading, nor the evaluation).  The
last line is "torch_samples_per_s X", for scripts to grep.
Run it with Debian's interpreter (/usr/bin/python3, python3-torch).
"""
import argparse
import sys
import time

import numpy as np
import torch
from torch import nn

DIM, HIDDEN = 16, 64
MAGIC = b"DTCLICK1"


def load(path):
    """(train_ids, train_labels, test_ids, test_labels, fields, rows)."""
    with open(path, "rb") as f:
        magic = f.read(8)
        head = np.fromfile(f, dtype="<i8", count=4)
    if magic != MAGIC or head.size != 4:
        sys.exit("bench_sparse_torch: %s is not a ps_sparse --dump file" % path)
    n_train, n_test, fields, rows = (int(v) for v in head)
    off = 8 + 4 * 8
    splits = []
    for n in (n_train, n_test):
        ids = np.fromfile(path, dtype="<i4", count=n * fields, offset=off)
        off += 4 * n * fields
        labels = np.fromfile(path, dtype=np.uint8, count=n, offset=off) if ids.size == n * fields else ids[:0]
        off += n
        if ids.size != n * fields or labels.size != n:
            sys.exit("bench_sparse_torch: %s is truncated" % path)
        splits += [ids.reshape(n, fields), labels]
    for ids in (splits[0], splits[2]):
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            sys.exit("bench_sparse_torch: %s has ids outside the table" % path)
    return splits[0], splits[1], splits[2], splits[3], fields, rows


class ClickModel(nn.Module):
    def __init__(self, rows, fields):
        super().__init__()
        self.emb = nn.Embedding(rows, DIM, sparse=True)
        nn.init.uniform_(self.emb.weight, -0.05, 0.05)
        self.fc1 = nn.Linear(fields * DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 2)

    def forward(self, ids):
        e = self.emb(ids).reshape(ids.shape[0], -1)
        return self.fc2(torch.relu(self.fc1(e)))


def auc(p, y):
    """Rank-sum AUC; tied scores share their mean rank."""
    order = np.argsort(p, kind="mergesort")
    ps = p[order]
    ys = y[order].astype(np.float64)
    n = ps.size
    # runs of equal scores: [starts[k], ends[k])
    starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
    ends = np.r_[starts[1:], n]
    mean_rank = (starts + ends + 1) / 2.0                # 1-based ranks
    ranks = np.repeat(mean_rank, ends - starts)
    pos = ys.sum()
    neg = n - pos
    if pos == 0 or neg == 0:
        return 0.5
    return (float((ranks * ys).sum()) - pos * (pos + 1) / 2) / (pos * neg)


def evaluate(model, ids, labels, batch):
    model.eval()
    probs = np.empty(ids.shape[0], dtype=np.float64)
    with torch.no_grad():
        for lo in range(0, ids.shape[0], batch):
            lg = model(torch.from_numpy(ids[lo:lo + batch]).long()).double()
            probs[lo:lo + batch] = torch.sigmoid(lg[:, 1] - lg[:, 0]).numpy()
    model.train()
    y = labels.astype(np.int64)
    p1 = np.maximum(probs, 1e-12)
    p0 = np.maximum(1 - probs, 1e-12)
    loss = float(-np.mean(np.where(y == 1, np.log(p1), np.log(p0))))
    acc = float(np.mean((probs > 0.5) == (y == 1)))
    return loss, acc, auc(probs, y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="file written by build/ps_sparse --dump")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=0, help="first N training samples (default all)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.batch < 1 or args.epochs < 1 or args.threads < 1 or args.samples < 0:
        ap.error("--batch, --epochs and --threads must be >= 1, --samples >= 0")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tr_ids, tr_y, te_ids, te_y, fields, rows = load(args.data)
    if args.samples:
        tr_ids, tr_y = tr_ids[:args.samples], tr_y[:args.samples]
    n = tr_ids.shape[0]
    if n == 0:
        sys.exit("bench_sparse_torch: no training samples")
    tr_ids = np.ascontiguousarray(tr_ids)
    tr_y = np.ascontiguousarray(tr_y)
    print("torch sparse: table %d x %d, %d fields, batch %d, %d samples x %d epochs, threads %d"
          % (rows, DIM, fields, args.batch, n, args.epochs, args.threads))

    model = ClickModel(rows, fields)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, lr_decay=0,
                              initial_accumulator_value=0, eps=1e-10)
    loss_fn = nn.CrossEntropyLoss()

    seen, loss_sum, steps = 0, 0.0, 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        for lo in range(0, n, args.batch):
            ids = torch.from_numpy(tr_ids[lo:lo + args.batch]).long()
            y = torch.from_numpy(tr_y[lo:lo + args.batch]).long()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(ids), y)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            steps += 1
            seen += ids.shape[0]
        print("epoch %d: train loss %.4f, %.0f samples/s"
              % (epoch + 1, loss_sum / steps, seen / (time.perf_counter() - t0)))
    secs = time.perf_counter() - t0
    rate = seen / secs

    print("torch sparse: trained %d samples in %.2f s: %.0f samples/s (threads %d)"
          % (seen, secs, rate, args.threads))
    if te_ids.shape[0]:
        loss, acc, a = evaluate(model, te_ids, te_y, 4096)
        print("torch test log loss %.4f, accuracy %.2f%%" % (loss, 100 * acc))
        print("torch test auc: %.4f" % a)
    print("torch_samples_per_s %.0f" % rate)


if __name__ == "__main__":
    main()
