#!/usr/bin/python3
"""PyTorch DDP peer of bench_ddp.c: the same MLP / CNN (bench_torch.py's),
the same per-rank batch of fixed random data, SGD with momentum, gloo
backend, one thread per rank, each rank bound to its own CPU.

  bench_ddp_torch.py [--model mlp|cnn] [--batch B] [--steps N] [--warmup W]
                     [--ranks R] [--threads T]

Forks R ranks itself (torch.multiprocessing) and prints, from rank 0, one
line like bench_ddp.c's:
  ddp_torch model=mlp ranks=2 threads=1 batch=128 step_ms=.. samples_per_s=..
Run it with Debian's interpreter (/usr/bin/python3, python3-torch).
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import cnn, mlp  # noqa: E402  (the same models)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, out):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= args.ranks:
        share = len(cpus) // args.ranks
        os.sched_setaffinity(0, cpus[rank * share:(rank + 1) * share])
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1 + rank)
    model = (cnn() if args.model == "cnn" else mlp())
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    shape = (args.batch, 1, 28, 28) if args.model == "cnn" else (args.batch, 784)
    x = torch.randn(shape)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for s in range(-args.warmup, args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if s >= 0:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    if rank == 0:
        out.put("ddp_torch model=%s ranks=%d threads=%d batch=%d step_ms=%.3f samples_per_s=%.0f"
                % (args.model, args.ranks, args.threads, args.batch, 1e3 * step,
                   args.ranks * args.batch / step))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    line = out.get(timeout=600)
    for pr in procs:
        pr.join()
    print(line, flush=True)
    return 0 if all(pr.exitcode == 0 for pr in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
