"""One rank of the Python parameter-server test (run by test_dtrain.py under the launcher,
3 ranks: workers 0 and 1, server 2).

    ps_job.py DIR

The store, the collectives in the background and the parameter server from Python: each
rank writes DIR/rank<r>.json with what it saw.  Workers train a linear model whose weight
lives on the server (BSP, SGD lr 0.5) and an embedding table's rows 1 and 3 by sparse
pushes; rank 0 checks the arithmetic the test compares.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtrain as dt  # noqa: E402


def collectives(ctx, comm, seen):
    r, p = comm.rank, comm.size
    env = dt.dist_env(ctx)   # a store of its own, next to the communicator's
    store = dt.Store(ctx, env._replace(master_port=env.master_port + 1),
                     token=os.environ.get("DTRAIN_JOB_TOKEN"))
    seen["visits"] = store.add("visits", 1)
    if r == 0:
        store.set("greeting", "hello from 0")
    seen["greeting"] = store.get("greeting", timeout_ms=20000).decode()
    comm.barrier()   # rank 0 serves the store: everyone is done with it first
    store.close()
    a = np.full(4, r + 1, np.float32)
    work = comm.allreduce_async(a)
    work.wait()
    seen["allreduce"] = a.tolist()
    rs = np.arange(2 * p, dtype=np.float32) + r
    part = np.zeros(2, np.float32)
    comm.reduce_scatter(rs, part)
    seen["reduce_scatter"] = part.tolist()
    send = np.array([10 * r + j for j in range(p)], np.float32)
    got = np.zeros(p, np.float32)
    comm.alltoall(send, got)
    seen["alltoall"] = got.tolist()
    seen["hosts"], seen["bytes_sent"] = comm.hosts, comm.bytes_sent


def train(ctx, comm, seen):
    w = ctx.param("w", (2,)) if comm.rank < 2 else None
    ps = dt.ParameterServer(ctx, comm, servers=1, mode="bsp", optim="sgd", lr=0.5,
                            tables=[("emb", 5, 3, 0.0, 1)])
    seen["is_server"], seen["workers"], seen["servers"] = ps.is_server, ps.workers, ps.servers
    if ps.is_server:
        ps.serve()
        seen["server_stats"] = ps.stats()
        return
    for step in range(3):
        # d loss/d w = w - target: the server averages the two workers' gradients
        target = np.array([1.0, -1.0], np.float32) * (comm.rank + 1)
        ctx.backward(dt.sum(dt.mul(dt.sub(w, ctx.from_numpy(target)),
                                   dt.sub(w, ctx.from_numpy(target)))) * 0.5)
        ps.sparse_push(0, [1, 3], np.ones((2, 3), np.float32) * (comm.rank + 1))
        ps.push_pull()
        ctx.zero_grad()
        ctx.step_reset()
    work, rows = ps.sparse_pull_async(0, [1, 3, 0])
    work.wait()
    seen["w"], seen["rows"] = w.numpy().tolist(), rows.tolist()
    seen["worker_stats"] = ps.stats()
    ps.finish()


def main():
    out = sys.argv[1]
    seen = {}
    with dt.Context(seed=3) as ctx:
        comm = dt.Comm(ctx)
        collectives(ctx, comm, seen)
        train(ctx, comm, seen)
        comm.barrier()
        with open(os.path.join(out, "rank%d.json" % comm.rank), "w") as f:
            json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
