#!/usr/bin/env bash
# tests/bench/gpt.sh - the GPT example (examples/gpt.c) next to PyTorch in one
# run: ms per training step and peak RSS, 2 threads each (OMP_WAIT_POLICY=PASSIVE
# for torch), the same model and batch shape, AdamW:
#   small:  nanoGPT's CPU config: 4 layers, 4 heads, 128 channels, context 64,
#           batch 12, 256-byte vocabulary
#   124M:   GPT-2 124M's shape: 12 layers, 12 heads, 768 channels, context 64,
#           batch 4, vocabulary 50257
# and llm.c's train_gpt2.c (../shared/peers/llm.c, compiled here with -Ofast
# -march=native -fopenmp from a copy in build/bench whose batch size and step
# count are set by sed; it reads dtrain's initial weights and the same text,
# converted by tests/bench/llmc_files.py; 2 OpenMP threads).
# The sgemm floor: bench_sgemm_floor.c runs one step's matrix products (each
# linear layer's forward, input and weight gradients, the tied head) with
# OpenBLAS alone on THREADS threads; 6 x parameters x tokens FLOPs at that
# rate is the least a step can take.
# Targets (issue 22): dtrain/torch <= 0.8 and dtrain/llm.c <= 0.4 for
# ms/step; peak RSS <= 0.5 of torch's; the 124M step <= 1.3x its sgemm floor.
#
#   bash tests/bench/gpt.sh          (builds what it needs; REPEATS=3 runs a side)
#
# dtrain trains on Debian's fortunes text, torch on random byte windows: the
# same shapes, so the same arithmetic.  Medians over REPEATS runs; the sides
# alternate (llm.c: LLMC_REPEATS=1 run, its 124M steps take seconds each).
# Then the wall-clock race on the small config: each side trains on the
# fortunes text for BUDGET seconds (default 300; 0 skips it) and reports the
# validation loss over the same first EVAL_BATCHES (100) batches of the
# held-out 10%.
# Last, the correctness cross-check against PyTorch (tests/gpt_crosscheck.py).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT" || exit 1
REPEATS=${REPEATS:-3}
THREADS=${THREADS:-2}
PY=${TORCH_PYTHON:-/usr/bin/python3}
OUT=${OUT:-$ROOT/build/bench}
mkdir -p "$OUT"
[[ -x build/gpt ]] || ./build.sh build > /dev/null || exit 1
TIMEF=/usr/bin/time
[[ -x $TIMEF ]] || { echo "gpt.sh: needs /usr/bin/time (apt-get install time)"; exit 1; }

declare -A ARGS=([small]="--layers 4 --heads 4 --embd 128 --context 64 --batch 12 --vocab 256"
                 [124M]="--layers 12 --heads 12 --embd 768 --context 64 --batch 4 --vocab 50257")
declare -A STEPS=([small]=60 [124M]=15)
declare -A LAYOUT=([small]="4 4 64" [124M]="12 12 64")   # llm.c's layers, heads, max T
declare -A BATCH=([small]=12 [124M]=4)
declare -A FLOOR_ARGS=([small]="4 128 256 768" [124M]="12 768 50257 256")   # layers embd vocab tokens
LLMC=${LLMC:-$ROOT/../shared/peers/llm.c}
LLMC_REPEATS=${LLMC_REPEATS:-1}
RES="$OUT/gpt_results.txt"
: > "$RES"
gcc -O2 "$HERE/bench_sgemm_floor.c" -lopenblas -o "$OUT/bench_sgemm_floor" ||
    { echo "gpt.sh: bench_sgemm_floor did not build"; exit 1; }
for cfg in small 124M; do
    for r in $(seq 1 "$REPEATS"); do
        # shellcheck disable=SC2086
        line=$("$OUT/bench_sgemm_floor" ${FLOOR_ARGS[$cfg]} "$THREADS")
        echo "$cfg floor ms=$(echo "$line" | sed -n 's/.*floor_ms=\([0-9.]*\).*/\1/p') rss_kb=0 $line" |
            tee -a "$RES"
        s=${STEPS[$cfg]}
        # shellcheck disable=SC2086
        line=$(OPENBLAS_NUM_THREADS=1 "$TIMEF" -f "rss %M" -o "$OUT/gpt_dt.time" build/gpt \
               ${ARGS[$cfg]} --steps "$s" --eval-every "$s" --eval-batches 1 --sample 0 \
               --threads "$THREADS" | grep "^step $s:")
        ms=$(echo "$line" | sed -n 's/.* \([0-9.]*\) ms\/step$/\1/p')
        echo "$cfg dtrain ms=$ms rss_kb=$(sed -n 's/^rss //p' "$OUT/gpt_dt.time")" | tee -a "$RES"
        # shellcheck disable=SC2086
        line=$(OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS \
               "$PY" "$HERE/bench_gpt_torch.py" ${ARGS[$cfg]} --steps "$s" --threads "$THREADS" |
               grep "^gpt impl=torch")
        echo "$cfg torch ms=$(echo "$line" | sed -n 's/.* ms=\([0-9.]*\).*/\1/p') rss_kb=$(
              echo "$line" | sed -n 's/.*maxrss_kb=\([0-9]*\).*/\1/p')" | tee -a "$RES"
    done
