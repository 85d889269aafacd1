#!/usr/bin/env python3
"""tests/bench/bench_allreduce_gloo.py - torch.distributed allreduce (gloo).

The peer of bench_allreduce.c: same sizes (4 KiB .. 64 MiB of float32), same
method, same output.  Starts --ranks processes with torch.multiprocessing
(init_method tcp://127.0.0.1:<free port>); each checks one allreduce of
integer-valued data exactly, warms up, then times single calls until about
--min-time seconds have gone (at least --min-iters).  Rank 0 prints

    <bytes> <iters> <median_us> <busbw_GBps> <ok|FAIL>

busbw = 2 (P-1)/P * bytes / median time.  Needs python3-torch
(Debian's is for /usr/bin/python3).  Exit status 0 only if every check
passed.
"""
import argparse
import os
import socket
import statistics
import sys
import time

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(torch, n, r):
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + r * 131) % 1024 - 512).to(torch.float32)


def bind(rank, world):
    # each rank on its own share of the CPUs, as dt_spawn and mpirun do
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // world
    if share >= 1:
        os.sched_setaffinity(0, cpus[rank * share:(rank + 1) * share])


def worker(rank, world, port, args, failed):
    bind(rank, world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if rank == 0:
        print(f"# torch.distributed gloo allreduce(sum, float32): ranks={world} "
              f"torch={torch.__version__}", flush=True)
        print("# %10s %8s %12s %12s %s" % ("bytes", "iters", "median_us", "busbw_GBps", "check"),
              flush=True)
    ok_all = True
    for nbytes in SIZES:
        if nbytes > args.max_bytes:
            continue
        n = nbytes // 4
        buf = inputs(torch, n, rank)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        want = sum(inputs(torch, n, r) for r in range(world))
        bad = int((buf != want).sum())
        if bad:
            print(f"bench_allreduce_gloo: rank {rank}, {nbytes} bytes: {bad} wrong elements",
                  file=sys.stderr, flush=True)
        nbad = torch.tensor([1 if bad else 0], dtype=torch.int32)
        dist.all_reduce(nbad)
        nbad = int(nbad.item())

        # warm-up (first touches, lazy connections), then as many calls
        # again timed: rank 0 picks the iteration count from those
        warm = 50 if nbytes <= 256 << 10 else 10 if nbytes <= 4 << 20 else 3
        for _ in range(warm):
            dist.all_reduce(buf)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(warm):
            dist.all_reduce(buf)
        per = (time.perf_counter() - t0) / warm
        iters = int(min(max(args.min_time / per if per > 0 else 1e6, args.min_iters), 1e6))
        it = torch.tensor([iters], dtype=torch.int64)
        dist.broadcast(it, 0)
        iters = int(it.item())

        times = []
        dist.barrier()
        for _ in range(iters):
            a = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - a)
        med = statistics.median(times)
        busbw = 2.0 * (world - 1) / world * nbytes / med / 1e9
        if rank == 0:
            print("  %10d %8d %12.2f %12.3f %s" % (nbytes, iters, med * 1e6, busbw,
                                                  "ok" if nbad == 0 else "FAIL"), flush=True)
        ok_all = ok_all and nbad == 0
    dist.barrier()
    dist.destroy_process_group()
    if not ok_all:
        failed.value = 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    failed = ctx.Value("i", 0)
    port = free_port()
    mp.spawn(worker, args=(args.ranks, port, args, failed), nprocs=args.ranks, join=True)
    return 1 if failed.value else 0


if __name__ == "__main__":
    sys.exit(main())
