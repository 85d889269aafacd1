# tests/checks/fuzz.sh - the fuzzing harnesses.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

FUZZ_WHOLE=" store comm ps "   # these include dtrain.c, to reach internal functions

# Run a check and say how long it took (CI's budget is 30 minutes on 2 cores).
# libFuzzer harnesses (tests/fuzz/fuzz_NAME.c) for the parsers that read
# untrusted bytes, built by clang with ASan and UBSan; each starts from its
# seeds in tests/fuzz/corpus/NAME (crashes found are kept there too, as
# regress-* inputs, besides a unit test).  `./build.sh fuzz [SECONDS]` runs
# each for SECONDS (default 60); `./build.sh test` runs each for
# FUZZ_SECONDS (5) when clang and its fuzzer runtime are installed.
FUZZERS="safetensors idx npy csv tokens store comm ps"

fuzz_build() {
    local f=$BUILD/fuzz cc=${FUZZ_CC:-clang} n current=1
    for n in $FUZZERS; do   # built already (./build.sh test builds them first)
        stale "$f/fuzz_$n" dtrain.c dtrain.h backends/*.c backends/*.h tests/fuzz/*.c tests/fuzz/*.h &&
            current=0
    done
    [ $current = 0 ] || return 0
    local san="-g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    local flags="$WARN $san -DDT_WITH_CPU -I."
    mkdir -p $f
    echo "$cc $flags -fsanitize=fuzzer-no-link -c dtrain.c -o $f/dtrain.o" | run_parallel || return 1
    for n in $FUZZERS; do
        if [[ $FUZZ_WHOLE == *" $n "* ]]; then
            echo "$cc $flags -fsanitize=fuzzer tests/fuzz/fuzz_$n.c -lopenblas -lz -lm -lpthread -o $f/fuzz_$n"
        else
            echo "$cc $flags -fsanitize=fuzzer tests/fuzz/fuzz_$n.c $f/dtrain.o -lopenblas -lz -lm -lpthread -o $f/fuzz_$n"
        fi
    done | run_parallel
}

# Run every harness for $1 seconds on a copy of its corpus; one line each:
# "fuzz NAME: R runs in S s, 0 crashes"; fails on the first crash (its
# input is left in build/fuzz/crash-NAME-*).
fuzz_run() {
    local secs=$1 f=$BUILD/fuzz n log runs
    for n in $FUZZERS; do
        rm -rf "$f/work-$n"
        mkdir -p "$f/work-$n"
        log=$f/fuzz-$n.log
        if ! ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
             OPENBLAS_NUM_THREADS=1 "$f/fuzz_$n" -max_total_time="$secs" -timeout=10 \
             -rss_limit_mb=2048 -max_len=65536 -artifact_prefix="$f/crash-$n-" \
             "$f/work-$n" "tests/fuzz/corpus/$n" > "$log" 2>&1; then
            grep -m1 -A30 "ERROR\|SUMMARY" "$log"
            echo "fuzz $n: a crash (input in $f/crash-$n-*; log $log)"
            return 1
        fi
        runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 runs in \2 s/p' "$log")
        echo "fuzz $n: ${runs:-? runs}, 0 crashes"
    done
}

fuzz_available() {
    mkdir -p "$BUILD"   # (a fresh clone has none yet)
    command -v "${FUZZ_CC:-clang}" > /dev/null &&
        echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }' |
        "${FUZZ_CC:-clang}" -x c -fsanitize=fuzzer - -o "$BUILD/fuzz_probe" 2> /dev/null
}

fuzz_checks() {
    if ! fuzz_available; then
        skipped "fuzz checks" "no clang with libFuzzer: apt-get install clang libclang-rt-14-dev"
        return 0
    fi
    fuzz_build || { echo "fuzz checks: the harnesses did not build"; exit 1; }
    fuzz_run "${FUZZ_SECONDS:-5}" || exit 1
}
