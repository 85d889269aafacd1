#!/usr/bin/env bash
# tests/bench/profile.sh - the profiler and load balancing (issue 7), in one run:
#   1. profiler overhead: MLP (784-512-512-10, batch 128) and CNN (2 conv,
#      batch 64) training steps on Fashion-MNIST, 1 process x 1 thread,
#      dtrain's profiler off vs on (bench_profile.c), against PyTorch with
#      torch.profiler (CPU activity) off vs on (bench_profile_torch.py);
#      target: dtrain's overhead <= 2%;
#   2. dynamic load balancing: build/fashion_mnist, MLP, 2 ranks DDP over
#      shm, one epoch cut at LIMIT batches, rank 1 made F times slower
#      (--slow 1:F), without and with --balance; target: --balance wins back
#      at least half of the time the slow rank cost;
#   3. work stealing: 2 workers + 1 parameter server (ASP), worker 1 three
#      times slower, one full epoch, with and without --steal 4: the whole
#      job's wall time, and how many batches worker 0 ran and took.
#
#   bash tests/bench/profile.sh      (from any cwd; about 10 minutes)
#
# Knobs: REPEATS=5 (passes of sections 1 and 2; medians), STEAL_REPEATS=3
# (passes of section 3, ~30 s a run here), LIMIT=200 (section 2 batches),
# SECTIONS="1 2 3", TORCH_PYTHON=/usr/bin/python3, QUIET_WAIT=15 (seconds
# to wait for other load to settle before each pass), STRICT=1 (exit 1 on
# a missed target).  Every ratio compares numbers taken in this run, the
# sides interleaved pass by pass.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=${TORCH_PYTHON:-/usr/bin/python3}
REPEATS=${REPEATS:-5}
STEAL_REPEATS=${STEAL_REPEATS:-3}
LIMIT=${LIMIT:-200}
SECTIONS=${SECTIONS:-"1 2 3"}
STRICT=${STRICT:-0}
QUIET_WAIT=${QUIET_WAIT:-15}
OUT="$HERE/build/profile"
mkdir -p "$OUT"
MISS=0
unset DTRAIN_PROFILE DTRAIN_TRACE   # the "off" sides must be off

timeout 600 ./build.sh build >&2 || { echo "profile.sh: ./build.sh build failed" >&2; exit 1; }
BIN="$OUT/bench_profile"
gcc -std=c11 -O2 -Wall -Wextra -Werror -I"$ROOT" "$HERE/bench_profile.c" "$ROOT/build/libdtrain.a" \
    $(cat "$ROOT/build/libdtrain.ldflags") -o "$BIN" || { echo "profile.sh: building bench_profile failed" >&2; exit 1; }
"$PY" -c 'import torch' 2>/dev/null || { echo "profile.sh: $PY cannot import torch (apt-get install python3-torch)" >&2; exit 1; }
FM="$ROOT/build/fashion_mnist"

# Other work on this small machine skews everything: how busy the CPUs are
# (from /proc/stat, over one second), waiting up to QUIET_WAIT seconds for
# them to calm down; a warning on stderr when they do not.
busy_pct() {
    local a b
    a=$(head -n 1 /proc/stat); sleep 1; b=$(head -n 1 /proc/stat)
    echo "$a" "$b" | awk '{
        n = (NF - 2) / 2
        for (i = 2; i <= n + 1; i++) { t0 += $i; t1 += $(i + n + 1) }
        idle0 = $5 + $6; idle1 = $(5 + n + 1) + $(6 + n + 1)
        printf "%.0f\n", ((t1 - t0) > 0 ? 100 * (1 - (idle1 - idle0) / (t1 - t0)) : 0)
    }'
}
BUSY_WARN=0
quiet() {
    local b waited=0
    b=$(busy_pct)
    while ((b > 15 && waited < QUIET_WAIT)); do b=$(busy_pct); waited=$((waited + 1)); done
    if ((b > 15)); then
        echo "# WARNING ($1): other load keeps ${b}% of the CPUs busy; numbers are noisy" >&2
        BUSY_WARN=$((BUSY_WARN + 1))
    fi
    return 0
}

