# tests/checks/monitor.sh - the live monitor.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The live monitor from outside, on a running 2-rank job: /metrics through
# prometheus_client's parser, /api/state, /events, bad requests refused while
# training goes on (tests/monitor_check.py); headless Chromium renders the
# page twice, 2 s apart: both ranks in the DOM and a step count that rose
# (the page polling /api/state: an endless /events stream would keep the
# headless browser's virtual clock from running out).
# Then a 1-process job serving off loopback: the token is required.
monitor_job() {   # LOG ARGS...: start the example in the background; MON_PID, MON_PORT
    local log=$1 i
    shift
    timeout -k 5 180 "$@" > "$log" 2>&1 &
    MON_PID=$! MON_PORT=""
    for i in $(seq 1 100); do
        MON_PORT=$(sed -n 's|^monitor: http://127.0.0.1:\([0-9]*\)/.*|\1|p' "$log")
        [ -n "$MON_PORT" ] && break
        sleep 0.2
    done
    [ -n "$MON_PORT" ] || { cat "$log"; kill $MON_PID; echo "monitor check: no port"; exit 1; }
    sleep 2   # two intervals: every rank has published
}

monitor_page_steps() {   # the step count the rendered page shows, and its ranks
    timeout 30 chromium --headless --disable-gpu --no-sandbox --virtual-time-budget=3000 \
        --dump-dom "http://127.0.0.1:$MON_PORT/?poll=500" 2>/dev/null |
        grep -o 'data-rank="[0-9]*"\|id="steps">[0-9]*' | sort -u | tr '\n' ' '
}

