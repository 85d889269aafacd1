#!/usr/bin/env bash
# tests/bench/allreduce.sh - dtrain's allreduce vs OpenMPI and Gloo, 2 ranks
# on this host: bus bandwidth per size over shared memory and over tcp
# (loopback), 4 KiB latency, and the fraction of single-thread memcpy
# bandwidth dtrain's shm allreduce reaches at 64 MiB.
#
#   bash tests/bench/allreduce.sh        (from any cwd; about 2-3 minutes)
#
# Runs, each REPEATS times (interleaved, the best median per size kept):
#   dtrain  bench_allreduce       DTRAIN_TRANSPORT=shm, and tcp on 127.0.0.1
#   OpenMPI bench_allreduce_mpi   mpirun --mca btl self,vader, and self,tcp on lo
#   Gloo    bench_allreduce_gloo.py (torch.distributed, tcp on 127.0.0.1)
#   sockets bench_tcp_floor       plain TCP sockets on loopback, no library:
#                                 how much of a tcp allreduce is the kernel
# Every number is printed next to the peer's from the same run, with the
# ratio; absolute numbers alone mean little on a shared 2-core VM.
#
# Environment knobs:
#   REPEATS=3        passes over all runs
#   MIN_TIME=0.5     seconds timed per size and run
#   TORCH_PYTHON=/usr/bin/python3   interpreter that has python3-torch
#   CC=gcc, MPICC=mpicc
#   STRICT=1         exit 1 when a target is missed (a failed run or a wrong
#                    result always exits 1)
#   QUIET_WAIT=10    seconds to wait for other CPU load to settle first
# Needs: openmpi-bin libopenmpi-dev (apt-get install -y openmpi-bin
# libopenmpi-dev) and python3-torch; a missing one is reported and its
# columns print as n/a.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"

CC=${CC:-gcc}
MPICC=${MPICC:-mpicc}
PY=${TORCH_PYTHON:-/usr/bin/python3}
REPEATS=${REPEATS:-3}
MIN_TIME=${MIN_TIME:-0.5}
STRICT=${STRICT:-0}
QUIET_WAIT=${QUIET_WAIT:-10}
OUT="$HERE/build/allreduce"
mkdir -p "$OUT"
LIBS="-lopenblas -lfabric -lz -lm -lpthread"
LIBA="$ROOT/build/libdtrain.a"
# a library built with the CUDA backend needs its libraries too (build.sh writes them)
[[ -f "$ROOT/build/libdtrain.ldflags" ]] && LIBS=$(cat "$ROOT/build/libdtrain.ldflags")
FAILED=0
fail() { echo "allreduce.sh: $*" >&2; FAILED=1; }