# key=value from a result line
val() { echo "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
# the median of the numbers on stdin, one per line
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2); else print "nan" }'; }
# KEY's values over the lines of file F, one per line
col() { awk -v k="$2=" '{ for (i = 1; i <= NF; i++) if (index($i, k) == 1) print substr($i, length(k) + 1) }' "$1"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }
pct() { awk -v r="$1" 'BEGIN { printf "%+.1f%%", 100 * (r - 1) }'; }
target() { # LABEL SHOWN OK
    local v=PASS
    [[ $3 == 1 ]] || { v=MISS; MISS=$((MISS + 1)); }
    printf "%-66s %9s  %s\n" "$1" "$2" "$v"
}

# --------------------------------------------------- 1. profiler overhead ---
if [[ " $SECTIONS " == *" 1 "* ]]; then
    R="$OUT/overhead.txt"
    : > "$R"
    for rep in $(seq 1 "$REPEATS"); do
        quiet "overhead pass $rep"
        for model in mlp cnn; do
            # which side runs first alternates from pass to pass
            if ((rep % 2)); then order="dtrain torch"; else order="torch dtrain"; fi
            for impl in $order; do
                echo "# pass $rep/$REPEATS: $model $impl" >&2
                if [[ $impl == dtrain ]]; then
                    OPENBLAS_NUM_THREADS=1 "$BIN" --model "$model" --threads 1
                else
                    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$PY" "$HERE/bench_profile_torch.py" \
                        --model "$model" --threads 1
                fi | tee -a "$R" | { grep -v '^profile' >&2 || true; }
            done
        done
    done
    echo "== 1. profiler overhead: 1 process x 1 thread, Fashion-MNIST, median ms/step, $REPEATS passes =="
    echo "(off/on: medians over the passes of each pass's median step; overhead: median over the passes of"
    echo " each pass's median over interleaved off/on block pairs of (median step on / median step off) - 1)"
    printf "%-5s %5s | %9s %9s %9s | %9s %9s %9s | %s\n" model batch "dt off" "dt on" overhead \
        "torch off" "torch on" overhead "overhead per pass (dtrain; torch)"
    for spec in "mlp 128" "cnn 64"; do
        read -r model batch <<< "$spec"
        for impl in dtrain torch; do
            grep "^profile impl=$impl model=$model " "$R" > "$OUT/o_$impl" || true
        done
        d_r=$(col "$OUT/o_dtrain" ratio | median) t_r=$(col "$OUT/o_torch" ratio | median)
        per_d=$(col "$OUT/o_dtrain" ratio | awk '{ printf "%s%+.1f", (NR > 1 ? " " : ""), 100 * ($1 - 1) }')
        per_t=$(col "$OUT/o_torch" ratio | awk '{ printf "%s%+.1f", (NR > 1 ? " " : ""), 100 * ($1 - 1) }')
        printf "%-5s %5s | %9.3f %9.3f %9s | %9.3f %9.3f %9s | %s; %s\n" "$model" "$batch" \
            "$(col "$OUT/o_dtrain" off_ms | median)" "$(col "$OUT/o_dtrain" on_ms | median)" "$(pct "$d_r")" \
            "$(col "$OUT/o_torch" off_ms | median)" "$(col "$OUT/o_torch" on_ms | median)" "$(pct "$t_r")" \
            "$per_d" "$per_t"
        # honesty: the profiler must have counted every step it was on for
        bad=$(awk '{ s = ""; p = ""; for (i = 1; i <= NF; i++) { if ($i ~ /^steps=/) s = substr($i, 7);
                     if ($i ~ /^prof_steps=/) p = substr($i, 12) } if (s != p) print }' "$OUT/o_dtrain")
        [[ -z $bad ]] || echo "  WARNING: dtrain's profiler counted other than the steps it was on for: $bad"
        ev=$(col "$OUT/o_dtrain" events | head -n 1) st=$(col "$OUT/o_dtrain" steps | head -n 1)
        tev=$(col "$OUT/o_torch" events | head -n 1)
        printf "%-5s %5s   events per step: dtrain %s, torch.profiler %s\n" "" "" \
            "$(awk -v e="$ev" -v s="$st" 'BEGIN { printf "%.0f", (s ? e / s : 0) }')" \
            "$(awk -v e="$tev" -v s="$st" 'BEGIN { printf "%.0f", (s ? e / s : 0) }')"
        eval "OVH_$model=$d_r"
    done
    for model in mlp cnn; do
        eval "r=\$OVH_$model"
        target "$model: dtrain profiler overhead per step <= 2%" "$(pct "$r")" "$(ge 1.02 "$r" && echo 1)"
    done
    echo
fi

