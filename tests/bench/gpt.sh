#!/usr/bin/env bash
# tests/bench/gpt.sh - the GPT example (examples/gpt.c) next to PyTorch in one
# run: ms per training step and peak RSS, 2 threads each (OMP_WAIT_POLICY=PASSIVE
# for torch), the same model and batch shape, AdamW:
#   small:  nanoGPT's CPU config: 4 layers, 4 heads, 128 channels, context 64,
#           batch 12, 256-byte vocabulary
#   124M:   GPT-2 124M's shape: 12 layers, 12 heads, 768 channels, context 64,
#           batch 4, vocabulary 50257
# Targets (issue 22): dtrain/torch <= 0.8 for ms/step; peak RSS <= 0.5.
#
#   bash tests/bench/gpt.sh          (builds what it needs; REPEATS=3 runs a side)
#
# dtrain trains on Debian's fortunes text, torch on random byte windows: the
# same shapes, so the same arithmetic.  Medians over REPEATS runs; the sides
# alternate.  llm.c (../shared/peers/llm.c) is not measured here yet.  Last, the
# correctness cross-check against PyTorch (tests/gpt_crosscheck.py).
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
RES="$OUT/gpt_results.txt"
: > "$RES"
for cfg in small 124M; do
    for r in $(seq 1 "$REPEATS"); do
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
echo
echo "config  dtrain ms  torch ms  dt/torch (<=0.80)  dtrain MB  torch MB  dt/torch RSS (<=0.50)"
for cfg in small 124M; do
    awk -v c="$cfg" '
        function med(a, n,    i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
            if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t } return a[int((n + 1) / 2)] }
        $1 == c { split($3, m, "="); split($4, r, "=");
                  if ($2 == "dtrain") { dm[++nd] = m[2]; dr[nd] = r[2] } else { tm[++nt] = m[2]; tr[nt] = r[2] } }
        END { a = med(dm, nd); b = med(tm, nt); x = med(dr, nd); y = med(tr, nt);
              printf "%-6s  %9.2f  %8.2f  %17.3f  %9.1f  %8.1f  %21.3f\n", c, a, b, a / b,
                     x / 1024, y / 1024, x / y }' "$RES"
done
echo
echo "crosscheck against PyTorch (tests/gpt_crosscheck.py): the same weights and batches, 20 AdamW steps"
"$PY" tests/gpt_crosscheck.py build/gpt | tail -3
