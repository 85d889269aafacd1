#!/usr/bin/env bash
# tests/bench/zero.sh - sharded data parallelism (dt_ddp_config.zero) against
# PyTorch DDP and DDP + ZeroRedundancyOptimizer, in the same run, on GPT-2
# 124M's shape (tests/bench/gpt.sh's: 12 layers, 12 heads, 768 channels,
# vocabulary 50257, context 64, batch 4 a rank), AdamW, N ranks x 1 thread.
#
# Memory is each rank's peak proportional set size (tests/bench/pss_peak.py:
# /proc/PID/smaps_rollup every 0.1 s; a segment the ranks share counts once
# across them).  Step time is the mean after the warm-up steps.
#
#   bash tests/bench/zero.sh            (RANKS=2 STEPS=8; ./build.sh first)
#
# LEVELS (default "0 1 2 3") are run as they are; RECOMPUTE (default "3")
# also with every block recomputed in backward (examples/gpt --recompute 1);
# HALF (default "3") with bf16 parameters (f32 masters, sharded) and bf16
# moments (--params bf16 --moments bf16), without and with recompute.
#
# Prints one table; the ratios are against PyTorch DDP + ZeroRedundancyOptimizer.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=${RANKS:-2}
STEPS=${STEPS:-8}
LEVELS=${LEVELS:-"0 1 2 3"}
RECOMPUTE=${RECOMPUTE:-"3"}   # levels also run with every block recomputed (--recompute 1)
HALF=${HALF:-"3"}             # levels also run with bf16 parameters and moments
SHAPE="--layers 12 --heads 12 --embd 768 --context 64 --batch 4 --vocab 50257"
PY=/usr/bin/python3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ -x build/gpt ] || { echo "zero.sh: build/gpt missing: run ./build.sh"; exit 1; }

# dtrain: eval at the last step only, no sample; the ms/step it reports is
# the training steps' (from step 6 on)
dt_run() {   # LOG ZERO RECOMPUTE [more flags]
    OPENBLAS_NUM_THREADS=1 $PY tests/bench/pss_peak.py -- build/gpt --ranks "$RANKS" --threads 1 \
        --zero "$2" --recompute "$3" $SHAPE --steps "$STEPS" --eval-every "$STEPS" --eval-batches 1 \
        --sample 0 "${@:4}" > "$out/$1.log" 2>&1 || { cat "$out/$1.log"; exit 1; }
}
for z in $LEVELS; do dt_run "dt$z" "$z" 0; done
for z in $RECOMPUTE; do dt_run "dtr$z" "$z" 1; done
for z in $HALF; do
    dt_run "dth$z" "$z" 0 --params bf16 --moments bf16
    dt_run "dthr$z" "$z" 1 --params bf16 --moments bf16
done
for z in 0 1; do
    OMP_NUM_THREADS=1 $PY tests/bench/pss_peak.py -- $PY tests/bench/bench_zero_torch.py \
        --ranks "$RANKS" --zero "$z" $SHAPE --steps "$STEPS" --threads 1 \
        --port $((29600 + RANDOM % 300)) > "$out/torch$z.log" 2>&1 || { cat "$out/torch$z.log"; exit 1; }
done
grep -h "^# torch" "$out/torch0.log" || true

field() { sed -n "s/.*$2=\([0-9.]*\).*/\1/p" "$1" | tail -1; }
dt_ms() { sed -n 's/.*, \([0-9.]*\) ms\/step$/\1/p' "$1" | tail -1; }
t_ms=$(field "$out/torch1.log" ms)
t_mib=$(field "$out/torch1.log" max_mib)
printf '%-36s %9s %11s %14s %14s\n' "run ($RANKS ranks x 1 thread)" "ms/step" "peak PSS MiB" "ms / torch Z1" "PSS / torch Z1"
row() {   # name ms mib
    printf '%-36s %9s %11s %14s %14s\n' "$1" "$2" "$3" \
        "$(awk -v a="$2" -v b="$t_ms" 'BEGIN { printf "%.3f", a / b }')" \
        "$(awk -v a="$3" -v b="$t_mib" 'BEGIN { printf "%.3f", a / b }')"
}
row "torch DDP" "$(field "$out/torch0.log" ms)" "$(field "$out/torch0.log" max_mib)"
row "torch DDP + ZeroRedundancyOpt" "$t_ms" "$t_mib"
for z in $LEVELS; do
    row "dtrain DDP zero $z" "$(dt_ms "$out/dt$z.log")" "$(field "$out/dt$z.log" max_mib)"
done
for z in $RECOMPUTE; do
    row "dtrain zero $z + recompute" "$(dt_ms "$out/dtr$z.log")" "$(field "$out/dtr$z.log" max_mib)"
done
for z in $HALF; do
    row "dtrain zero $z, bf16 params+moments" "$(dt_ms "$out/dth$z.log")" "$(field "$out/dth$z.log" max_mib)"
    row "  the same + recompute" "$(dt_ms "$out/dthr$z.log")" "$(field "$out/dthr$z.log" max_mib)"
done
for f in "$out"/dt*.log "$out"/torch*.log; do
    echo "# $(basename "$f"): $(grep '^pss ' "$f")"
done