# -------------------------------------------------- 2. load balancing (DDP) ---
# one run of build/fashion_mnist, 2 ranks; prints "T SHARE" (training
# seconds from the samples/s of the epoch line, rank 0's share or -)
ddp_run() { # tag args...
    local tag=$1 log="$OUT/lb_$1.log" sps t share
    shift
    "$FM" --model mlp --ranks 2 --epochs 1 --limit-batches "$LIMIT" "$@" < /dev/null > "$log" 2>&1 ||
        { echo "profile.sh: fashion_mnist $* failed:" >&2; tail -n 5 "$log" >&2; echo "nan -"; return; }
    # "epoch 1: ..., N samples/s, T s (...)": T has one decimal only; the
    # epoch's samples (LIMIT batches x 128 x 2 ranks, also with --balance,
    # whose slices add up to the global batch) over N gives more digits
    sps=$(sed -n 's/^epoch 1: .*, \([0-9.]*\) samples\/s, \([0-9.]*\) s .*/\1/p' "$log")
    t=$(sed -n 's/^epoch 1: .*, \([0-9.]*\) samples\/s, \([0-9.]*\) s .*/\2/p' "$log")
    share=$(sed -n "s/^load balancing: rank 0's share of each global batch \([0-9.]*\)%.*/\1/p" "$log")
    awk -v n=$((LIMIT * 128 * 2)) -v s="$sps" -v t="$t" -v sh="${share:--}" 'BEGIN {
        T = s > 0 ? n / s : 0
        if (T - t > 0.06 || t - T > 0.06) { printf "profile.sh: T %.3f from samples/s, %s printed\n", T, t > "/dev/stderr"; T = t }
        printf "%.3f %s\n", T, sh }'
}
if [[ " $SECTIONS " == *" 2 "* ]]; then
    (( LIMIT <= 234 )) || { echo "profile.sh: LIMIT must be <= 234 (the global batches of an epoch)" >&2; exit 1; }
    R="$OUT/balance.txt"
    : > "$R"
    for rep in $(seq 1 "$REPEATS"); do
        quiet "balance pass $rep"
        for cfg in fast slow2 bal2 slow3 bal3; do
            case $cfg in
                fast) args=() ;;
                slow2) args=(--slow 1:2) ;;
                bal2) args=(--slow 1:2 --balance) ;;
                slow3) args=(--slow 1:3) ;;
                bal3) args=(--slow 1:3 --balance) ;;
            esac
            echo "# pass $rep/$REPEATS: fashion_mnist ${args[*]:-(no slowdown)}" >&2
            read -r t share <<< "$(ddp_run "$cfg" "${args[@]}")"
            echo "lb pass=$rep cfg=$cfg t=$t share=$share" | tee -a "$R" >&2
        done
    done
    echo "== 2. load balancing: MLP, 2 ranks x 1 thread DDP over shm, batch 128 per rank, $LIMIT steps =="
    echo "(training seconds of the epoch, medians of $REPEATS passes; recovery = (T_slow - T_balance) / (T_slow - T_fast))"
    printf "%-8s | %8s %8s %10s | %12s %10s | %s\n" slowdown "T_fast" "T_slow" "T_balance" "rank 0 share" \
        recovery "recovery per pass"
    tf=$(grep "cfg=fast " "$R" | col /dev/stdin t | median)
    for f in 2 3; do
        ts=$(grep "cfg=slow$f " "$R" | col /dev/stdin t | median)
        tb=$(grep "cfg=bal$f " "$R" | col /dev/stdin t | median)
        sh=$(grep "cfg=bal$f " "$R" | col /dev/stdin share | median)
        rec=$(awk -v f="$tf" -v s="$ts" -v b="$tb" 'BEGIN { printf "%.2f", (s > f ? (s - b) / (s - f) : 0) }')
        per=$(awk -v f=$f '$1 == "lb" { split($2, p, "="); split($3, c, "="); split($4, t, "=")
                  T[p[2], c[2]] = t[2]; if (p[2] > np) np = p[2] }
              END { for (i = 1; i <= np; i++) { d = T[i, "slow" f] - T[i, "fast"]
                  printf "%s%s", (i > 1 ? " " : ""), (d > 0 ? sprintf("%.2f", (T[i, "slow" f] - T[i, "bal" f]) / d) : "n/a") } }' "$R")
        printf "%-8s | %8.2f %8.2f %10.2f | %11s%% %10s | %s\n" "1:$f" "$tf" "$ts" "$tb" "$sh" "$rec" "$per"
        eval "REC_$f=$rec"
    done
    target "--slow 1:2: --balance recovers >= half of what the slow rank cost" "$REC_2" "$(ge "$REC_2" 0.5 && echo 1)"
    target "--slow 1:3: --balance recovers >= half of what the slow rank cost" "$REC_3" "$(ge "$REC_3" 0.5 && echo 1)"
    echo
