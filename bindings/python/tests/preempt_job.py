"""One rank of the Python pre-emption test (run by test_dtrain.py under dtrun -n 2).

    preempt_job.py      every rank enables pre-emption and votes after each of 50
                        steps; rank 1 sends itself SIGTERM during step 7 (a node taken
                        back), so every rank must stop after step 8, the same step,
                        print "rank R: pre-empted at step 8 (SIGTERM)..." and exit
                        EXIT_PREEMPTED (75).  Rank 0 must not have received a signal.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtrain as dt  # noqa: E402

ctx = dt.Context()
ctx.preempt_enable()
comm = dt.Comm(ctx)
for step in range(50):
    if comm.rank == 1 and step == 7:
        os.kill(os.getpid(), signal.SIGTERM)   # caught: the process goes on
    comm.barrier()   # the step's work
    if ctx.preempt_agree(comm, step + 1):
        assert ctx.preempt_signal == (signal.SIGTERM if comm.rank == 1 else 0), ctx.preempt_signal
        ctx.preempt_saved(0.25)
        print("rank %d: %s" % (comm.rank, ctx.preempt_report), flush=True)
        comm.close()
        ctx.close()
        sys.exit(dt.EXIT_PREEMPTED)
print("rank %d: never stopped" % comm.rank)
sys.exit(1)
