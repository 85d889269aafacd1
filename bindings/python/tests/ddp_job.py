"""One rank of the Python DDP tests (run by test_dtrain.py).

    ddp_job.py ddp DIR [Z]  under a launcher: DDP on this rank's half of each batch
                            (sharding level Z, default 0); writes DIR/rank<r>.npy (and
                            rank 0 DIR/init.npy)
    ddp_job.py single DIR   one process on the whole batch: DIR/single.npy
    ddp_job.py resume DIR   one process from the sharded checkpoint DIR/ckpt (which a ddp
                            run with Z > 0 saves after step 10): DIR/resume.npy; the
                            same checkpoint consolidated into one file must load the same
    ddp_job.py die -        rank 1 exits after 2 steps; rank 0 prints the error it gets
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtrain as dt  # noqa: E402

B, STEPS = 16, 20   # samples per rank per step, steps


def mlp_params(ctx, sizes):
    """Linear layers sizes[0] -> sizes[1] -> ..., initialised as torch.nn.Linear."""
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        w = ctx.param("l%d.weight" % i, (b, a))
        bias = ctx.param("l%d.bias" % i, (b,))
        dt.init_kaiming_uniform(w, 5 ** 0.5)
        dt.init_bias(bias, a)
        layers.append((w, bias))
    return layers


def forward(layers, x):
    h = dt.relu(dt.linear(x, *layers[0]))
    return dt.linear(h, *layers[1])


def flat(ctx):
    return np.concatenate([p.numpy().ravel() for p in ctx.params()])


def data(step):
    rng = np.random.default_rng(step)   # the global batch of this step
    x = rng.standard_normal((2 * B, 16)).astype(np.float32)
    t = np.tanh(x[:, :4] * 2 + x[:, 4:8]).astype(np.float32)
    return x, t


def consolidated_loads_the_same(ctx, ckpt, path):
    """The sharded checkpoint as one file, loaded into a second context: the same floats."""
    dt.checkpoint_consolidate(ctx, ckpt, path)
    with dt.Context(seed=12) as other:
        mlp_params(other, (16, 32, 4))
        opt = dt.Optimizer(other, "sgd", lr=0.05, momentum=0.9)
        return (dt.checkpoint_load(other, path, opt) == STEPS // 2 and
                np.array_equal(flat(other), flat(ctx)))


def main():
    mode, out = sys.argv[1], sys.argv[2]
    zero = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with dt.Context(seed=11) as ctx:
        comm = dt.Comm(ctx) if mode not in ("single", "resume") else None
        rank = comm.rank if comm else 0
        layers = mlp_params(ctx, (16, 32, 4))
        opt = dt.Optimizer(ctx, "sgd", lr=0.05, momentum=0.9)
        if mode == "ddp" and rank == 0:   # rank 0's are what DDP gives every rank
            np.save(os.path.join(out, "init.npy"), flat(ctx))
        ddp = dt.DDP(ctx, comm, opt, zero=zero) if comm else None
        ckpt, start = os.path.join(out, "ckpt"), 0
        if mode == "resume":
            start = dt.checkpoint_load(ctx, ckpt, opt)
            if not consolidated_loads_the_same(ctx, ckpt, os.path.join(out, "one.safetensors")):
                return 6
        try:
            for step in range(start, STEPS):
                if mode == "die" and rank == 1 and step == 2:
                    os._exit(3)   # no goodbye: the process just ends
                x, t = data(step)
                if comm:
                    x, t = x[rank * B:(rank + 1) * B], t[rank * B:(rank + 1) * B]
                loss = dt.mse(forward(layers, ctx.from_numpy(x)), ctx.from_numpy(t))
                ctx.backward(loss)
                (ddp or opt).step()
                opt.zero_grad()
                ctx.step_reset()
                if ddp and zero and step + 1 == STEPS // 2:
                    ddp.checkpoint_save(ckpt, opt, step + 1)
        except dt.Error as e:
            print("rank %d: step %d raised %s: %s" % (rank, step, type(e).__name__, e))
            return 0 if mode == "die" and "rank 1" in str(e) else 1
        if mode == "die":
            print("rank %d: no error after rank 1 left" % rank)
            return 2
        if zero == 3:   # each rank holds a shard of every parameter until gathered
            try:
                flat(ctx)
                return 4
            except dt.Error as e:
                if "full_params" not in str(e):
                    return 5
            ddp.full_params()
        name = mode + ".npy" if mode in ("single", "resume") else "rank%d.npy" % rank
        np.save(os.path.join(out, name), flat(ctx))
        if comm:
            comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
