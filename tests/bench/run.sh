#!/usr/bin/env bash
# tests/bench/run.sh - dtrain vs PyTorch: training-step time, matmul
# throughput vs raw OpenBLAS sgemm, and peak RSS of a one-epoch run.
#
# Runs from any cwd.  Environment knobs:
#   THREADS="1 2"      thread counts to measure
#   REPEATS=3          runs per side and thread count; the best median is kept
#   TORCH_PYTHON=/usr/bin/python3   interpreter that has python3-torch
#   CC=gcc             compiler for bench_train.c (and the library fallback)
#   STRICT=1           exit 1 when any target is missed
#   QUIET_WAIT=15      seconds to wait for other CPU load to settle before
#                      each measurement (0: do not wait, only warn)
# Every time is printed next to the peer's time from the same run, with the
# ratio; absolute numbers on their own mean little on a shared 2-core box.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"

CC=${CC:-gcc}
PY=${TORCH_PYTHON:-/usr/bin/python3}
THREADS=${THREADS:-"1 2"}
REPEATS=${REPEATS:-3}
STRICT=${STRICT:-0}
QUIET_WAIT=${QUIET_WAIT:-15}
OUT="$HERE/build"
mkdir -p "$OUT"
BIN="$OUT/bench_train"

# ---------------------------------------------------------------- build ---
BENCH_CFLAGS="-std=c11 -O2 -Wall -Wextra -Werror -I$ROOT"
LIBS="-lopenblas -lfabric -lz -lm -lpthread"   # libdtrain.a includes the libfabric transport
LIBA="$ROOT/build/libdtrain.a"
# a library built with the CUDA backend needs its libraries too (build.sh writes them)
[[ -f "$ROOT/build/libdtrain.ldflags" ]] && LIBS=$(cat "$ROOT/build/libdtrain.ldflags")
if [[ -f "$LIBA" && ! "$ROOT/dtrain.c" -nt "$LIBA" && ! "$ROOT/dtrain.h" -nt "$LIBA" ]]; then
    echo "# build: linking $LIBA"
    $CC $BENCH_CFLAGS "$HERE/bench_train.c" "$LIBA" $LIBS -o "$BIN"
elif [[ -f "$ROOT/dtrain.c" ]]; then
    [[ -f "$LIBA" ]] && echo "# build: $LIBA is older than the sources; compiling them instead"
    echo "# build: compiling dtrain.c (-O3 -march=native -DDT_WITH_CPU: the CPU backend inside)"
    # same flags as build.sh uses for build/libdtrain.a (minus -Werror)
    LIBFLAGS="-std=c11 -D_GNU_SOURCE -O3 -march=native -fno-math-errno -DDT_WITH_CPU -I$ROOT -pthread"
    $CC $LIBFLAGS -c "$ROOT/dtrain.c" -o "$OUT/dtrain.o"
    $CC $BENCH_CFLAGS -c "$HERE/bench_train.c" -o "$OUT/bench_train.o"
    $CC "$OUT/bench_train.o" "$OUT/dtrain.o" $LIBS -o "$BIN"
else
    echo "run.sh: no build/libdtrain.a and no dtrain.c to compile" >&2
    exit 1
fi

"$PY" -c 'import torch' 2>/dev/null || { echo "run.sh: $PY cannot import torch" >&2; exit 1; }

# ------------------------------------------------------------------ run ---
# Other work on this (small) machine skews everything: sample how busy the
# CPUs are (from /proc/stat, over one second, while we run nothing), wait up
# to QUIET_WAIT seconds for them to calm down, and warn if they do not.
busy_pct() {
    local a b
    a=$(head -n 1 /proc/stat); sleep 1; b=$(head -n 1 /proc/stat)
    echo "$a" "$b" | awk '{
        n = (NF - 2) / 2                      # fields per sample after "cpu"
        for (i = 2; i <= n + 1; i++) { t0 += $i; t1 += $(i + n + 1) }
        idle0 = $5 + $6; idle1 = $(5 + n + 1) + $(6 + n + 1)
        b = (t1 - t0) > 0 ? 100 * (1 - (idle1 - idle0) / (t1 - t0)) : 0
        printf "%.0f\n", b
    }'
}
busy_note() {
    local b waited=0
    b=$(busy_pct)
    while (( b > 15 && waited < QUIET_WAIT )); do b=$(busy_pct); waited=$((waited + 1)); done
    echo "# other load ($1): ${b}% of all CPUs busy$( ((waited)) && echo " (waited ${waited}s)")" >&2
    (( b <= 15 )) || echo "# WARNING: machine is busy; ratios are noisy (REPEATS keeps the best run)" >&2
    return 0
}
RES="$OUT/results.txt"
: > "$RES"
busy_note start
for t in $THREADS; do
    for r in $(seq 1 "$REPEATS"); do
        [[ $t == "${THREADS%% *}" && $r == 1 ]] || busy_note "before threads=$t repeat $r"
        echo "# threads=$t repeat $r/$REPEATS: dtrain" >&2
        OPENBLAS_NUM_THREADS=$t "$BIN" --threads "$t" |
            sed "s/^/dtrain /" | tee -a "$RES" | { grep -v '^dtrain #' >&2 || true; } || { echo "run.sh: bench_train failed" >&2; exit 1; }
        echo "# threads=$t repeat $r/$REPEATS: torch" >&2
        OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t \
            "$PY" "$HERE/bench_torch.py" --threads "$t" |
            sed "s/^/torch /" | tee -a "$RES" | { grep -v '^torch #' >&2 || true; } || { echo "run.sh: bench_torch.py failed" >&2; exit 1; }
    done