# One of two parameter servers slowed: rank 3 stopped and resumed every
# 100 ms (SIGSTOP/SIGCONT) for 6 s of a 4-rank job (2 workers, 2 servers).
# /api/state and /metrics must name rank 3 while it happens, and the
# end-of-job report after it.
monitor_ps_check() {
    local log=$1 fast=$2 pid i
    monitor_job $log $fast --ranks 4 --servers 2 --ps-mode asp --model mlp --epochs 2 --monitor 0
    pid=$(/usr/bin/python3 -c 'import json, sys, urllib.request as u
print(json.load(u.urlopen(sys.argv[1]))["ranks"][3]["pid"])' "http://127.0.0.1:$MON_PORT/api/state")
    for i in $(seq 1 30); do kill -STOP $pid; sleep 0.1; kill -CONT $pid; sleep 0.1; done
    /usr/bin/python3 - "$MON_PORT" <<'PY' || { kill $MON_PID; exit 1; }
import json, sys, urllib.request as u
from prometheus_client.parser import text_string_to_metric_families
base = f"http://127.0.0.1:{sys.argv[1]}"
s = json.load(u.urlopen(base + "/api/state"))
stalled = {x.labels["rank"]: x.value
           for f in text_string_to_metric_families(u.urlopen(base + "/metrics").read().decode())
           if f.name == "dtrain_ps_server_stalled_seconds" for x in f.samples}
if s["slow_server"] != 3 or "rank 3 did not run" not in s["server_why"] or \
        sorted(stalled) != ["2", "3"] or not stalled["3"] > stalled["2"]:
    sys.exit(f"monitor check: the slowed server is not named: {s['slow_server']}, "
             f"'{s['server_why']}', stalled {stalled}")
print(f"monitor check: server rank 3 slowed: /api/state says \"{s['server_why']}\"; "
      f"dtrain_ps_server_stalled_seconds_total {stalled}")
PY
    wait $MON_PID || { tail -20 $log; echo "monitor check: the parameter-server job failed"; exit 1; }
    grep -q "^slowest parameter server: parameter server rank 3 did not run" $log ||
        { grep "parameter server" $log; echo "monitor check: the report does not name rank 3"; exit 1; }
    echo "monitor check: the report: $(grep '^slowest parameter server' $log)"
}

# A rank that dies in a job that goes on: 2 workers and 2 servers (ASP)
# started as separate processes (a launcher would stop the others), worker 1
# SIGKILLed: within 2 s it is "died" on rank 0's page, and rank 0 keeps
# training (its steps rise) to its test accuracy (its end-of-job collectives
# then fail on the dead rank, as they should).  Pieces of 4 KiB
# (DTRAIN_PS_CHUNK): on shm a larger send to a dead process holds back the
# server's later sends (docs/PARAMETER_SERVER.md, "Messages").
monitor_died_check() {
    local log=$1 fast=$2 r pids=() port=$((29800 + RANDOM % 100)) r1 i
    for r in 0 1 2 3; do
        DTRAIN_RANK=$r DTRAIN_WORLD_SIZE=4 DTRAIN_MASTER=127.0.0.1:$port DTRAIN_JOB_TOKEN=died-check \
            DTRAIN_PS_CHUNK=4096 timeout -k 5 180 $fast --ranks 4 --servers 2 --ps-mode asp \
            --model mlp --epochs 3 --monitor 0 > $log.$r 2>&1 &
        pids+=($!)
    done
    MON_PORT=""
    for i in $(seq 1 100); do
        MON_PORT=$(sed -n 's|^monitor: http://127.0.0.1:\([0-9]*\)/.*|\1|p' $log.0)
        [ -n "$MON_PORT" ] && break
        sleep 0.2
    done
    sleep 2
    r1=$(/usr/bin/python3 -c 'import json, sys, urllib.request as u
print(json.load(u.urlopen(sys.argv[1]))["ranks"][1]["pid"])' "http://127.0.0.1:$MON_PORT/api/state") ||
        { kill "${pids[@]}"; echo "monitor check: no state from the PS job"; exit 1; }
    kill -9 "$r1"
    sleep 2
    /usr/bin/python3 - "$MON_PORT" <<'PY' || { kill "${pids[@]}"; exit 1; }
import json, sys, time, urllib.request as u
url = f"http://127.0.0.1:{sys.argv[1]}/api/state"
a = json.load(u.urlopen(url))
time.sleep(1.5)
b = json.load(u.urlopen(url))
status = [r["status"] for r in b["ranks"]]
if status[1] != "died" or status[0] != "up" or not b["ranks"][0]["steps"] > a["ranks"][0]["steps"]:
    sys.exit(f"monitor check: worker 1 killed: statuses {status}, rank 0's steps "
             f"{a['ranks'][0]['steps']} -> {b['ranks'][0]['steps']}")
print(f"monitor check: worker 1 killed (SIGKILL): 'died' on the page; rank 0 goes on, steps "
      f"{a['ranks'][0]['steps']} -> {b['ranks'][0]['steps']}")
PY
    wait "${pids[0]}" || true   # (its end-of-job collectives include the dead rank: an error)
    grep -q "^test accuracy: " $log.0 ||
        { tail -5 $log.0; kill "${pids[@]}" 2> /dev/null; echo "monitor check: rank 0 did not finish training after the death"; exit 1; }
    echo "monitor check: rank 0 trained to the end after the death: $(grep '^test accuracy: ' $log.0)"
    kill "${pids[@]}" 2> /dev/null || true
    wait 2> /dev/null || true
}

monitor_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 log=$BUILD/test/monitor.log a b sa sb
    monitor_job $log $fast --ranks 2 --model mlp --epochs 100 --monitor 0
    /usr/bin/python3 tests/monitor_check.py $MON_PORT 2 || { kill $MON_PID; exit 1; }
    if command -v chromium > /dev/null; then
        a=$(monitor_page_steps)
        sleep 2
        b=$(monitor_page_steps)
        sa=$(echo "$a" | sed -n 's/.*id="steps">\([0-9]*\).*/\1/p')
        sb=$(echo "$b" | sed -n 's/.*id="steps">\([0-9]*\).*/\1/p')
        case "$b" in *'data-rank="0"'*'data-rank="1"'*) ;; *) sb="" ;; esac
        if [ -z "$sa" ] || [ -z "$sb" ] || [ "$sb" -le "$sa" ]; then
            kill $MON_PID; echo "monitor check: the rendered page: '$a' then '$b'"; exit 1
        fi
        echo "monitor check: headless Chromium renders both ranks; the page's step count $sa, 2 s later $sb"
        /usr/bin/python3 tests/monitor_page64.py || { kill $MON_PID; exit 1; }
    else
        skipped "monitor check: the page's rendering" "no chromium"
    fi
    # rank 1 stopped (SIGSTOP): silent on the page and down in /metrics
    # within 3 intervals; rank 0 (waiting for it in an allreduce) still up
    local r1
    r1=$(/usr/bin/python3 -c 'import json, sys, urllib.request as u
print(json.load(u.urlopen(sys.argv[1]))["ranks"][1]["pid"])' "http://127.0.0.1:$MON_PORT/api/state")
    [ "${r1:-0}" -gt 1 ] || { kill $MON_PID; echo "monitor check: rank 1's pid not given"; exit 1; }
    kill -STOP $r1
    sleep 5
    /usr/bin/python3 tests/monitor_check.py $MON_PORT 2 --silent 1 || { kill -CONT $r1; kill $MON_PID; exit 1; }
    kill -CONT $r1
    kill $MON_PID; wait $MON_PID 2>/dev/null || true   # (killed: not a failure)
    monitor_ps_check $log $fast
    monitor_died_check $log $fast
    # a sharded job (zero 3): its parameter gathers on every rank
    monitor_job $log $fast --ranks 2 --model mlp --epochs 100 --zero 3 --monitor 0
    /usr/bin/python3 tests/monitor_check.py $MON_PORT 2 --zero || { kill $MON_PID; exit 1; }
    kill $MON_PID; wait $MON_PID 2>/dev/null || true
    DTRAIN_JOB_TOKEN=monitor-check-token monitor_job $log $fast --model mlp --epochs 100 \
        --monitor 0.0.0.0:0
    /usr/bin/python3 tests/monitor_check.py $MON_PORT 1 monitor-check-token || { kill $MON_PID; exit 1; }
    kill $MON_PID; wait $MON_PID 2>/dev/null || true   # (killed: not a failure)
    echo "monitor checks: ok"
}