fi

# ------------------------------------------------ 3. work stealing (ASP PS) ---
if [[ " $SECTIONS " == *" 3 "* ]]; then
    R="$OUT/steal.txt"
    : > "$R"
    for rep in $(seq 1 "$STEAL_REPEATS"); do
        quiet "steal pass $rep"
        if ((rep % 2)); then order="fast nosteal steal"; else order="steal nosteal fast"; fi
        for cfg in $order; do
            case $cfg in
                fast) args=() ;;
                nosteal) args=(--slow 1:3) ;;
                steal) args=(--slow 1:3 --steal 4) ;;
            esac
            log="$OUT/ws_$cfg.log"
            echo "# pass $rep/$STEAL_REPEATS: fashion_mnist --ranks 3 --servers 1 --ps-mode asp ${args[*]}" >&2
            t0=$(date +%s.%N)
            "$FM" --model mlp --ranks 3 --servers 1 --ps-mode asp --epochs 1 "${args[@]}" < /dev/null > "$log" 2>&1 ||
                { echo "profile.sh: fashion_mnist ${args[*]} (ps) failed:" >&2; tail -n 5 "$log" >&2; }
            t1=$(date +%s.%N)
            ran=$(sed -n 's/^epoch 1: worker 0 ran \([0-9]*\) batches, \([0-9]*\) of them taken.*/\1/p' "$log")
            took=$(sed -n 's/^epoch 1: worker 0 ran \([0-9]*\) batches, \([0-9]*\) of them taken.*/\2/p' "$log")
            w0=$(sed -n 's/^\([0-9.]*\) s; pulls waited.*/\1/p' "$log")
            acc=$(sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p' "$log" | tail -n 1)
            echo "ws pass=$rep cfg=$cfg wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') w0=${w0:-nan} ran=${ran:--} took=${took:--} acc=${acc:-nan}" |
                tee -a "$R" >&2
            grep '^epoch 1: worker 0 ran' "$log" | sed 's/^/#   /' >&2 || true
        done
    done
    echo "== 3. work stealing: MLP, 2 workers + 1 server (ASP), batch 128, 1 epoch, worker 1 --slow 1:3 =="
    echo "(whole job wall time incl. start-up and evaluation, and worker 0's training time; medians of $STEAL_REPEATS passes)"
    printf "%-22s | %8s %11s | %-26s | %8s | %s\n" run "job s" "worker 0 s" "worker 0 ran / taken" "test acc" "job s per pass"
    for cfg in fast nosteal steal; do
        case $cfg in
            fast) label="no slowdown" ;;
            nosteal) label="--slow 1:3" ;;
            steal) label="--slow 1:3 --steal 4" ;;
        esac
        grep "cfg=$cfg " "$R" > "$OUT/w_$cfg" || true
        wall=$(col "$OUT/w_$cfg" wall | median)
        rt="(no line: own shard only)"
        if [[ $cfg == steal ]]; then
            rt="$(col "$OUT/w_$cfg" ran | median) / $(col "$OUT/w_$cfg" took | median) (medians)"
        fi
        printf "%-22s | %8.1f %11.1f | %-26s | %7.2f%% | %s\n" "$label" "$wall" "$(col "$OUT/w_$cfg" w0 | median)" \
            "$rt" "$(col "$OUT/w_$cfg" acc | median)" "$(col "$OUT/w_$cfg" wall | tr '\n' ' ')"
        eval "WALL_$cfg=$wall"
    done
    awk -v f="$WALL_fast" -v n="$WALL_nosteal" -v s="$WALL_steal" 'BEGIN {
        printf "stealing: job %.2fx faster than without (%.1f s -> %.1f s)", (s > 0 ? n / s : 0), n, s
        if (n > f) printf "; recovers %.0f%% of the %.1f s the slow worker cost", 100 * (n - s) / (n - f), n - f
        printf "\n" }'
    echo
fi

((BUSY_WARN)) && echo "note: $BUSY_WARN pass(es) started while other load kept the CPUs busy (see stderr)"
echo "$MISS target(s) missed"
((STRICT && MISS)) && exit 1
exit 0
