# tests/checks/profile.sh - the profiler's end-to-end checks.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The profiler end to end (optimized build): a 2-rank run's merged trace
# is valid trace-event JSON with both ranks' phases and collectives, and on
# each rank the phase events add up to the step events within 5% (the rest
# is idle, outside dtrain's calls); with rank 1 made 3x slower the report
# names it and load balancing moves rank 0's share of the global batch up.
profile_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 trace=$BUILD/test/trace.json out share
    rm -f "$trace"
    out=$(timeout -k 5 120 "$fast" --ranks 2 --model mlp --epochs 1 --limit-batches 40 --profile \
          --trace "$trace")
    echo "$out" | grep -q "^dtrain profile: 2 ranks, 40 steps on rank 0, timeline in $trace" ||
        { echo "profile check: no report:"; echo "$out" | tail -20; exit 1; }
    /usr/bin/python3 - "$trace" <<'PY' || exit 1
import json, sys
t = json.load(open(sys.argv[1]))
ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
for r in (0, 1):
    mine = [e for e in ev if e["pid"] == r]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "step"]
    steps = sum(b - a for a, b in spans)
    # phases inside the steps (evaluation after the last step is in none)
    phases = sum(e["dur"] for e in mine if e["cat"] == "phase" and
                 any(a - 1 <= e["ts"] and e["ts"] + e["dur"] <= b + 1 for a, b in spans))
    comm = [e for e in mine if e["tid"] == 2 and e["cat"] == "comm"]
    n = sum(1 for e in mine if e["cat"] == "step")
    assert n == 40, f"rank {r}: {n} steps"
    assert comm and all(e["args"]["busbw_GBps"] >= 0 for e in comm), f"rank {r}: no collectives"
    # the phases tile each step (idle too): only the trace's rounding may differ
    assert abs(phases - steps) <= 0.005 * steps, f"rank {r}: phases {phases} us, steps {steps} us"
    print(f"profile check: rank {r}: 40 steps, phases {phases/1e3:.1f} ms of {steps/1e3:.1f} ms, "
          f"{len(comm)} collectives")
PY
    out=$(timeout -k 5 120 "$fast" --ranks 2 --model mlp --epochs 1 --limit-batches 60 --profile \
          --slow 1:3 --balance)
    echo "$out" | grep -q "^straggler: rank 1 computes" ||
        { echo "profile check: the slowed rank is not named:"; echo "$out" | tail -20; exit 1; }
    share=$(echo "$out" | sed -n "s/^load balancing: rank 0's share of each global batch \([0-9.]*\)%$/\1/p")
    if [ -z "$share" ] || ! awk -v s="$share" 'BEGIN { exit !(s >= 60) }'; then
        echo "profile check: balancing did not move the load (rank 0's share '$share')"; exit 1
    fi
    echo "profile check: rank 1 named a straggler; balanced, rank 0 takes $share% of each batch"
    echo "profile checks: ok"
}
