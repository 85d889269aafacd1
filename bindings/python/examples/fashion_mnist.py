#!/usr/bin/env python3
"""Fashion-MNIST in Python: the training loop of examples/fashion_mnist.c, line for line.

    python3 bindings/python/examples/fashion_mnist.py --epochs 1
    build/dtrun -n 2 python3 bindings/python/examples/fashion_mnist.py   # DDP, 2 ranks
    build/dtrun -n 3 python3 bindings/python/examples/fashion_mnist.py --servers 1
                                        # 2 workers and a parameter server (BSP)

Same seed, same model, same data order as the C example, so the same accuracy; the
launcher's environment (dtrun, torchrun, mpirun, srun) makes it a DDP job.
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

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530   # pixel statistics of the training set


def linear_params(ctx, name, fan_in, fan_out):
    """A linear layer initialised as torch.nn.Linear: kaiming_uniform(a=sqrt(5))."""
    w = ctx.param(name + ".weight", (fan_out, fan_in))
    b = ctx.param(name + ".bias", (fan_out,))
    dt.init_kaiming_uniform(w, 2.2360679775)
    dt.init_bias(b, fan_in)
    return w, b


def conv_params(ctx, name, cin, cout):
    w = ctx.param(name + ".weight", (cout, cin, 3, 3))
    b = ctx.param(name + ".bias", (cout,))
    dt.init_kaiming_uniform(w, 2.2360679775)
    dt.init_bias(b, cin * 9)
    return w, b


class MLP:
    """784-512-512-10."""

    def __init__(self, ctx):
        self.fc1 = linear_params(ctx, "fc1", 784, 512)
        self.fc2 = linear_params(ctx, "fc2", 512, 512)
        self.fc3 = linear_params(ctx, "fc3", 512, 10)

    def __call__(self, x):
        h = dt.flatten(x, 1)
        h = dt.relu(dt.linear(h, *self.fc1))
        h = dt.relu(dt.linear(h, *self.fc2))
        return dt.linear(h, *self.fc3)


class CNN:
    """Two 3x3 convolutions with pooling, then 3136-128-10."""

    def __init__(self, ctx):
        self.c1 = conv_params(ctx, "conv1", 1, 32)
        self.c2 = conv_params(ctx, "conv2", 32, 64)
        self.fc1 = linear_params(ctx, "fc1", 3136, 128)
        self.fc2 = linear_params(ctx, "fc2", 128, 10)

    def __call__(self, x):
        h = dt.max_pool2d(dt.relu(dt.conv2d(x, *self.c1, stride=1, pad=1)), 2, 2)
        h = dt.max_pool2d(dt.relu(dt.conv2d(h, *self.c2, stride=1, pad=1)), 2, 2)
        h = dt.relu(dt.linear(dt.flatten(h, 1), *self.fc1))
        return dt.linear(h, *self.fc2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=0, help="default 128 for mlp, 64 for cnn")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optim", choices=["adam", "sgd"], default="adam")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--limit-batches", type=int, default=0, help="batches per epoch (0: all)")
    p.add_argument("--data", default=None, help="Fashion-MNIST directory")
    p.add_argument("--save", default=None, help="checkpoint after every epoch (rank 0)")
    p.add_argument("--servers", type=int, default=0,
                   help="of the ranks, this many are parameter servers (default 0: DDP)")
    p.add_argument("--ps-mode", choices=["bsp", "asp", "ssp"], default="bsp")
    p.add_argument("--staleness", type=int, default=2, help="ssp's bound")
    a = p.parse_args()
    a.batch = a.batch or (128 if a.model == "mlp" else 64)
    return a


def train(o, ctx, comm):
    rank, ranks = (comm.rank, comm.size) if comm else (0, 1)
    talk = rank == 0
    model = (MLP if o.model == "mlp" else CNN)(ctx)
    train_ds = dt.Dataset.fashion_mnist(ctx, "train", o.data)
    test_ds = dt.Dataset.fashion_mnist(ctx, "test", o.data)
    loader = dt.Loader(ctx, train_ds, batch=o.batch, seed=o.seed, mean=FMNIST_MEAN,
                       std=FMNIST_STD, prefetch=1, shard_rank=rank, shard_count=ranks)
    per_epoch = len(loader)
    if o.limit_batches and o.limit_batches < per_epoch:
        per_epoch = o.limit_batches
    if o.optim == "sgd":
        opt = dt.Optimizer(ctx, "sgd", lr=o.lr, momentum=0.9)
    else:
        opt = dt.Optimizer(ctx, "adam", lr=o.lr)
    opt.set_schedule("cosine", total_steps=per_epoch * o.epochs)
    ddp = dt.DDP(ctx, comm, opt) if comm else None   # rank 0's weights go to every rank
    if talk:
        print("model %s, %d epochs, batch %d%s, lr %g, %s backend, %d threads, "
              "%d parameter tensors (python)" % (
                  o.model, o.epochs, o.batch,
                  " per rank x %d ranks (DDP over %s)" % (ranks, comm.transport) if comm else "",
                  o.lr, ctx.backend, ctx.threads, len(ctx.params())), flush=True)
    step_s = 0.0
    for epoch in range(o.epochs):
        loader.start_epoch(epoch)
        t0 = dt.now()
        loss_sum, correct, seen = 0.0, 0, 0
        for b in range(per_epoch):
            batch = loader.next()
            if batch is None:
                break
            x, y = batch
            logits = model(x)
            loss = dt.cross_entropy(logits, y)
            correct += dt.count_correct(logits, y)
            ctx.backward(loss)
            if ddp:
                ddp.step()
            else:
                opt.step()
            opt.zero_grad()
            loss_sum += loss.item()
            seen += x.shape[0]
            ctx.step_reset()
            if talk and ((b + 1) % 100 == 0 or b + 1 == per_epoch):
                print("epoch %d/%d batch %d/%d loss %.4f %.0f samples/s" % (
                    epoch + 1, o.epochs, b + 1, per_epoch, loss_sum / (b + 1),
                    seen * ranks / (dt.now() - t0)), flush=True)
        took = dt.now() - t0
        step_s += took
        sums = np.array([loss_sum, correct, seen], np.float32)
        if comm:
            comm.allreduce(sums)
        m = dt.evaluate(ctx, test_ds, model, comm=comm, mean=FMNIST_MEAN, std=FMNIST_STD)
        if talk:
            print("epoch %d: loss %.4f, train accuracy %.2f%%, test accuracy %.2f%%, "
                  "%.0f samples/s, %.1f s (data wait %.2f s)" % (
                      epoch + 1, sums[0] / (per_epoch * ranks),
                      100.0 * sums[1] / max(sums[2], 1), 100 * m.accuracy, sums[2] / took,
                      took, loader.wait_seconds), flush=True)
        if o.save and rank == 0:
            dt.checkpoint_save(ctx, o.save, opt, (epoch + 1) * per_epoch)
    m = dt.evaluate(ctx, test_ds, model, comm=comm, mean=FMNIST_MEAN, std=FMNIST_STD)
    if talk:
        print("train loop: %.3f ms per step" % (1000 * step_s / (per_epoch * o.epochs)))
        print("test accuracy: %.2f%%" % (100 * m.accuracy), flush=True)


def train_ps(o, ctx, comm):
    """Parameter-server training, as train_ps in examples/fashion_mnist.c: the last
    o.servers ranks hold the weights and step them; each worker trains on its shard, its
    gradients pushed through DDP's buckets and the weights pulled back."""
    rank, workers = comm.rank, comm.size - o.servers
    talk = rank == 0
    model = (MLP if o.model == "mlp" else CNN)(ctx) if rank < workers else None
    per_epoch = (60000 // workers + o.batch - 1) // o.batch
    if o.limit_batches and o.limit_batches < per_epoch:
        per_epoch = o.limit_batches
    steps = per_epoch * o.epochs * (1 if o.ps_mode == "bsp" else workers)
    optim = {"lr": o.lr, "momentum": 0.9} if o.optim == "sgd" else {"lr": o.lr}
    ps = dt.ParameterServer(ctx, comm, servers=o.servers, mode=o.ps_mode,
                            staleness=o.staleness, optim=o.optim,
                            schedule={"kind": "cosine", "total_steps": steps}, **optim)
    if ps.is_server:
        ps.serve()
        ps.close()
        return
    train_ds = dt.Dataset.fashion_mnist(ctx, "train", o.data)
    test_ds = dt.Dataset.fashion_mnist(ctx, "test", o.data)
    loader = dt.Loader(ctx, train_ds, batch=o.batch, seed=o.seed, mean=FMNIST_MEAN,
                       std=FMNIST_STD, prefetch=1, shard_rank=rank, shard_count=workers)
    ddp = dt.DDP(ctx, comm, None, ps=ps)
    per_epoch = min(per_epoch, len(loader))
    if talk:
        print("model %s, %d epochs, batch %d per worker x %d workers, %d servers (%s) "
              "(python)" % (o.model, o.epochs, o.batch, workers, o.servers, o.ps_mode), flush=True)
    for epoch in range(o.epochs):
        loader.start_epoch(epoch)
        loss_sum, b = 0.0, 0
        while b < per_epoch:
            batch = loader.next()
            if batch is None:
                break
            x, y = batch
            b += 1
            loss = dt.cross_entropy(model(x), y)
            ctx.backward(loss)
            ddp.step()
            loss_sum += loss.item()
            ctx.zero_grad()
            ctx.step_reset()
        if talk:
            m = dt.evaluate(ctx, test_ds, model, mean=FMNIST_MEAN, std=FMNIST_STD)
            print("epoch %d: loss %.4f, test accuracy %.2f%%" % (
                epoch + 1, loss_sum / max(b, 1), 100 * m.accuracy), flush=True)
    if talk:   # the servers' weights as they are now
        ps.pull()
        m = dt.evaluate(ctx, test_ds, model, mean=FMNIST_MEAN, std=FMNIST_STD)
        print("test accuracy: %.2f%%" % (100 * m.accuracy), flush=True)
    ps.finish()
    ddp.close()
    ps.close()


def main():
    o = parse_args()
    with dt.Context(threads=o.threads, seed=o.seed) as ctx:
        env = dt.dist_env(ctx)
        comm = dt.Comm(ctx) if env.world_size > 1 else None
        if o.servers and not comm:
            print("fashion_mnist.py: --servers needs a launcher (build/dtrun -n N)",
                  file=sys.stderr)
            return 2
        try:
            (train_ps if o.servers else train)(o, ctx, comm)
        except dt.Error as e:
            print("fashion_mnist.py: rank %d: %s" % (env.rank, e), file=sys.stderr)
            return 1
        if comm:
            comm.barrier()   # rank 0 hosts the store: leave together
    return 0


if __name__ == "__main__":
    sys.exit(main())
