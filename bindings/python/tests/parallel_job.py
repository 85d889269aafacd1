"""One rank of the Python model-parallel test (run by test_dtrain.py under dtrun -n 2).

    parallel_job.py     a 2-stage pipeline (1F1B, 3 micro-batches) and a 2-way
                        tensor-parallel MLP, each trained 20 steps and compared with the
                        unsplit model trained alone in a second context: within 1e-5
                        relative.  Exits 0 and prints "rank R: ok", else raises.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtrain as dt  # noqa: E402

B, STEPS = 12, 20
SIZES = (8, 16, 12, 4)   # three linear layers: stage 0 holds layer 0, stage 1 layers 1-2


def data(step):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((B, SIZES[0])).astype(np.float32)
    y = (np.arange(B) * 3 + step) % SIZES[-1]
    return x, y.astype(np.int32)


def make(ctx, tag, sizes, init=None):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        w, bias = ctx.param("%s.w%d" % (tag, i), (b, a)), ctx.param("%s.b%d" % (tag, i), (b,))
        if init is None:
            dt.init_kaiming_uniform(w, 5 ** 0.5)
            dt.init_bias(bias, a)
        else:
            w.copy_from(init[i][0])
            bias.copy_from(init[i][1])
        layers.append((w, bias))
    return layers


def run(layers, x, last):
    for i, (w, b) in enumerate(layers):
        x = dt.linear(x, w, b)
        if not (last and i == len(layers) - 1):
            x = dt.relu(x)
    return x


def close(a, b, what):
    scale = np.abs(b).max()
    assert np.abs(a - b).max() <= 1e-5 * scale, "%s: differs by %g (largest %g)" % (
        what, np.abs(a - b).max(), scale)


def reference(steps=STEPS):
    """The unsplit model alone: its starting and final weights."""
    with dt.Context(seed=5) as ref:
        layers = make(ref, "ref", SIZES)
        init = [(w.numpy(copy=True), b.numpy(copy=True)) for w, b in layers]
        opt = dt.Optimizer(ref, "sgd", lr=0.05, momentum=0.9)
        for k in range(steps):
            x, y = data(k)
            loss = dt.cross_entropy(run(layers, ref.from_numpy(x), True), ref.from_numpy(y))
            ref.backward(loss)
            opt.step()
            ref.zero_grad()
            ref.step_reset()
        return init, [(w.numpy(copy=True), b.numpy(copy=True)) for w, b in layers]


def pipeline(ctx, comm, init, final):
    s = comm.rank
    mine = [0] if s == 0 else [1, 2]
    layers = make(ctx, "pipe", SIZES[mine[0]:mine[-1] + 2], [init[i] for i in mine])

    def stage(x, y):
        h = run(layers, x, s == 1)
        return dt.cross_entropy(h, y) if s == 1 else h

    pipe = dt.Pipe(ctx, comm, stage, micro_batches=3, schedule="1f1b")
    opt = dt.Optimizer(ctx, "sgd", params=[p for l in layers for p in l], lr=0.05, momentum=0.9)
    for k in range(STEPS):
        x, y = data(k)
        loss = pipe.step(ctx.from_numpy(x) if s == 0 else None,
                         ctx.from_numpy(y) if s == 1 else None)
        assert (loss is None) == (s == 0), loss
        opt.step()
        ctx.zero_grad()
        ctx.step_reset()
    st = pipe.stats()
    assert st["steps"] == STEPS and st["in_flight_peak"] == (2 if s == 0 else 1), st
    for (w, b), i in zip(layers, mine):
        close(w.numpy(), final[i][0], "pipeline stage %d w%d" % (s, i))
        close(b.numpy(), final[i][1], "pipeline stage %d b%d" % (s, i))
    pipe.close()


def tensor_parallel(ctx, comm, init, final):
    """Layer 1 (16 -> 12) by columns of its output, layer 2 (12 -> 4) by rows of its
    input; layer 0 replicated."""
    r = comm.rank
    w0, b0 = ctx.param("tp.w0", (16, 8)), ctx.param("tp.b0", (16,))
    w0.copy_from(init[0][0])
    b0.copy_from(init[0][1])
    full = dt.Context(seed=1)
    parts = []
    for name, arr, dim, shape in (("w1", init[1][0], 0, (6, 16)), ("b1", init[1][1], 0, (6,)),
                                  ("w2", init[2][0], 1, (4, 6))):
        p = ctx.param("tp." + name, shape)
        dt.tp_shard(comm, full.from_numpy(arr, copy=True), dim, p)
        parts.append(p)
    b2 = ctx.param("tp.b2", (4,))
    b2.copy_from(init[2][1])
    w1, b1, w2 = parts
    opt = dt.Optimizer(ctx, "sgd", params=[w0, b0, w1, b1, w2, b2], lr=0.05, momentum=0.9)
    for k in range(STEPS):
        x, y = data(k)
        h = dt.relu(dt.linear(ctx.from_numpy(x), w0, b0))
        h = dt.relu(dt.tp_linear_col(comm, h, w1, b1))
        loss = dt.cross_entropy(dt.tp_linear_row(comm, h, w2, b2, input_is_split=True),
                                ctx.from_numpy(y))
        ctx.backward(loss)
        opt.step()
        ctx.zero_grad()
        ctx.step_reset()
    close(w0.numpy(), final[0][0], "tp w0")
    close(w1.numpy(), final[1][0][6 * r:6 * (r + 1)], "tp w1 shard")
    close(b1.numpy(), final[1][1][6 * r:6 * (r + 1)], "tp b1 shard")
    close(w2.numpy(), final[2][0][:, 6 * r:6 * (r + 1)], "tp w2 shard")
    close(b2.numpy(), final[2][1], "tp b2")
    full.close()


def main():
    init, final = reference()
    with dt.Context(seed=3) as ctx:
        comm = dt.Comm(ctx)
        pair = comm.split(0, comm.rank)   # a group over both ranks, as a program would make
        assert pair.size == 2 and pair.job_rank(pair.rank) == comm.rank
        got = np.zeros(3, np.float32)
        pair.sendrecv(np.full(3, comm.rank, np.float32), 1 - pair.rank, got, 1 - pair.rank)
        assert (got == 1 - comm.rank).all(), got
        pipeline(ctx, pair, init, final)
        tensor_parallel(ctx, comm, init, final)
        assert dt.pipe_partition([1, 1, 1, 1, 1, 1, 8, 1], 2) == [0, 6, 8]
        pair.close()
        comm.close()
    print("rank %s: ok" % os.environ.get("DTRAIN_RANK"))


if __name__ == "__main__":
    main()
