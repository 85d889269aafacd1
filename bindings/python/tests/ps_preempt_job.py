"""One rank of the Python parameter-server pre-emption test (run by test_dtrain.py under
dtrun -n 3: workers 0 and 1, server 2).

    ps_preempt_job.py DIR

Every rank enables pre-emption.  Worker 1 sends itself SIGTERM during step 5 (a node taken
back); its pushes carry the vote to the server, whose answers carry the verdict, so both
workers' preempt_agree says stop after the same step with no collective among them.  The
workers print "worker R: pre-empted at step N ..." and exit EXIT_PREEMPTED; the server's
serve() raises Preempted once it has saved that step into DIR, and it prints "server:
<its report>" and exits EXIT_PREEMPTED too.
"""
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtrain as dt  # noqa: E402

ctx = dt.Context(seed=3)
ctx.preempt_enable()
comm = dt.Comm(ctx)
w = ctx.param("w", (2,)) if comm.rank < 2 else None
ps = dt.ParameterServer(ctx, comm, servers=1, mode="bsp", optim="sgd", lr=0.1,
                        checkpoint_dir=sys.argv[1])
if ps.is_server:
    try:
        ps.serve()
        print("server: served to the end, never pre-empted", flush=True)
        sys.exit(1)
    except dt.Preempted:
        print("server: %s" % ctx.preempt_report, flush=True)
    ps.close()
    comm.barrier()
    sys.exit(dt.EXIT_PREEMPTED)
for step in range(200):
    if comm.rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGTERM)   # caught: the process goes on
    target = np.array([1.0, -1.0], np.float32) * (comm.rank + 1)
    d = dt.sub(w, ctx.from_numpy(target))
    ctx.backward(dt.sum(dt.mul(d, d)) * 0.5)
    ps.push_pull()
    ctx.zero_grad()
    ctx.step_reset()
    if ctx.preempt_agree(comm, step + 1):
        ctx.preempt_saved(-1)   # (the server saved the parameters)
        print("worker %d: %s" % (comm.rank, ctx.preempt_report), flush=True)
        ps.finish()
        ps.close()
        comm.barrier()
        sys.exit(dt.EXIT_PREEMPTED)
print("worker %d: never stopped" % comm.rank, flush=True)
sys.exit(1)
