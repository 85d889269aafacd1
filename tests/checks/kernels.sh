# tests/checks/kernels.sh - the baseline kernels.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The SSE2 copies of the dispatched CPU kernels (backends/cpu.c), which a
# CPU with AVX2 or AVX-512 would never pick on its own.
baseline_kernels_check() {
    DTRAIN_CPU_KERNELS=baseline DT_TEST_GROUPS=cpu_kernels,core_forward,core_grad,core_optim,core_amp \
        OPENBLAS_NUM_THREADS=1 $BUILD/test/dtrain_tests > $BUILD/test/baseline.log 2>&1 ||
        { tail -30 $BUILD/test/baseline.log; echo "build.sh: the baseline kernels fail"; exit 1; }
    echo "build.sh: baseline (SSE2) kernels: $(tail -1 $BUILD/test/baseline.log)"
}
