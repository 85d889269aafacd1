#!/usr/bin/env bash
# tests/bench/python.sh - the Python binding's training step against the C
# example's (issue 8's target: within 10%), with PyTorch's eager step from
# the same interpreter beside them.
#
#   C:      build/fashion_mnist --model M --epochs 1 --limit-batches L
#   Python: bindings/python/examples/fashion_mnist.py, the same arguments
#           (the same loop line for line, over build/libdtrain.so)
#   torch:  tests/bench/bench_torch.py --model M (one batch over and over,
#           no loader: a floor for an eager Python framework's step)
#
# Each pass runs the three in turn, C and Python in alternating order; the
# step time of C and Python is the epoch's batch / (samples/s), the loop
# they both print.  Medians over REPEATS passes; both must also print the
# same test accuracy (same seed, same data order).
#
#   bash tests/bench/python.sh        (from any cwd; about 5 minutes)
#
# Knobs: REPEATS=5, MODELS="mlp cnn", MLP_BATCHES=300, CNN_BATCHES=100,
# THREADS=1, PY=/usr/bin/python3, STRICT=1 (exit 1 on a missed target).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=${PY:-/usr/bin/python3}
REPEATS=${REPEATS:-5}
MODELS=${MODELS:-"mlp cnn"}
THREADS=${THREADS:-1}
STRICT=${STRICT:-0}
MISS=0

./build.sh >/dev/null || { echo "python.sh: ./build.sh failed"; exit 1; }
export DTRAIN_LIB=$ROOT/build/libdtrain.so OPENBLAS_NUM_THREADS=$THREADS

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# ms per step from an example's "epoch 1: ..., N samples/s, ..." line
step_ms() {
    echo "$2" | sed -n 's/^\(\[0\] \)\{0,1\}epoch 1: .*, \([0-9.]*\) samples\/s, .*/\2/p' |
        awk -v b="$1" '{ printf "%.4f\n", 1000 * b / $1 }'
}
accuracy() { echo "$1" | sed -n 's/^test accuracy: \(.*\)%$/\1/p'; }

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) CPUs, $THREADS thread(s), commit $(git rev-parse --short HEAD)"
printf '%-5s %10s %10s %10s %9s %9s %s\n' model "C ms" "Python ms" "torch ms" "Py / C" "Py/torch" "accuracy C / Python"
for m in $MODELS; do
    if [ "$m" = mlp ]; then L=${MLP_BATCHES:-300}; B=128; else L=${CNN_BATCHES:-100}; B=64; fi
    args=(--model "$m" --epochs 1 --limit-batches "$L" --threads "$THREADS")
    : > /tmp/dt_py_c.$$; : > /tmp/dt_py_p.$$; : > /tmp/dt_py_t.$$
    acc_c="" acc_p=""
    for ((i = 0; i < REPEATS; i++)); do
        for side in $([ $((i % 2)) = 0 ] && echo "c p" || echo "p c"); do
            if [ "$side" = c ]; then
                out=$(build/fashion_mnist "${args[@]}")
                step_ms $B "$out" >> /tmp/dt_py_c.$$
                acc_c=$(accuracy "$out")
            else
                out=$($PY bindings/python/examples/fashion_mnist.py "${args[@]}")
                step_ms $B "$out" >> /tmp/dt_py_p.$$
                acc_p=$(accuracy "$out")
            fi
        done
        $PY tests/bench/bench_torch.py --model "$m" --threads "$THREADS" |
            sed -n "s/^$m threads=[0-9]* ms=\([0-9.]*\) .*/\1/p" >> /tmp/dt_py_t.$$
    done
    c=$(median < /tmp/dt_py_c.$$); p=$(median < /tmp/dt_py_p.$$); t=$(median < /tmp/dt_py_t.$$)
    ratio=$(awk -v p="$p" -v c="$c" 'BEGIN { printf "%.3f", p / c }')
    rt=$(awk -v p="$p" -v t="$t" 'BEGIN { printf "%.2f", p / t }')
    printf '%-5s %10.3f %10.3f %10.3f %9s %9s %s / %s\n' "$m" "$c" "$p" "$t" "$ratio" "$rt" "$acc_c" "$acc_p"
    echo "#   $m passes: C $(tr '\n' ' ' < /tmp/dt_py_c.$$)| Python $(tr '\n' ' ' < /tmp/dt_py_p.$$)"
    awk -v r="$ratio" 'BEGIN { exit !(r <= 1.10) }' || { echo "#   MISSED: Python step more than 10% above C's"; MISS=1; }
    [ -n "$acc_c" ] && [ "$acc_c" = "$acc_p" ] || { echo "#   MISSED: accuracies differ"; MISS=1; }
done
rm -f /tmp/dt_py_c.$$ /tmp/dt_py_p.$$ /tmp/dt_py_t.$$
[ "$STRICT" = 1 ] && exit $MISS
exit 0
