#!/usr/bin/env python3
"""PyTorch eager peer of bench_gpu.c: the same MLP / CNN training steps
(bench_torch.py's models, SGD momentum 0.9, lr 0.01), the same synthetic
data shapes and the same timing, on one CUDA device.

  bench_gpu_torch.py [--device cuda|cuda:N|cpu] [--configs mlp:128,mlp:1024,cnn:128]
                     [--precs fp32,bf16] [--feeds device,host] [--warmup W]
                     [--sync-steps S] [--rounds R] [--round-ms T] [--max-seconds T]
                     [--steps N]
  bench_gpu_torch.py --matmul MxKxN,... [--mm-precs fp32,tf32,bf16] [--device D]
                     [--rounds R] [--round-ms T]

Precisions: fp32 (TF32 off for matmul and cuDNN, as dtrain's plain f32),
tf32 (TF32 on for both), bf16 (torch.autocast(dtype=torch.bfloat16), TF32
off outside it).  Feeds: device (x, y on the device before timing), host
(every step copies the next of 4 pageable host batches in with copy_, as
dtrain's dt_tensor_set from malloc'ed memory).

Output lines match bench_gpu.c:
  torch mlp b128 fp32 device step_ms 0.4123 sync_ms 0.4501 min_ms 0.4011 per 60 rounds 20 loss 2.2871
step_ms: median over rounds of round time / per, a round being `per`
steps queued back to back with one loss.item() (the sync) at its end;
sync_ms: median of single steps each ending with loss.item().  A failed
configuration prints "torch mlp b128 fp32 device error WHY".  Other lines
start with '#'.  --steps N is a smoke test: N steps in every phase.

--matmul: the PyTorch peer of bench_cublas.c instead of the training
steps.  For each shape and precision, torch.matmul(A, B) on seeded random
f32 A (M,K) and B (K,N): fp32 with allow_tf32 off, tf32 with it on, bf16
under torch.autocast(dtype=torch.bfloat16) on the f32 tensors, so both
operands are converted on every call as dt_matmul does under bf16 autocast
(autocast caches casts only of leaf tensors that require grad; these do
not).  Timing as bench_cublas.c: 3 warm-up calls, `per` back-to-back calls
making a round of about --round-ms, --rounds rounds (default 11) each timed
on the host clock up to torch.cuda.synchronize(), the median round kept:
  torchmm 4096x4096x4096 bf16 torch_tflops 412.30 per 40 rounds 11
(TFLOP/s = 2*M*K*N / seconds per call / 1e12).  A failed case prints
"torchmm 4096x4096x4096 bf16 error WHY".
"""
import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch import nn

NHOST = 4  # distinct host batches cycled by the host feed


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


def set_tf32(on):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_config(model_name, batch, prec, feed, args, dev):
    set_tf32(prec == "tf32")
    torch.manual_seed(1234)
    model = (mlp() if model_name == "mlp" else cnn()).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    xshape = (batch, 784) if model_name == "mlp" else (batch, 1, 28, 28)
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(xshape, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    hx = hy = None
    if feed == "host":
        hx = [torch.randn(xshape, generator=g) for _ in range(NHOST)]
        hy = [torch.randint(0, 10, (batch,), generator=g) for _ in range(NHOST)]
    if prec == "bf16":
        amp = lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    else:
        amp = contextlib.nullcontext
    counter = [0]

    def step(read):
        if hx is not None:
            k = counter[0] % NHOST
            counter[0] += 1
            x.copy_(hx[k])
            y.copy_(hy[k])
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        return loss.item() if read else 0.0

    first = last = None
    for i in range(args.warmup):
        last = step(True)
        if i == 0:
            first = last
        if not math.isfinite(last):
            raise RuntimeError(f"loss is {last} at warm-up step {i}")
    sync(dev)

    ts = []
    for _ in range(args.sync_steps):
        t0 = time.perf_counter()
        last = step(True)
        ts.append(time.perf_counter() - t0)
    sync_s = statistics.median(ts)

    per = math.ceil(args.round_ms * 1e-3 / max(sync_s, 1e-6))
    per = min(max(per, 5), 2000)
    if args.steps:
        per = args.steps
    tr = []
    t_start = time.perf_counter()
    while len(tr) < args.rounds:
        t0 = time.perf_counter()
        for _ in range(per - 1):
            step(False)
        last = step(True)
        tr.append((time.perf_counter() - t0) / per)
        if not math.isfinite(last):
            raise RuntimeError(f"loss is {last} after round {len(tr)}")
        if len(tr) >= 5 and time.perf_counter() - t_start > args.max_seconds:
            break
    ident = f"torch {model_name} b{batch} {prec} {feed}"
    mem = ""
    if dev.type == "cuda":
        mem = f"; peak allocated {torch.cuda.max_memory_allocated(dev) / 1e6:.1f} MB"
    print(f"# {ident}: loss {first:.4f} -> {last:.4f}{mem}")
    print(f"{ident} step_ms {statistics.median(tr) * 1e3:.4f} sync_ms {sync_s * 1e3:.4f} "
          f"min_ms {min(tr) * 1e3:.4f} per {per} rounds {len(tr)} loss {last:.4f}", flush=True)


def mm_round(a, b, per, amp, dev):
    """`per` products queued back to back and a sync; seconds per product."""
    t0 = time.perf_counter()
    with amp():
        for _ in range(per):
            torch.matmul(a, b)
    sync(dev)
    return (time.perf_counter() - t0) / per


def run_case(label, fn):
    """Run one case; on an exception print "<label> error <type>" (the
    table's error line, and the reason to stderr) and go on: 1 if it failed."""
    try:
        fn()
        return 0
    except Exception as e:  # report it and go on with the others
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"# {label}: {why}", file=sys.stderr)
        print(f"{label} error {type(e).__name__}", flush=True)
        return 1


