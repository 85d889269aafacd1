# tests/checks/pipeline.sh - pipeline parallelism end to end.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Pipelines end to end (sanitized build): the Fashion-MNIST MLP split into 2
# stages by measured time must reach the unsplit model's test accuracy (the
# same seed; only floating-point sum order differs: within 0.2 points), and
# the 2x2 hybrid (2 stages x 2 DDP replicas, 4 ranks under dtrun) must learn.
pipeline_checks() {
    local ex=$BUILD/test/pipeline_mnist out a1 a2 a4
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    acc_of() { echo "$1" | sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p' | tail -1; }
    out=$($ex --stages 1 --limit-batches 60 --seed 4); a1=$(acc_of "$out")
    out=$($ex --stages 2 --limit-batches 60 --seed 4); a2=$(acc_of "$out")
    echo "$out" | grep -q "stage 1 of replica 0: bubble" || { echo "pipeline check: no stage line:"; echo "$out"; exit 1; }
    if [ -z "$a1" ] || [ -z "$a2" ] || ! awk -v a="$a1" -v b="$a2" 'BEGIN { exit !(a - b < 0.2 && b - a < 0.2) }'; then
        echo "pipeline check: 1 stage $a1%, 2 stages $a2%: not the same model:"; echo "$out" | tail -8; exit 1
    fi
    out=$(timeout -k 5 300 $BUILD/test/dtrun -n 4 $ex --stages 2 --replicas 2 --limit-batches 30 --seed 4)
    a4=$(acc_of "$(echo "$out" | grep "test accuracy" | sed "s/^\[[0-9]*\] //")")
    if [ -z "$a4" ] || ! awk -v a="$a4" 'BEGIN { exit !(a > 60) }'; then
        echo "pipeline check: the 2x2 hybrid did not learn:"; echo "$out" | tail -8; exit 1
    fi
    if $ex --stages 9 2>/dev/null; then echo "pipeline check: 9 stages of 3 layers accepted"; exit 1; fi
    unset ASAN_OPTIONS
    echo "pipeline checks: 1 stage $a1%, 2 stages $a2%, 2 stages x 2 replicas $a4%: ok"
}
