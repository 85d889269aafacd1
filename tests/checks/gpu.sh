# tests/checks/gpu.sh - the GPU checks (need a GPU).
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# With a GPU (a build with the CUDA backend, and nvidia-smi sees one):
#  - the core suites and the DDP tests of staged_checks with
#    DTRAIN_BACKEND=cuda: the device paths on real device memory, the DDP
#    tests as 2 ranks sharing the GPU;
#  - the Fashion-MNIST CNN on the GPU: fp32 must reach the CPU's bar (90%),
#    bf16 and fp16 autocast must end within 0.3 points of fp32;
#  - the same seed twice (fp32 and bf16, 200 steps): bit-identical
#    parameters (the checkpoints compared byte for byte).
# They run at once (each log in build/test/gpu_*.log, its tail printed on a
# failure).  The cuda group of the unit suite (every op against the CPU
# backend) runs with the rest of the suite in `test`, alone in `gpu`.
gpu_present() { [ -n "$CUDA_OBJ" ] && nvidia-smi -L >/dev/null 2>&1; }

gpu_checks() {
    if ! gpu_present; then echo "gpu checks: skipped: no GPU"; return 0; fi
    local t=$BUILD/test fast=$BUILD/test/fashion_mnist_O2 amp failed=0 acc fp32 log
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:protect_shadow_gap=0
    export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp OPENBLAS_NUM_THREADS=1
    {
        # parallel alone: its rank tests fork, and a process forked after
        # its parent started CUDA cannot use it
        echo "DTRAIN_BACKEND=cuda DT_TEST_GROUPS=${DEVICE_GROUPS%,parallel} timeout -k 5 300 $t/dtrain_tests > $t/gpu_core.log 2>&1"
        echo "DTRAIN_BACKEND=cuda DT_TEST_GROUPS=parallel timeout -k 5 300 $t/dtrain_tests > $t/gpu_parallel.log 2>&1"
        echo "DTRAIN_BACKEND=cuda DT_TEST_GROUPS=ddp DT_TEST_ONLY=$DEVICE_DDP timeout -k 5 300 $t/dtrain_tests > $t/gpu_ddp.log 2>&1"
        for amp in off bf16 fp16; do
            echo "timeout -k 5 300 $fast --model cnn --backend cuda --epochs 6 --amp $amp > $t/gpu_cnn_$amp.log 2>&1"
        done
        for run in off:1 off:2 bf16:1 bf16:2; do   # the same seed twice: the same bits
            echo "timeout -k 5 300 $fast --model cnn --backend cuda --epochs 1 --limit-batches 200" \
                 "--seed 7 --amp ${run%:*} --save $t/gpu_det_${run/:/_}.safetensors > $t/gpu_det_${run/:/_}.log 2>&1"
        done
    } | run_parallel || true
    for amp in off bf16; do
        if cmp -s $t/gpu_det_${amp}_1.safetensors $t/gpu_det_${amp}_2.safetensors; then
            echo "gpu check: CNN on cuda, autocast $amp, seed 7 twice: bit-identical parameters"
        else
            tail -3 $t/gpu_det_${amp}_1.log $t/gpu_det_${amp}_2.log
            echo "gpu check: two CNN runs on cuda (autocast $amp) with seed 7 differ"; failed=1
        fi
    done
    for log in gpu_core gpu_parallel gpu_ddp; do
        if tail -1 "$t/$log.log" | grep -q ' 0 failed'; then
            echo "gpu checks: ${log#gpu_} suites on cuda: $(tail -1 "$t/$log.log")"
        else
            tail -40 "$t/$log.log"; echo "gpu checks: the ${log#gpu_} suites failed on cuda"; failed=1
        fi
    done
    for amp in off bf16 fp16; do
        acc=$(tail -1 "$t/gpu_cnn_$amp.log" | sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
        if [ -z "$acc" ]; then
            tail -5 "$t/gpu_cnn_$amp.log"; echo "gpu check: the $amp run printed no accuracy"; failed=1
            continue
        fi
        echo "gpu check: CNN on cuda, autocast $amp: test accuracy $acc%" \
             "(last $(grep '^epoch [0-9]*:' "$t/gpu_cnn_$amp.log" | tail -1))"
        if [ $amp = off ]; then
            fp32=$acc
            awk -v a="$acc" 'BEGIN { exit !(a >= 90.0) }' || { echo "gpu check: fp32 CNN below 90%"; failed=1; }
        elif [ -n "${fp32:-}" ] && ! awk -v a="$acc" -v b="$fp32" 'BEGIN { d = a - b; exit !(d <= 0.3 && d >= -0.3) }'; then
            echo "gpu check: $amp is more than 0.3 points from fp32 ($fp32%)"; failed=1
        fi
    done
    unset ASAN_OPTIONS LSAN_OPTIONS OPENBLAS_NUM_THREADS
    [ $failed = 0 ] || exit 1
    echo "gpu checks: ok"
}