# ---------------------------------------------------------------- build ---
stale=0
[[ -f $LIBA ]] || stale=1
for f in dtrain.c dtrain.h backends/*.c backends/*.h build.sh; do
    [[ -f $f && $f -nt $LIBA ]] && stale=1
done
if ((stale)); then
    echo "# build: build/libdtrain.a missing or older than the sources: ./build.sh" >&2
    timeout 300 ./build.sh >&2 || { echo "allreduce.sh: ./build.sh failed" >&2; exit 1; }
fi
BIN_DT="$OUT/bench_allreduce"
BIN_MPI="$OUT/bench_allreduce_mpi"
timeout 120 $CC -std=c11 -D_GNU_SOURCE -O2 -march=native -Wall -Wextra -Werror -I"$ROOT" \
    "$HERE/bench_allreduce.c" "$LIBA" $LIBS -o "$BIN_DT" ||
    { echo "allreduce.sh: building bench_allreduce failed" >&2; exit 1; }
BIN_RAW="$OUT/bench_tcp_floor"
timeout 120 $CC -std=c11 -D_GNU_SOURCE -O2 -march=native -Wall -Wextra -Werror \
    "$HERE/bench_tcp_floor.c" -o "$BIN_RAW" ||
    { echo "allreduce.sh: building bench_tcp_floor failed" >&2; exit 1; }
HAVE_MPI=1
if ! command -v "$MPICC" >/dev/null || ! command -v mpirun >/dev/null; then
    fail "no $MPICC/mpirun (apt-get install -y openmpi-bin libopenmpi-dev): MPI columns n/a"
    HAVE_MPI=0
elif ! timeout 120 "$MPICC" -std=c11 -O2 -march=native -Wall -Wextra -Werror \
        "$HERE/bench_allreduce_mpi.c" -o "$BIN_MPI"; then
    fail "building bench_allreduce_mpi failed: MPI columns n/a"
    HAVE_MPI=0
fi
HAVE_GLOO=1
if ! timeout 60 "$PY" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    fail "$PY has no torch with gloo: Gloo columns n/a"
    HAVE_GLOO=0
fi

# ------------------------------------------------------------------ run ---
busy_pct() {
    local a b
    a=$(head -n 1 /proc/stat); sleep 1; b=$(head -n 1 /proc/stat)
    echo "$a" "$b" | awk '{
        n = (NF - 2) / 2
        for (i = 2; i <= n + 1; i++) { t0 += $i; t1 += $(i + n + 1) }
        idle0 = $5 + $6; idle1 = $(5 + n + 1) + $(6 + n + 1)
        b = (t1 - t0) > 0 ? 100 * (1 - (idle1 - idle0) / (t1 - t0)) : 0
        printf "%.0f\n", b
    }'
}
# Other work on this (small) machine skews everything: before each pass,
# wait up to QUIET_WAIT seconds for the CPUs to calm down, and warn if not.
busy_note() {
    local b waited=0
    b=$(busy_pct)
    while ((b > 15 && waited < QUIET_WAIT)); do b=$(busy_pct); waited=$((waited + 1)); done
    echo "# other load ($1): ${b}% of all CPUs busy$( ((waited)) && echo " (waited ${waited}s)")" >&2
    ((b <= 15)) || echo "# WARNING: the machine is busy; the ratios below are noisy (REPEATS keeps the best)" >&2
    return 0
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset DTRAIN_RANK DTRAIN_WORLD_SIZE DTRAIN_MASTER RANK WORLD_SIZE OMPI_COMM_WORLD_RANK SLURM_PROCID
RES="$OUT/results.txt"
: > "$RES"
# run NAME TIMEOUT COMMAND...: tag its data lines with NAME into $RES
run() {
    local name=$1 lim=$2; shift 2
    echo "# $name (repeat $rep/$REPEATS)" >&2
    local log="$OUT/$name.$rep.log"
    timeout -k 5 "$lim" "$@" > "$log" 2> "$log.err"
    local rc=$?
    sed 's/^/    /' "$log" >&2
    awk -v n="$name" '$1 ~ /^[0-9]+$/ { print n, $0 } $2 == "memcpy_64MiB_GBps" { print "memcpy", $3 }' "$log" >> "$RES"
    if ((rc != 0)); then
        fail "$name failed (exit $rc$( ((rc == 124)) && echo ", timed out after ${lim}s")); stderr:"
        sed 's/^/    /' "$log.err" | tail -n 20 >&2
    fi
}
# every peer binds each rank to its own CPU: dt_spawn does by default, mpirun
# does by default for 2 ranks, and bench_allreduce_gloo.py does it itself
MPIRUN=(mpirun --allow-run-as-root --bind-to core -np 2)
for rep in $(seq 1 "$REPEATS"); do
    busy_note "before pass $rep/$REPEATS"
    # the default on one host: collectives through the host segment
    run dtrain_shm 60 env DTRAIN_TRANSPORT=shm "$BIN_DT" --min-time "$MIN_TIME"
    # for reference: the same over libfabric's shm provider alone
    run dtrain_fab 60 env DTRAIN_TRANSPORT=shm DTRAIN_INTRA_HOST=transport "$BIN_DT" --no-memcpy \
        --min-time "$MIN_TIME"
    ((HAVE_MPI)) && run mpi_vader 60 "${MPIRUN[@]}" --mca btl self,vader "$BIN_MPI" \
        --min-time "$MIN_TIME" --label "btl=vader"
    run dtrain_tcp 60 env DTRAIN_TRANSPORT=tcp DTRAIN_INTRA_HOST=transport DTRAIN_HOST=127.0.0.1 "$BIN_DT" --no-memcpy \
        --min-time "$MIN_TIME"
    ((HAVE_MPI)) && run mpi_tcp 60 "${MPIRUN[@]}" --mca btl self,tcp --mca btl_tcp_if_include lo \
        "$BIN_MPI" --min-time "$MIN_TIME" --label "btl=tcp(lo)"
    run sockets_tcp 60 "$BIN_RAW" --min-time "$MIN_TIME"
    ((HAVE_GLOO)) && run gloo 120 "$PY" "$HERE/bench_allreduce_gloo.py" --min-time "$MIN_TIME"
done
grep -q ' FAIL$' "$RES" && fail "a result was wrong (a 'FAIL' check above)"

# ---------------------------------------------------------------- table ---
awk -v strict="$STRICT" -v failed="$FAILED" '
function verdict(ok) { if (!ok) miss++; return ok ? "PASS" : "MISS" }
function bw(k)  { return (k in best) ? sprintf("%8.3f", best[k]) : sprintf("%8s", "n/a") }
function rat(a, b) { return (a in best && b in best && best[b] > 0) ? sprintf("%7.2fx", best[a] / best[b]) : sprintf("%8s", "n/a") }
function hsize(b) { return b >= 1048576 ? (b / 1048576) " MiB" : (b / 1024) " KiB" }
$1 == "memcpy" { if ($2 + 0 > mem) mem = $2 + 0; next }
{
    k = $1 SUBSEP $2
    if ($6 == "ok" && (!(k in best) || $5 + 0 > best[k])) { best[k] = $5 + 0; lat[k] = $4 + 0 }
    if (!($2 in seen)) { seen[$2] = 1; sz[++ns] = $2 + 0 }
}
END {
    for (i = 1; i <= ns; i++) for (j = i + 1; j <= ns; j++) if (sz[j] < sz[i]) { t = sz[i]; sz[i] = sz[j]; sz[j] = t }
    printf "\n== allreduce(sum, float32), 2 ranks: bus bandwidth GB/s (best median of the repeats) ==\n"
    printf "(dtrain shm: the host segment, the default on one host; fabric: libfabric shm alone, DTRAIN_INTRA_HOST=transport)\n"
    printf "(sockets: plain TCP sockets on loopback with no library, for reference)\n"
    printf "%-8s | %8s %8s %8s %8s %8s %8s | %8s %8s %8s %8s %8s\n", "", "dtrain", "dtrain", "MPI", "dt/MPI", "Gloo", "dt/Gloo", "dtrain", "MPI", "dt/MPI", "dt/Gloo", "sockets"
    printf "%-8s | %8s %8s %8s %8s %8s %8s | %8s %8s %8s %8s %8s\n", "size", "shm", "fabric", "vader", "shm", "tcp", "shm", "tcp", "tcp", "tcp", "tcp", "tcp"
    for (i = 1; i <= ns; i++) {
        s = sz[i]
        printf "%-8s | %s %s %s %s %s %s | %s %s %s %s %s\n", hsize(s),
            bw("dtrain_shm" SUBSEP s), bw("dtrain_fab" SUBSEP s), bw("mpi_vader" SUBSEP s), rat("dtrain_shm" SUBSEP s, "mpi_vader" SUBSEP s),
            bw("gloo" SUBSEP s), rat("dtrain_shm" SUBSEP s, "gloo" SUBSEP s),
            bw("dtrain_tcp" SUBSEP s), bw("mpi_tcp" SUBSEP s), rat("dtrain_tcp" SUBSEP s, "mpi_tcp" SUBSEP s),
            rat("dtrain_tcp" SUBSEP s, "gloo" SUBSEP s), bw("sockets_tcp" SUBSEP s)
    }
    printf "\n== latency at 4 KiB (median us per call) ==\n"
    split("shm vader tcp tcp", L, " ")
    for (j = 1; j <= 3; j += 2) {
        d = "dtrain_" L[j] SUBSEP 4096; m = "mpi_" L[j + 1] SUBSEP 4096
        if ((d in lat) && (m in lat) && lat[m] > 0)
            printf "%-4s dtrain %9.2f us   MPI(%s) %9.2f us   dtrain/MPI %6.2fx\n", L[j], lat[d], L[j + 1], lat[m], lat[d] / lat[m]
        else
            printf "%-4s (missing result)\n", L[j]
    }
    g = "gloo" SUBSEP 4096
    if (g in lat) printf "Gloo (tcp) %9.2f us\n", lat[g]

    k = "dtrain_shm" SUBSEP 67108864
    printf "\n== dtrain shm at 64 MiB vs single-thread memcpy of 64 MiB ==\n"
    if (mem > 0 && (k in best))
        printf "memcpy %.3f GB/s, dtrain shm busbw %.3f GB/s: %.1f%% of memcpy\n", mem, best[k], 100 * best[k] / mem
    else
        printf "(missing result)\n"

    printf "\n== targets (ratios against the peer measured in the same run) ==\n"
    a = "dtrain_shm" SUBSEP 67108864; b = "mpi_vader" SUBSEP 67108864
    if ((a in best) && (b in best)) printf "%-52s %6.2fx  %s\n", "shm 64 MiB: dtrain >= 1.5x MPI busbw", best[a] / best[b], verdict(best[a] / best[b] >= 1.5)
    else { printf "%-52s %7s  MISS\n", "shm 64 MiB: dtrain >= 1.5x MPI busbw", "n/a"; miss++ }
    a = "dtrain_shm" SUBSEP 1048576; b = "mpi_vader" SUBSEP 1048576
    if ((a in best) && (b in best)) printf "%-52s %6.2fx  %s\n", "shm 1 MiB: dtrain >= 1.0x MPI busbw", best[a] / best[b], verdict(best[a] / best[b] >= 1.0)
    else { printf "%-52s %7s  MISS\n", "shm 1 MiB: dtrain >= 1.0x MPI busbw", "n/a"; miss++ }
    worst = ""; ws = 0; okall = 1
    for (i = 1; i <= ns; i++) {
        a = "dtrain_shm" SUBSEP sz[i]; b = "gloo" SUBSEP sz[i]
        if (!(a in best) || !(b in best) || best[b] <= 0) { okall = 0; worst = "n/a"; continue }
        r = best[a] / best[b]
        if (worst == "" || (worst != "n/a" && r < worst)) { worst = r; ws = sz[i] }
    }
    if (worst != "" && worst != "n/a" && okall)
        printf "%-52s %6.2fx  %s\n", "shm every size: dtrain >= 5x Gloo busbw (worst: " hsize(ws) ")", worst, verdict(worst >= 5)
    else { printf "%-52s %7s  MISS\n", "shm every size: dtrain >= 5x Gloo busbw", "n/a"; miss++ }
    a = "dtrain_shm" SUBSEP 4096; b = "mpi_vader" SUBSEP 4096
    if ((a in lat) && (b in lat) && lat[b] > 0) printf "%-52s %6.2fx  %s\n", "shm 4 KiB latency: dtrain <= 2x MPI", lat[a] / lat[b], verdict(lat[a] / lat[b] <= 2)
    else { printf "%-52s %7s  MISS\n", "shm 4 KiB latency: dtrain <= 2x MPI", "n/a"; miss++ }
    worst = ""; okall = 1
    for (i = 1; i <= ns; i++) {
        if (sz[i] < 1048576) continue
        a = "dtrain_tcp" SUBSEP sz[i]; b = "mpi_tcp" SUBSEP sz[i]
        if (!(a in best) || !(b in best) || best[b] <= 0) { okall = 0; continue }
        r = best[a] / best[b]
        if (worst == "" || r < worst) { worst = r; ws = sz[i] }
    }
    if (worst != "" && okall)
        printf "%-52s %6.2fx  %s\n", "tcp >= 1 MiB: dtrain >= 1.2x MPI busbw (worst: " hsize(ws) ")", worst, verdict(worst >= 1.2)
    else { printf "%-52s %7s  MISS\n", "tcp >= 1 MiB: dtrain >= 1.2x MPI busbw", "n/a"; miss++ }
    printf "\n%d target(s) missed%s\n", miss, failed ? "; some runs FAILED (see above)" : ""
    exit (failed || (strict && miss)) ? 1 : 0
}' "$RES"
rc=$?
echo "# raw results: $RES; logs: $OUT/*.log" >&2
exit $rc
