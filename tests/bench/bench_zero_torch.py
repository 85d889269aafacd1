#!/usr/bin/python3
"""PyTorch peer of examples/gpt.c --ranks N --zero L for tests/bench/zero.sh:
bench_gpt_torch.py's GPT under DistributedDataParallel (gloo, one process a
rank, spawned here), AdamW (betas 0.9, 0.99, weight decay 0.1), random byte
windows; --zero 1 wraps AdamW in torch.distributed.optim.ZeroRedundancyOptimizer
(PyTorch's ZeRO-1: optimizer state sharded; its gradients are allreduced).

  bench_zero_torch.py --ranks N [--zero 0|1] --layers L --heads H --embd C
                      --context T --batch B --vocab V --steps S --threads K

Rank 0 prints "zero impl=torch ranks=N zero=L ms=<mean ms per step after 3
warm-up steps> loss=<last loss>"; other lines start with '#'.  Memory is
measured from outside (tests/bench/pss_peak.py).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpt_torch import GPT  # noqa: E402  the same model as gpt.sh's peer


def rank_main(rank, a, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    model = GPT(a.vocab, a.context, a.layers, a.heads, a.embd)
    # the causal mask is a bool buffer, which gloo cannot broadcast; it is
    # the same on every rank anyway
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["mask"])
    m = DDP(model)
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(m.parameters(), **kw)
    g = torch.Generator().manual_seed(7 + rank)
    t3 = None
    for step in range(1, a.steps + 1):
        x = torch.randint(0, 256, (a.batch, a.context + 1), generator=g)
        loss = F.cross_entropy(m(x[:, :-1]).reshape(-1, a.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        if step == 3:
            t3 = time.perf_counter()
    ms = (time.perf_counter() - t3) * 1e3 / (a.steps - 3)
    if rank == 0:
        print("# torch %s, gloo, %d threads a rank" % (torch.__version__, a.threads))
        print("zero impl=torch ranks=%d zero=%d ms=%.2f loss=%.4f" % (a.ranks, a.zero, ms, loss.item()))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for k, v in (("ranks", 2), ("zero", 0), ("layers", 12), ("heads", 12), ("embd", 768),
                 ("context", 64), ("batch", 4), ("vocab", 50257), ("steps", 8), ("threads", 1),
                 ("port", 29611)):
        p.add_argument("--" + k, type=int, default=v)
    a = p.parse_args()
    if a.steps <= 3:
        p.error("--steps must be above 3 (the warm-up)")
    mp.spawn(rank_main, args=(a, a.port), nprocs=a.ranks)


if __name__ == "__main__":
    main()