done

# Peak RSS: one epoch of the MLP on Fashion-MNIST, 1 thread each.
TIMEF=/usr/bin/time
rss_run() { # impl, command...
    local impl=$1; shift
    if [[ -x $TIMEF ]]; then
        "$TIMEF" -f "%M" -o "$OUT/rss_$impl.time" "$@" | tee -a "$RES" >&2
        echo "rss_time impl=$impl maxrss_kb=$(tail -n 1 "$OUT/rss_$impl.time")" >> "$RES"
    else
        "$@" | tee -a "$RES" >&2
    fi
}
echo "# rss: dtrain epoch" >&2
OPENBLAS_NUM_THREADS=1 rss_run dtrain "$BIN" --rss-epoch --threads 1
echo "# rss: torch epoch" >&2
OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    rss_run torch "$PY" "$HERE/bench_torch.py" --rss-epoch --threads 1

# ---------------------------------------------------------------- table ---
awk -v threads="$THREADS" -v strict="$STRICT" '
function kv(line, key,    n, i, f, a) {
    n = split(line, f, " ")
    for (i = 1; i <= n; i++) { split(f[i], a, "="); if (a[1] == key) return a[2] }
    return ""
}
function verdict(ok) { if (!ok) miss++; return ok ? "PASS" : "MISS" }
# Keep the best (lowest) median per side, model and thread count.
$1 == "dtrain" || $1 == "torch" {
    impl = $1; kind = $2
    if (kind == "mlp" || kind == "cnn") {
        k = impl SUBSEP kind SUBSEP kv($0, "threads"); ms = kv($0, "ms") + 0
        if (!(k in best) || ms < best[k]) best[k] = ms
    } else if (kind == "matmul" && impl == "dtrain") {
        # keep the repeat whose raw sgemm ran fastest (the least disturbed
        # one); dtrain and sgemm rounds alternate inside it
        k = kv($0, "threads") SUBSEP kv($0, "shape")
        if (!(k in mmf) || kv($0, "blas_gflops") + 0 > mmb[k]) {
            mmf[k] = kv($0, "frac") + 0; mmd[k] = kv($0, "dtrain_gflops"); mmb[k] = kv($0, "blas_gflops")
        }
        if (!(kv($0, "shape") in seen)) { seen[kv($0, "shape")] = 1; shapes[++nsh] = kv($0, "shape") }
    }
}
$1 == "rss_epoch" { self[kv($0, "impl")] = kv($0, "maxrss_kb") + 0 }
$1 == "rss_time"  { timed[kv($0, "impl")] = kv($0, "maxrss_kb") + 0 }
END {
    nt = split(threads, T, " ")
    target["mlp"] = 0.80; target["cnn"] = 0.75
    printf "\n== training step (median ms/step, best of repeats) ==\n"
    printf "%-6s %7s %12s %12s %10s %8s %6s\n", "model", "threads", "dtrain_ms", "torch_ms", "dt/torch", "target", "result"
    split("mlp cnn", M, " ")
    for (mi = 1; mi <= 2; mi++) for (ti = 1; ti <= nt; ti++) {
        m = M[mi]; t = T[ti]
        d = best["dtrain", m, t]; p = best["torch", m, t]
        if (d == "" || p == "" || p <= 0) { printf "%-6s %7s   (missing result)\n", m, t; miss++; continue }
        r = d / p
        printf "%-6s %7s %12.3f %12.3f %10.3f %8s %6s\n", m, t, d, p, r, "<=" sprintf("%.2f", target[m]), verdict(r <= target[m] + 1e-9)
    }
    printf "\n== matmul: dt_matmul forward vs raw cblas_sgemm, same process (GFLOP/s) ==\n"
    printf "%-16s %7s %12s %12s %10s %8s %6s\n", "MxKxN", "threads", "dtrain", "sgemm", "fraction", "target", "result"
    for (si = 1; si <= nsh; si++) for (ti = 1; ti <= nt; ti++) {
        k = T[ti] SUBSEP shapes[si]
        if (!(k in mmf)) { printf "%-16s %7s   (missing result)\n", shapes[si], T[ti]; miss++; continue }
        printf "%-16s %7s %12.2f %12.2f %10.3f %8s %6s\n", shapes[si], T[ti], mmd[k], mmb[k], mmf[k], ">=0.90", verdict(mmf[k] >= 0.90)
    }
    printf "\n== peak RSS, one epoch MLP on Fashion-MNIST, batch 128, 1 thread ==\n"
    src = ("dtrain" in timed && "torch" in timed) ? "/usr/bin/time %M" : "getrusage"
    d = (src == "getrusage") ? self["dtrain"] : timed["dtrain"]
    p = (src == "getrusage") ? self["torch"] : timed["torch"]
    printf "%-22s %12s %12s %10s %8s %6s\n", "source", "dtrain_MB", "torch_MB", "dt/torch", "target", "result"
    if (d > 0 && p > 0)
        printf "%-22s %12.1f %12.1f %10.3f %8s %6s\n", src, d / 1024, p / 1024, d / p, "<=0.20", verdict(d / p <= 0.20)
    else { printf "  (missing result)\n"; miss++ }
    if ("dtrain" in self && "torch" in self && src != "getrusage")
        printf "%-22s %12.1f %12.1f %10.3f\n", "getrusage (in-process)", self["dtrain"] / 1024, self["torch"] / 1024, self["dtrain"] / self["torch"]
    printf "\n%d target(s) missed\n", miss
    exit (strict && miss) ? 1 : 0
}' "$RES"
