#!/usr/bin/env bash
# tests/bench/ps.sh - the parameter server next to its peers, in one run:
#   1. dense push rate and pull latency, 1 KiB .. 16 MiB, 1 worker + 1 server:
#      dtrain (bench_ps dense) vs torch.distributed Gloo send/recv with the
#      server applying SGD (bench_ps_gloo.py); then dtrain again in 4 KiB
#      pieces (DTRAIN_PS_CHUNK=4096: shm's setting when servers replicate or
#      checkpoint), the price of surviving a death on shm
#   2. sparse rows/s, 4096 distinct rows of a 2^20 x 16 table per request:
#      dtrain (bench_ps sparse) vs the same over Gloo (index_select / index_add_)
#   3. training throughput (samples/s summed over workers) of the benchmark
#      MLP, 2 workers + 1 server, BSP and ASP, with worker 1 at half speed
#      and without; target: ASP keeps >= 90% of its unslowed throughput
#   4. the sparse click model (examples/ps_sparse.c, 2^20-row table):
#      dtrain with 1 worker + 1 server vs the same model in PyTorch with
#      sparse embedding gradients (bench_sparse_torch.py), 1 thread, same data
# Each measurement runs REPEATS times, the two sides interleaved; medians.
# Environment: REPEATS=3, TORCH_PYTHON=/usr/bin/python3, CC=gcc.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=${TORCH_PYTHON:-/usr/bin/python3}
CC=${CC:-gcc}
REPEATS=${REPEATS:-3}
OUT="$HERE/build"
mkdir -p "$OUT"

./build.sh >/dev/null
$CC -std=c11 -O2 -Wall -Wextra -Werror -I. "$HERE/bench_ps.c" build/libdtrain.a \
    $(cat build/libdtrain.ldflags) -o "$OUT/bench_ps"
B="$OUT/bench_ps"
echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, $REPEATS repeats"

# field NAME of a "key=value ..." line
field() { sed -n "s/.*\b$1=\([0-9.e+-]*\).*/\1/p" | head -1; }
median() { sort -g | awk '{v[NR]=$1} END {print NR ? (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2) : "nan"}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'; }

echo
echo "## 1. dense push/pull, 1 worker + 1 server"
printf "%-10s %14s %14s %7s %12s %12s %7s %12s %7s %12s %7s\n" bytes dt_push/s gloo_push/s ratio \
    dt_pull_us gloo_pull_us ratio 4k_push/s ratio 4k_pull_us ratio
for bytes in 1024 4096 16384 65536 262144 1048576 4194304 16777216; do
    iters=$(( bytes >= 1048576 ? 40 : 400 ))
    : > "$OUT/d.txt"; : > "$OUT/g.txt"; : > "$OUT/p.txt"
    for r in $(seq "$REPEATS"); do
        "$B" dense --bytes $bytes --iters $iters >> "$OUT/d.txt"
        "$PY" "$HERE/bench_ps_gloo.py" --dense-bytes $bytes --iters $iters --sparse-iters 0 \
            | grep '^gloo_dense' >> "$OUT/g.txt"
        DTRAIN_PS_CHUNK=4096 "$B" dense --bytes $bytes --iters $iters >> "$OUT/p.txt"
    done
    dp=$(while read -r l; do echo "$l" | field pushes_per_s; done < "$OUT/d.txt" | median)
    gp=$(while read -r l; do echo "$l" | field pushes_per_s; done < "$OUT/g.txt" | median)
    pp=$(while read -r l; do echo "$l" | field pushes_per_s; done < "$OUT/p.txt" | median)
    dl=$(while read -r l; do echo "$l" | field pull_us; done < "$OUT/d.txt" | median)
    gl=$(while read -r l; do echo "$l" | field pull_us; done < "$OUT/g.txt" | median)
    pl=$(while read -r l; do echo "$l" | field pull_us; done < "$OUT/p.txt" | median)
    printf "%-10s %14.0f %14.0f %6sx %12.1f %12.1f %6sx %12.0f %6sx %12.1f %6sx\n" $bytes "$dp" "$gp" \
        "$(ratio "$dp" "$gp")" "$dl" "$gl" "$(ratio "$gl" "$dl")" "$pp" "$(ratio "$pp" "$gp")" \
        "$pl" "$(ratio "$gl" "$pl")"