done
# llm.c: its files from dtrain's initial weights, then its own timing of each step
if [[ -f $LLMC/train_gpt2.c ]]; then
    sed -e 's/int B = 4;/int B = LLMC_B;/' -e 's/step <= 40/step <= LLMC_STEPS/' \
        "$LLMC/train_gpt2.c" > "$OUT/train_gpt2_bench.c"
    for cfg in small 124M; do
        s=${STEPS[$cfg]}
        gcc -Ofast -march=native -fopenmp -DLLMC_B="${BATCH[$cfg]}" -DLLMC_STEPS="$s" -I"$LLMC" \
            "$OUT/train_gpt2_bench.c" -lm -o "$OUT/llmc_$cfg" || { echo "gpt.sh: llm.c did not build"; exit 1; }
        rm -rf "$OUT/llmc_$cfg.d"
        # shellcheck disable=SC2086
        build/gpt ${ARGS[$cfg]} --steps 1 --eval-every 1 --eval-batches 1 --sample 0 \
            --save-init "$OUT/llmc_init.st" > /dev/null &&
            "$PY" "$HERE/llmc_files.py" "$OUT/llmc_init.st" /usr/share/games/fortunes \
                "$OUT/llmc_$cfg.d" ${LAYOUT[$cfg]} || { echo "gpt.sh: llm.c's files failed"; exit 1; }
        for r in $(seq 1 "$LLMC_REPEATS"); do
            ms=$(cd "$OUT/llmc_$cfg.d" && OMP_NUM_THREADS=$THREADS "$OUT/llmc_$cfg" |
                 sed -n 's/^step \([0-9]*\): .*(took \([0-9.]*\) ms)$/\1 \2/p' |
                 awk '$1 >= 5 { t += $2; n++ } END { if (n) printf "%.2f", t / n }')
            echo "$cfg llmc ms=$ms rss_kb=0" | tee -a "$RES"
        done
    done
else
    echo "gpt.sh: no llm.c at $LLMC: its column stays empty"
fi
echo
echo "config  dtrain ms  torch ms  dt/torch (<=0.80)  dtrain MB  torch MB  dt/torch RSS (<=0.50)  floor ms  dt/floor (124M <=1.3)  llm.c ms  dt/llm.c (<=0.40)"
for cfg in small 124M; do
    awk -v c="$cfg" '
        function med(a, n,    i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
            if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t } return a[int((n + 1) / 2)] }
        $1 == c { split($3, m, "="); split($4, r, "=");
                  if ($2 == "dtrain") { dm[++nd] = m[2]; dr[nd] = r[2] }
                  else if ($2 == "torch") { tm[++nt] = m[2]; tr[nt] = r[2] }
                  else if ($2 == "floor") fm[++nf] = m[2]
                  else if (m[2] != "") lm[++nl] = m[2] }
        END { a = med(dm, nd); b = med(tm, nt); x = med(dr, nd); y = med(tr, nt);
              f = med(fm, nf)
              printf "%-6s  %9.2f  %8.2f  %17.3f  %9.1f  %8.1f  %21.3f  %8.2f  %20.3f", c, a, b,
                     a / b, x / 1024, y / 1024, x / y, f, a / f
              if (nl) { l = med(lm, nl); printf "  %8.2f  %17.3f\n", l, a / l } else printf "\n" }' "$RES"
done
BUDGET=${BUDGET:-300}
EVAL_BATCHES=${EVAL_BATCHES:-100}
if [[ $BUDGET != 0 ]]; then
    echo
    echo "the same wall-clock budget: small config, $BUDGET s of training each, val loss over $EVAL_BATCHES batches"
    # shellcheck disable=SC2086
    dl=$(OPENBLAS_NUM_THREADS=1 build/gpt ${ARGS[small]} --steps 100000000 --eval-every 100000000 \
         --eval-batches "$EVAL_BATCHES" --sample 0 --threads "$THREADS" --seconds "$BUDGET" |
         grep "^budget:")
    # shellcheck disable=SC2086
    tl=$(OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS \
         "$PY" "$HERE/bench_gpt_torch.py" ${ARGS[small]} --threads "$THREADS" --seconds "$BUDGET" \
         --eval-batches "$EVAL_BATCHES" | grep "budget")
    echo "dtrain: $dl"
    echo "torch:  $tl"
    dv=$(echo "$dl" | sed -n 's/.*val loss \([0-9.]*\) over.*/\1/p')
    tv=$(echo "$tl" | sed -n 's/.*val_loss=\([0-9.]*\).*/\1/p')
    ds=$(echo "$dl" | sed -n 's/^budget: \([0-9]*\) steps.*/\1/p')
    ts=$(echo "$tl" | sed -n 's/.*steps=\([0-9]*\).*/\1/p')
    awk -v dv="$dv" -v tv="$tv" -v ds="$ds" -v ts="$ts" 'BEGIN {
        printf "steps in the budget: dtrain %d, torch %d (%.2fx); val loss: dtrain %.4f, torch %.4f (%+.4f)\n",
               ds, ts, ds / ts, dv, tv, dv - tv }'
fi
echo
echo "crosscheck against PyTorch (tests/gpt_crosscheck.py): the same weights and batches, 20 AdamW steps"
"$PY" tests/gpt_crosscheck.py build/gpt | tail -3
echo "and bf16 parameters with f32 masters against torch.autocast(bfloat16)"
"$PY" tests/gpt_crosscheck.py build/gpt --bf16 | tail -1
