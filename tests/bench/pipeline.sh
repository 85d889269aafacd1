#!/usr/bin/env bash
# tests/bench/pipeline.sh - pipeline parallelism (issue 9): a deep MLP
# (8 linear layers of 512 and a 10-way head, batch 512) split into 2 stages on 2 local ranks,
# 1F1B with 1, 2, 4 and 8 micro-batches and GPipe with 8, against the
# unsplit model on one rank, measured in the same run:
#   - throughput: pipeline samples/s over the unsplit model's, and the ideal
#     p*m/(m+p-1) (perfectly balanced stages, free messages); and that ideal
#     times what micro-batches cost by themselves here (the unsplit model's
#     samples/s at B/m rows over at B rows: small GEMMs run slower);
#   - the bubble: the share of a step a stage waits for its neighbour,
#     measured (mean of the 2 stages), next to the ideal (p-1)/(m+p-1);
#   - activation memory on stage 0: 1F1B holds at most 2 micro-batches,
#     GPipe all 8.
#
#   bash tests/bench/pipeline.sh      (from any cwd; about 3 minutes)
#
# Knobs: REPEATS=3 (passes; each runs every configuration once, medians of
# the per-pass ratios), STEPS=20, LAYERS=9, WIDTH=512, BATCH=512.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-20}
LAYERS=${LAYERS:-9}
WIDTH=${WIDTH:-512}
BATCH=${BATCH:-512}
OUT="$HERE/build/pipe"
mkdir -p "$OUT"

timeout 300 ./build.sh >&2 || { echo "pipeline.sh: ./build.sh failed" >&2; exit 1; }
BIN="$OUT/bench_pipeline"
gcc -std=c11 -O2 -Wall -Wextra -Werror -I"$ROOT" "$HERE/bench_pipeline.c" "$ROOT/build/libdtrain.a" \
    $(cat "$ROOT/build/libdtrain.ldflags") -o "$BIN" ||
    { echo "pipeline.sh: building bench_pipeline failed" >&2; exit 1; }

export OPENBLAS_NUM_THREADS=1
COMMON="--layers $LAYERS --width $WIDTH --steps $STEPS"
RES="$OUT/results.txt"
: > "$RES"
for pass in $(seq 1 "$REPEATS"); do
    echo "pass $pass of $REPEATS" >&2
    echo "$pass unsplit $("$BIN" --ranks 1 --batch "$BATCH" $COMMON)" >> "$RES"
    for m in 2 4 8; do
        echo "$pass unsplit_mb$m $("$BIN" --ranks 1 --batch $((BATCH / m)) $COMMON)" >> "$RES"
    done
    for m in 1 2 4 8; do
        echo "$pass 1f1b_m$m $("$BIN" --ranks 2 --micro "$m" --batch "$BATCH" $COMMON)" >> "$RES"
    done
    echo "$pass gpipe_m8 $("$BIN" --ranks 2 --micro 8 --schedule gpipe --batch "$BATCH" $COMMON)" >> "$RES"
done

# field of configuration $2 in pass $1
get() { awk -v p="$1" -v k="$2" -v f="$3" '$1 == p && $2 == k {
    for (i = 3; i <= NF; i++) { split($i, kv, "="); if (kv[1] == f) print kv[2] } }' "$RES"; }
medof() { sort -g | awk '{ v[NR] = $1 } END { printf "%.3f", (NR ? v[int((NR + 1) / 2)] : 0) }'; }

echo
echo "pipeline: $LAYERS-layer MLP (width $WIDTH, the last a 10-way head), batch $BATCH, 2 stages on 2 ranks (1 thread each), $STEPS steps,"
echo "medians over $REPEATS passes of per-pass ratios; split by dt_profile_layer_times + dt_pipe_partition:"
echo "  split $(get 1 1f1b_m4 split)"
printf "\n| schedule | micro-batches | bubble, ideal | bubble, measured | samples/s | unsplit samples/s | speed-up | ideal speed-up | ideal x micro-batch cost | stage 0 held | stage 0 act. KiB |\n"
printf "|---|---|---|---|---|---|---|---|---|---|---|\n"
for cfg in 1f1b_m1 1f1b_m2 1f1b_m4 1f1b_m8 gpipe_m8; do
    m=${cfg##*_m}
    sp=""; bub=""; ps=""; us=""; eff=""
    for p in $(seq 1 "$REPEATS"); do
        a=$(get "$p" "$cfg" samples_per_s); b=$(get "$p" unsplit samples_per_s)
        c=$([ "$m" = 1 ] && echo "$b" || get "$p" "unsplit_mb$m" samples_per_s)
        sp="$sp $(awk -v a="$a" -v b="$b" 'BEGIN { print (b > 0 ? a / b : 0) }')"
        eff="$eff $(awk -v c="$c" -v b="$b" 'BEGIN { print (b > 0 ? c / b : 0) }')"
        bub="$bub $(get "$p" "$cfg" bubble)"; ps="$ps $a"; us="$us $b"
    done
    ideal=$(awk -v m="$m" 'BEGIN { printf "%.3f", 2 * m / (m + 1) }')
    ib=$(awk -v m="$m" 'BEGIN { printf "%.3f", 1 / (m + 1) }')
    e=$(echo $eff | tr ' ' '\n' | medof)
    printf "| %s | %s | %s | %s | %.0f | %.0f | %sx | %sx | %sx | %s | %s |\n" \
        "$(echo "$cfg" | cut -d_ -f1 | sed 's/1f1b/1F1B/;s/gpipe/GPipe/')" "$m" "$ib" \
        "$(echo $bub | tr ' ' '\n' | medof)" "$(echo $ps | tr ' ' '\n' | medof)" \
        "$(echo $us | tr ' ' '\n' | medof)" "$(echo $sp | tr ' ' '\n' | medof)" "$ideal" \
        "$(awk -v i="$ideal" -v e="$e" 'BEGIN { printf "%.3f", i * e }')" \
        "$(get 1 "$cfg" held0)" "$(get 1 "$cfg" act_kb0)"
done
echo
echo "raw lines: $RES"