def run_matmul(m, k, n, prec, args, dev):
    # a (M,K), b (K,N) f32 -> (M,N): f32, or bf16 under autocast
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    g = torch.Generator().manual_seed(1234)
    a = torch.randn((m, k), generator=g).to(dev)
    b = torch.randn((k, n), generator=g).to(dev)
    if prec == "bf16":
        amp = lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    else:
        amp = contextlib.nullcontext
    for _ in range(3):
        mm_round(a, b, 1, amp, dev)
    t1 = mm_round(a, b, 3, amp, dev)
    per = min(max(math.ceil(args.round_ms * 1e-3 / max(t1, 1e-9)), 1), 5000)
    ts = [mm_round(a, b, per, amp, dev) for _ in range(args.rounds)]
    tflops = 2.0 * m * k * n / statistics.median(ts) / 1e12
    print(f"torchmm {m}x{k}x{n} {prec} torch_tflops {tflops:.2f} per {per} "
          f"rounds {len(ts)}", flush=True)


def matmul_main(p, args, dev, name):
    shapes = []
    for spec in args.matmul.split(","):
        dims = spec.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            p.error(f"bad shape '{spec}' (want MxKxN)")
        shapes.append(tuple(int(d) for d in dims))
    if args.rounds < 1 or args.round_ms <= 0:
        p.error("--rounds and --round-ms must be positive")
    precs = args.mm_precs.split(",")
    for prec in precs:
        if prec not in ("fp32", "tf32", "bf16"):
            p.error(f"bad matmul precision '{prec}'")
    print(f"# torch matmul: torch {torch.__version__}, cuda {torch.version.cuda}, device {name}; "
          f"rounds {args.rounds} of ~{args.round_ms:.0f} ms", flush=True)

    failed = 0
    for m, k, n in shapes:
        for prec in precs:
            failed += run_case(f"torchmm {m}x{k}x{n} {prec}",
                               lambda: run_matmul(m, k, n, prec, args, dev))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    if failed:
        print(f"# {failed} of {len(shapes) * len(precs)} matmul cases failed")
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default="mlp:128,mlp:1024,cnn:128")
    p.add_argument("--precs", default="fp32,bf16")
    p.add_argument("--feeds", default="device,host")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sync-steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default 20; 11 with --matmul, as bench_cublas)")
    p.add_argument("--round-ms", type=float, default=25.0)
    p.add_argument("--max-seconds", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=0,
                   help="smoke test: N warm-up, synced and per-round steps, 1 round")
    p.add_argument("--matmul", default="", metavar="SHAPES",
                   help="time torch.matmul on MxKxN,... instead of the training steps")
    p.add_argument("--mm-precs", default="fp32,tf32,bf16")
    args = p.parse_args()
    if args.rounds is None:
        args.rounds = 11 if args.matmul else 20
    if args.steps:
        args.warmup = args.sync_steps = args.steps
        args.rounds = 1

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu_torch.py: torch.cuda.is_available() is False", file=sys.stderr)
            return 1
        if dev.index is None:  # set_device and the memory statistics want an index
            dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        name = torch.cuda.get_device_name(dev)
    else:
        name = "cpu"
    if args.matmul:
        return matmul_main(p, args, dev, name)
    print(f"# bench_gpu_torch: torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version() if dev.type == 'cuda' else '-'}), device {name}, "
          f"cudnn.benchmark={torch.backends.cudnn.benchmark}, warm-up {args.warmup}, "
          f"{args.sync_steps} synced steps, rounds of ~{args.round_ms:.0f} ms "
          f"(at most {args.rounds}, {args.max_seconds:.1f} s)", flush=True)

    configs = []
    for spec in args.configs.split(","):
        m, _, b = spec.partition(":")
        if m not in ("mlp", "cnn") or not b.isdigit() or int(b) < 1:
            p.error(f"bad config '{spec}' (want mlp:BATCH or cnn:BATCH)")
        for feed in args.feeds.split(","):
            if feed not in ("device", "host"):
                p.error(f"bad feed '{feed}'")
            for prec in args.precs.split(","):
                if prec not in ("fp32", "tf32", "bf16"):
                    p.error(f"bad precision '{prec}'")
                configs.append((m, int(b), prec, feed))

    failed = 0
    for m, b, prec, feed in configs:
        failed += run_case(f"torch {m} b{b} {prec} {feed}",
                           lambda: run_config(m, b, prec, feed, args, dev))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    if failed:
        print(f"# {failed} of {len(configs)} configurations failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
