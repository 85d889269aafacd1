# tests/checks/unit.sh - the cmocka suite, in shards.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The groups whose tests measure the machine (the profiler's verdicts: which
# rank is starved of CPU, which phase is slow) and the checks that do: run
# after the others, one at a time, with the machine to themselves.
SERIAL_GROUPS=profile

# unit_shard K N: shard K of N of the cmocka suite (tests/test_util.h,
# DT_TEST_SHARD); its summary is the last line of $BUILD/test/unit-K.log.
# protect_shadow_gap=0: the CUDA driver maps memory where ASan's gap is,
# and tests/lsan.supp: the driver's own allocations are not leaks of ours.
unit_shard() {
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1${CUDA_OBJ:+:protect_shadow_gap=0} \
        LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp UBSAN_OPTIONS=print_stacktrace=1 \
        OPENBLAS_NUM_THREADS=1 DT_TEST_SHARD="$1/$2" $BUILD/test/dtrain_tests
}

# (the shard as one of run_checks' checks: its failures and summary shown,
# the whole output kept in $BUILD/test/logs/unit-K.log)
unit_shard_check() {
    local log=$BUILD/test/logs/unit-$1.log rc=0
    if [ "$1" = serial ]; then
        DT_TEST_GROUPS=$SERIAL_GROUPS unit_shard 0 1 > "$log" 2>&1 || rc=$?
    else
        DT_TEST_EXCEPT=$SERIAL_GROUPS unit_shard "$1" "$2" > "$log" 2>&1 || rc=$?
    fi
    if [ $rc != 0 ]; then
        grep -B2 -A12 '^\[  ERROR   \]\|^\[  FAILED  \] test\|ERROR: AddressSanitizer\|runtime error' "$log" | head -80
        tail -5 "$log"
    fi
    echo "unit shard $1${2:+/$2}: $(tail -1 "$log")"
    return $rc
}

# The shards' summaries summed: the suite's last line, "N passed, N failed".
unit_summary() {
    local n=$1 k last passed=0 failed=0 skipped=0 p f
    for k in $(seq 0 $((n - 1))) serial; do
        last=$(tail -1 "$BUILD/test/logs/unit-$k.log" 2>/dev/null)
        if [[ $last =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
            p=${BASH_REMATCH[1]} f=${BASH_REMATCH[2]}
        else   # it crashed before its summary: counted as one failure
            p=0 f=1
            echo "build.sh: unit shard $k/$n ended without its summary"
        fi
        passed=$((passed + p)) failed=$((failed + f))
        p=$(sed -n 's/^\([0-9]*\) skipped$/\1/p' "$BUILD/test/logs/unit-$k.log" | tail -1)
        skipped=$((skipped + ${p:-0}))
    done
    [ $skipped = 0 ] || echo "$skipped skipped"
    echo "$passed passed, $failed failed"
    [ $failed = 0 ]
}
