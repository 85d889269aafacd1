# tests/checks/staged.sh - the staged (device-like) backend.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

DEVICE_GROUPS="core_forward,core_grad,core_optim,core_ckpt,core_data,core_dataset,core_memory,core_amp,parallel"
DEVICE_DDP="test_equivalence,test_reproducible,test_no_sync,test_unused,test_concat"
DEVICE_DDP="$DEVICE_DDP,test_compression_exact,test_compression_momentum,test_ps_bsp,test_ps_chunked"
DEVICE_DDP="$DEVICE_DDP,test_dead_rank,test_misuse,test_zero"
staged_checks() {
    local out groups=$DEVICE_GROUPS ddp=$DEVICE_DDP
    for run in "$groups:" "ddp:$ddp"; do
        out=$(DTRAIN_BACKEND=cpu-staged DT_TEST_GROUPS=${run%%:*} DT_TEST_ONLY=${run#*:} \
              ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 OPENBLAS_NUM_THREADS=1 \
              timeout -k 5 600 $BUILD/test/dtrain_tests 2>&1) ||
            { echo "$out" | tail -40; echo "staged checks: failed on cpu-staged"; exit 1; }
        echo "staged checks (${run%%:*} on cpu-staged): $(echo "$out" | tail -1)"
    done
}