done
echo "(push ratio: dtrain/gloo pushes per second; pull ratio: gloo latency / dtrain latency; >1 is dtrain faster;"
echo " 4k: dtrain in 4 KiB pieces, the shm setting of replicated or checkpointing servers, against the same gloo)"

echo
echo "## 2. sparse rows, 4096 distinct rows of a 1048576 x 16 table per request"
: > "$OUT/d.txt"; : > "$OUT/g.txt"
for r in $(seq "$REPEATS"); do
    "$B" sparse --iters 200 >> "$OUT/d.txt"
    "$PY" "$HERE/bench_ps_gloo.py" --dense-bytes 1024 --iters 1 --warmup 0 --sparse-iters 200 \
        | grep '^gloo_sparse' >> "$OUT/g.txt"
done
for k in pull_rows_per_s push_rows_per_s; do
    d=$(while read -r l; do echo "$l" | field $k; done < "$OUT/d.txt" | median)
    g=$(while read -r l; do echo "$l" | field $k; done < "$OUT/g.txt" | median)
    printf "%-16s dtrain %10.0f  gloo %10.0f  ratio %sx\n" $k "$d" "$g" "$(ratio "$d" "$g")"
done

echo
echo "## 3. training throughput with one worker at half speed (MLP, batch 64, 2 workers + 1 server)"
declare -A thr
for r in $(seq "$REPEATS"); do
    for mode in bsp asp; do
        for slow in -1 1; do
            t=$("$B" train --workers 2 --mode $mode --slow $slow --steps 150 |
                while read -r l; do echo "$l" | field samples_per_s; done | awk '{s+=$1} END {print s}')
            thr[$mode,$slow]="${thr[$mode,$slow]:-} $t"
        done
    done
done
verdict=ok
for mode in bsp asp; do
    a=$(echo ${thr[$mode,-1]} | tr ' ' '\n' | median)
    s=$(echo ${thr[$mode,1]} | tr ' ' '\n' | median)
    kept=$(ratio "$s" "$a")
    printf "%s: %8.0f samples/s, one worker at half speed %8.0f: keeps %s\n" $mode "$a" "$s" "$kept"
    if [ $mode = asp ] && ! awk -v k="$kept" 'BEGIN { exit !(k >= 0.9) }'; then verdict=MISSED; fi
done
echo "target: ASP keeps >= 0.90 of its throughput: $verdict"

echo
echo "## 4. sparse click model, 1M samples, 2^20 x 16 table: dtrain 1 worker + 1 server vs PyTorch"
DATA="$OUT/clicks.bin"
[ -f "$DATA" ] || build/ps_sparse --dump "$DATA" >/dev/null
: > "$OUT/d.txt"; : > "$OUT/g.txt"
for r in $(seq "$REPEATS"); do
    build/ps_sparse --ranks 2 --servers 1 | tee -a "$OUT/d_full.txt" |
        sed -n 's/.*trained [0-9]* samples in [0-9.]* s: \([0-9.]*\) samples\/s.*/\1/p' >> "$OUT/d.txt"
    "$PY" "$HERE/bench_sparse_torch.py" --data "$DATA" --threads 1 | tee -a "$OUT/g_full.txt" |
        sed -n 's/^torch_samples_per_s //p' >> "$OUT/g.txt"
done
d=$(median < "$OUT/d.txt"); g=$(median < "$OUT/g.txt")
da=$(grep '^test auc' "$OUT/d_full.txt" | tail -1); ga=$(grep '^torch test auc' "$OUT/g_full.txt" | tail -1)
rm -f "$OUT/d_full.txt" "$OUT/g_full.txt"
printf "dtrain %8.0f samples/s, PyTorch %8.0f samples/s: ratio %sx  (%s; %s)\n" "$d" "$g" \
    "$(ratio "$d" "$g")" "$da" "$ga"
# the same with prefetch: the next batch's rows and the weights pulled while this batch computes
: > "$OUT/d.txt"
for r in $(seq "$REPEATS"); do
    build/ps_sparse --ranks 2 --servers 1 --prefetch |
        sed -n 's/.*trained [0-9]* samples in [0-9.]* s: \([0-9.]*\) samples\/s.*/\1/p' >> "$OUT/d.txt"
done
d=$(median < "$OUT/d.txt")
printf "dtrain --prefetch %8.0f samples/s: ratio %sx to PyTorch\n" "$d" "$(ratio "$d" "$g")"
