#!/usr/bin/env bash
# tests/bench/monitor.sh - what the live monitor costs a training step, in one
# run: the Fashion-MNIST example, 2 ranks x 1 thread over shm (DDP), with the
# monitor on (`--monitor 0`, which also turns the profiler on) and a client
# that keeps the page's /events stream open and scrapes /metrics every second,
# against the same job with neither.  The runs alternate, REPEATS of each;
# the medians of the training samples/s the example prints are compared.
# Target (issue 24): on at most 1% slower.
#
#   bash tests/bench/monitor.sh        (from any cwd; about 2-3 minutes)
#
# Knobs: REPEATS=5, EPOCHS=2, MODEL=mlp (cnn: longer steps), STRICT=1 (exit 1
# on a missed target).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT" || exit 1
REPEATS=${REPEATS:-5}
EPOCHS=${EPOCHS:-2}
MODEL=${MODEL:-mlp}
STRICT=${STRICT:-0}
EX=$ROOT/build/test/fashion_mnist_O2
[[ -x $EX ]] || DT_BUILD_ONLY=1 ./build.sh test > /dev/null || exit 1
OUT=$(mktemp -d)

# The job's training throughput: the mean of its epochs' samples/s.
rate() {
    sed -n 's/^epoch [0-9]*: .*, \([0-9]*\) samples\/s, .*/\1/p' "$1" |
        awk '{ s += $1; n++ } END { if (n) printf "%.1f", s / n }'
}

# A browser and a Prometheus at once: /events held open, /metrics every 1 s.
client() {
    /usr/bin/python3 - "$1" <<'PY'
import sys, threading, time, urllib.request as u
base = f"http://127.0.0.1:{sys.argv[1]}"
def events():
    try:
        with u.urlopen(base + "/events", timeout=30) as r:
            while r.readline():
                pass
    except Exception:
        pass
threading.Thread(target=events, daemon=True).start()
scrapes = 0
while True:
    try:
        u.urlopen(base + "/metrics", timeout=5).read()
        scrapes += 1
    except Exception:
        break
    time.sleep(1)
print(scrapes)
PY
}

run() {   # off|on N
    local log=$OUT/$1.$2 port i cpid
    if [[ $1 == off ]]; then
        "$EX" --ranks 2 --model "$MODEL" --epochs "$EPOCHS" > "$log" 2>&1
    else
        "$EX" --ranks 2 --model "$MODEL" --epochs "$EPOCHS" --monitor 0 > "$log" 2>&1 &
        local pid=$!
        for i in $(seq 1 100); do
            port=$(sed -n 's|^monitor: http://127.0.0.1:\([0-9]*\)/.*|\1|p' "$log")
            [[ -n $port ]] && break
            sleep 0.1
        done
        client "$port" > "$log.scrapes" &
        cpid=$!
        wait $pid
        wait $cpid
    fi
    rate "$log"
}

declare -a OFF ON
for r in $(seq 1 "$REPEATS"); do
    OFF+=("$(run off "$r")")
    ON+=("$(run on "$r")")
    echo "repeat $r: off ${OFF[-1]} samples/s, on ${ON[-1]} samples/s ($(cat "$OUT/on.$r.scrapes") scrapes)"
done
median() { printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
moff=$(median "${OFF[@]}")
mon=$(median "${ON[@]}")
ratio=$(awk -v a="$moff" -v b="$mon" 'BEGIN { printf "%.4f", a / b }')
echo
echo "monitor: $MODEL, 2 ranks x 1 thread, $EPOCHS epochs, median of $REPEATS: off $moff samples/s, on $mon samples/s"
echo "monitor: step time on / off = $ratio (target <= 1.01)"
rm -rf "$OUT"
if [[ $STRICT == 1 ]] && ! awk -v r="$ratio" 'BEGIN { exit !(r <= 1.01) }'; then
    exit 1
fi
