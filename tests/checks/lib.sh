# tests/checks/lib.sh - what every check uses.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# skipped WHAT REASON: a check that could not run here says so; under CI
# (DT_CI=1, set by .ci/run), which installs what these checks need, a skip
# is a failure, never a silent pass.  (A GPU and CUDA's nvcc are not
# installed by CI: those checks skip with `echo`.)
skipped() {
    echo "$1: skipped ($2)"
    if [ "${DT_CI:-0}" = 1 ]; then
        echo "$1: FAILED: skipped under CI, which installs what it needs"
        exit 1
    fi
}

timed() {
    local t0=$SECONDS what=${1##*/}
    [ "$what" != bash ] || what=${2##*/}
    "$@"
    echo "build.sh: $what: $((SECONDS - t0)) s"
}
