#!/usr/bin/python3
"""tests/bench/bench_ps_gloo.py - parameter-server push/pull over torch.distributed (gloo).

The peer measurement of the dtrain parameter-server benchmark: 1 worker + 1
server process on this machine, blocking point-to-point dist.send/dist.recv
with backend "gloo" (init_method tcp://127.0.0.1:<free port>, started with
torch.multiprocessing, spawn).  Rank 0 is the worker (it times and prints),
rank 1 the server.  Each rank runs torch with 1 thread and, like dt_spawn,
keeps its share of the CPUs (--no-bind to leave the affinity alone).

Dense, float32 tensor of B bytes, for each B in --dense-bytes:
  push (acked): the worker sends B bytes; the server dist.recv's them into a
      preallocated buffer, applies SGD  param.add_(buf, alpha=-0.01)  and
      sends a 1-element ack; the worker waits for the ack before the next
      push, so each push is complete (like dtrain's synchronous push).
      pushes_per_s = iters / time of the whole timed loop; push_us = median.
  pull: the worker sends a 1-element int64 request; the server answers with
      the B-byte parameter; pull_us = median round trip.
Sparse, a table of --sparse-rows x 16 float32 on the server:
  pull: the worker sends K distinct int64 row ids; the server answers with
      table.index_select(0, ids) (K x 16).
  push (acked): the worker sends K ids, then K x 16 gradient rows; the server
      applies SGD  table.index_add_(0, ids, grads, alpha=-lr)  (the same as
      index_add_(0, ids, -lr * grads), without the temporary) and acks.
  rows_per_s = K * iters / time of the timed loop; *_us = median per request.
  Every request uses a new set of ids (slices of random permutations of the
  rows, made before the timing).

Only the loops after the warm-up are timed (time.perf_counter).  The results
are checked outside the timed loops (exact for dense; sparse rows exact after
the pulls, to 1e-3 after the pushes).  Output, one line per measurement:

  gloo_dense bytes=B iters=N pushes_per_s=X push_us=X pull_us=X check=ok
  gloo_sparse rows=R k=K iters=N pull_rows_per_s=X push_rows_per_s=X pull_us=X push_us=X check=ok

Lines starting with '#' are comments.  Exit status 0 only if every check
passed.  Run it with Debian's interpreter (/usr/bin/python3, python3-torch).
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

DEFAULT_DENSE = [1024 * 4 ** k for k in range(8)]  # 1 KiB .. 16 MiB
LR = 0.01
DIM = 16
WORKER, SERVER = 0, 1


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind(rank, world):
    # each rank on its own share of the CPUs, as dt_spawn does
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // world
    if share >= 1:
        os.sched_setaffinity(0, cpus[rank * share:(rank + 1) * share])


def dense_counts(nbytes, args):
    """(warmup, iters) for one dense size; the same on both ranks."""
    if nbytes >= 1 << 20:
        iters = min(args.iters, max(20, args.iters * (64 << 10) // nbytes))
        warm = min(args.warmup, max(3, args.warmup * (64 << 10) // nbytes))
    else:
        iters, warm = args.iters, args.warmup
    return warm, max(1, iters)


# ---------------------------------------------------------------- server

def server_dense(torch, dist, nbytes, args):
    n = nbytes // 4
    warm, iters = dense_counts(nbytes, args)
    param = torch.zeros(n, dtype=torch.float32)
    buf = torch.empty(n, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)
    req = torch.empty(1, dtype=torch.int64)
    dist.barrier()
    for _ in range(warm + iters):          # pushes
        dist.recv(buf, WORKER)
        param.add_(buf, alpha=-LR)
        dist.send(ack, WORKER)
    dist.barrier()
    for _ in range(warm + iters):          # pulls
        dist.recv(req, WORKER)
        dist.send(param, WORKER)


def sparse_table(torch, rows):
    # row i, column j = (i % 1024) + j / 16: exact in float32, checkable
    i = (torch.arange(rows, dtype=torch.int64) % 1024).to(torch.float32)
    j = torch.arange(DIM, dtype=torch.float32) * 0.0625
    return (i.unsqueeze(1) + j.unsqueeze(0)).contiguous()


def server_sparse(torch, dist, args):
    k, total = args.sparse_k, args.warmup + args.sparse_iters
    table = sparse_table(torch, args.sparse_rows)
    ids = torch.empty(k, dtype=torch.int64)
    out = torch.empty(k, DIM, dtype=torch.float32)
    grads = torch.empty(k, DIM, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)

    def pull():
        dist.recv(ids, WORKER)
        torch.index_select(table, 0, ids, out=out)
        dist.send(out, WORKER)

    dist.barrier()
    for _ in range(total):                 # pulls
        pull()
    dist.barrier()
    for _ in range(total):                 # pushes
        dist.recv(ids, WORKER)
        dist.recv(grads, WORKER)
        table.index_add_(0, ids, grads, alpha=-LR)
        dist.send(ack, WORKER)
    pull()                                 # the check after the pushes


# ---------------------------------------------------------------- worker

def worker_dense(torch, dist, nbytes, args):
    n = nbytes // 4
    warm, iters = dense_counts(nbytes, args)
    x = torch.ones(n, dtype=torch.float32)
    ack = torch.empty(1, dtype=torch.float32)
    req = torch.zeros(1, dtype=torch.int64)
    got = torch.empty(n, dtype=torch.float32)

    dist.barrier()
    for _ in range(warm):
        dist.send(x, SERVER)
        dist.recv(ack, SERVER)
    times = []
    t0 = time.perf_counter()
    for _ in range(iters):
        a = time.perf_counter()
        dist.send(x, SERVER)
        dist.recv(ack, SERVER)
        times.append(time.perf_counter() - a)
    push_s = time.perf_counter() - t0
    push_med = statistics.median(times)

    dist.barrier()
    dist.send(req, SERVER)                 # first pull: the check
    dist.recv(got, SERVER)
    want = torch.zeros(1, dtype=torch.float32)
    one = torch.ones(1, dtype=torch.float32)
    for _ in range(warm + iters):          # the server's float32 sequence
        want.add_(one, alpha=-LR)
    ok = bool((got == want).all())
    if not ok:
        print(f"bench_ps_gloo: dense {nbytes} bytes: pulled {got[0].item()} "
              f"(and {int((got != want).sum())} wrong), want {want.item()}",
              file=sys.stderr, flush=True)
    for _ in range(warm - 1):
        dist.send(req, SERVER)
        dist.recv(got, SERVER)
    times = []
    for _ in range(iters - (1 if warm == 0 else 0)):
        a = time.perf_counter()
        dist.send(req, SERVER)
        dist.recv(got, SERVER)
        times.append(time.perf_counter() - a)
    pull_med = statistics.median(times) if times else float("nan")

    print(f"gloo_dense bytes={nbytes} iters={iters} pushes_per_s={iters / push_s:.1f} "
          f"push_us={push_med * 1e6:.1f} pull_us={pull_med * 1e6:.1f} "
          f"check={'ok' if ok else 'FAIL'}", flush=True)
    return ok


def id_sets(torch, rows, k, count, seed):
    """count sets of k distinct row ids: consecutive slices of permutations."""
    g = torch.Generator().manual_seed(seed)
    per = rows // k
    sets = []
    while len(sets) < count:
        perm = torch.randperm(rows, generator=g)
        for s in range(min(per, count - len(sets))):
            sets.append(perm[s * k:(s + 1) * k].clone())
    return sets


def worker_sparse(torch, dist, args):
    rows, k = args.sparse_rows, args.sparse_k
    warm, iters = args.warmup, args.sparse_iters
    total = warm + iters
    pull_ids = id_sets(torch, rows, k, total, 1)
    push_ids = id_sets(torch, rows, k, total, 2)
    got = torch.empty(k, DIM, dtype=torch.float32)
    grads = torch.ones(k, DIM, dtype=torch.float32)
    ack = torch.empty(1, dtype=torch.float32)
    col = torch.arange(DIM, dtype=torch.float32) * 0.0625

    def expect(ids):
        return ((ids % 1024).to(torch.float32).unsqueeze(1) + col.unsqueeze(0))

    ok = True
    dist.barrier()
    for s in range(warm):
        dist.send(pull_ids[s], SERVER)
        dist.recv(got, SERVER)
        ok = ok and bool((got == expect(pull_ids[s])).all())
    times = []
    t0 = time.perf_counter()
    for s in range(warm, total):
        a = time.perf_counter()
        dist.send(pull_ids[s], SERVER)
        dist.recv(got, SERVER)
        times.append(time.perf_counter() - a)
    pull_s = time.perf_counter() - t0
    pull_med = statistics.median(times)
    ok_pull = bool((got == expect(pull_ids[total - 1])).all())
    if not (ok and ok_pull):
        print("bench_ps_gloo: sparse pull returned wrong rows", file=sys.stderr, flush=True)
    ok = ok and ok_pull

    dist.barrier()
    for s in range(warm):
        dist.send(push_ids[s], SERVER)
        dist.send(grads, SERVER)
        dist.recv(ack, SERVER)
    times = []
    t0 = time.perf_counter()
    for s in range(warm, total):
        a = time.perf_counter()
        dist.send(push_ids[s], SERVER)
        dist.send(grads, SERVER)
        dist.recv(ack, SERVER)
        times.append(time.perf_counter() - a)
    push_s = time.perf_counter() - t0
    push_med = statistics.median(times)

    # check: pull the first push set; each row lost LR per push it was in
    probe = push_ids[0]
    dist.send(probe, SERVER)
    dist.recv(got, SERVER)
    count = torch.bincount(torch.cat(push_ids), minlength=rows)[probe].to(torch.float32)
    want = expect(probe) - LR * count.unsqueeze(1)
    err = float((got - want).abs().max())
    if err > 1e-3:
        print(f"bench_ps_gloo: sparse push: max error {err} after the pushes",
              file=sys.stderr, flush=True)
        ok = False

    print(f"gloo_sparse rows={rows} k={k} iters={iters} "
          f"pull_rows_per_s={k * iters / pull_s:.1f} push_rows_per_s={k * iters / push_s:.1f} "
          f"pull_us={pull_med * 1e6:.1f} push_us={push_med * 1e6:.1f} "
          f"check={'ok' if ok else 'FAIL'}", flush=True)
    return ok


# ---------------------------------------------------------------- driver

def run(rank, world, port, args, failed):
    if args.bind:
        bind(rank, world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    ok = True
    if rank == WORKER:
        print(f"# torch.distributed gloo parameter server, send/recv, 1 worker + 1 server: "
              f"torch={torch.__version__} threads=1 bind={int(args.bind)} "
              f"warmup={args.warmup} push=acked", flush=True)
    for nbytes in args.dense_bytes:
        if rank == WORKER:
            ok = worker_dense(torch, dist, nbytes, args) and ok
        else:
            server_dense(torch, dist, nbytes, args)
    if args.sparse_iters > 0 and args.sparse_k > 0:
        if rank == WORKER:
            ok = worker_sparse(torch, dist, args) and ok
        else:
            server_sparse(torch, dist, args)
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        failed.value = 1


def size_list(text):
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        mult = 1
        if part[-1] in "kKmM":
            mult = 1024 if part[-1] in "kK" else 1 << 20
            part = part[:-1]
        v = int(part) * mult
        if v <= 0 or v % 4:
            raise argparse.ArgumentTypeError(f"{v}: not a positive multiple of 4 bytes")
        out.append(v)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense-bytes", type=size_list, default=DEFAULT_DENSE,
                   help="comma list of tensor sizes in bytes (K/M suffixes allowed; "
                        "default 1024*4^k, 1K..16M; empty: no dense runs)")
    p.add_argument("--iters", type=int, default=200,
                   help="timed pushes and pulls per dense size (>= 1 MiB: "
                        "max(20, iters*64KiB/bytes))")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed requests before each timed loop (scaled down like "
                        "--iters for dense sizes >= 1 MiB, at least 3)")
    p.add_argument("--sparse-rows", type=int, default=1 << 20)
    p.add_argument("--sparse-k", type=int, default=4096, help="row ids per request")
    p.add_argument("--sparse-iters", type=int, default=200,
                   help="timed sparse pulls and pushes (0: no sparse run)")
    p.add_argument("--no-bind", dest="bind", action="store_false",
                   help="leave the CPU affinity alone (default: each rank its share)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="gloo timeout in seconds")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0 or args.sparse_iters < 0:
        p.error("--iters must be >= 1, --warmup and --sparse-iters >= 0")
    if args.sparse_iters > 0 and not 0 < args.sparse_k <= args.sparse_rows:
        p.error("--sparse-k must be in 1..--sparse-rows")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    failed = ctx.Value("i", 0)
    port = free_port()
    mp.spawn(run, args=(2, port, args, failed), nprocs=2, join=True)
    return 1 if failed.value else 0


if __name__ == "__main__":
    sys.exit(main())
