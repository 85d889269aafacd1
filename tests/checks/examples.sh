# tests/checks/examples.sh - the examples end to end, the CUDA plugin, the README's example.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The example end to end (sanitized build): a short run that saves a
# checkpoint, a strict safetensors read of it, a resume, and the error paths
# of the command line.  Runs before the cmocka suite, whose summary line
# must stay last.
example_checks() {
    local ex=$BUILD/test/fashion_mnist ck=$BUILD/test/ck.safetensors out
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    rm -f "$ck"
    out=$($ex --model cnn --epochs 1 --limit-batches 3 --batch 16 --save "$ck")
    echo "$out" | tail -1 | grep -Eq '^test accuracy: [0-9]+\.[0-9]{2}%$' ||
        { echo "example: no final accuracy line"; exit 1; }
    /usr/bin/python3 tests/check_safetensors.py "$ck"
    out=$($ex --model cnn --epochs 2 --limit-batches 3 --batch 16 --resume "$ck")
    echo "$out" | grep -q "resumed from $ck at step 3" || { echo "example: resume failed"; exit 1; }
    if $ex --bogus 2>/dev/null; then echo "example: unknown flag accepted"; exit 1; fi
    if $ex --data /nonexistent 2>/dev/null; then echo "example: missing dataset accepted"; exit 1; fi
    out=$($ex --data /nonexistent 2>&1 || true)
    case "$out" in *"Fashion-MNIST not found"*) ;; *) echo "example: unclear dataset error"; exit 1 ;; esac
    # data parallel: 2 ranks over shm (the demo's setup, shortened) train the
    # model that one process does with both ranks' batches at once: the
    # gradients were averaged, not only sent (their sum order differs: 1e-5)
    out=$($ex --model cnn --epochs 1 --limit-batches 4 --batch 16 --ranks 2 --save "$ck.ddp")
    echo "$out" | grep -q "x 2 ranks (DDP over shm)" || { echo "example: no DDP run:"; echo "$out"; exit 1; }
    echo "$out" | grep -q "exposed communication" || { echo "example: no step breakdown"; exit 1; }
    $ex --model cnn --epochs 1 --limit-batches 4 --batch 32 --save "$ck.one" > /dev/null ||
        { echo "example: the 1-process batch-32 run failed"; exit 1; }
    /usr/bin/python3 tests/compare_safetensors.py "$ck.ddp" "$ck.one" 1e-5 ||
        { echo "example: 2-rank DDP is not the 1-process run of the global batch"; exit 1; }
    # device-memory rules (cpu-staged) with fp16 autocast and loss scaling, DDP on 2 ranks
    out=$($ex --model mlp --epochs 1 --limit-batches 4 --batch 16 --ranks 2 --backend cpu-staged \
          --amp fp16)
    echo "$out" | grep -q "cpu-staged backend.*autocast fp16" ||
        { echo "example: no cpu-staged fp16 run:"; echo "$out"; exit 1; }
    echo "$out" | grep -q "^loss scale 65536, 0 steps skipped" ||
        { echo "example: no loss-scale line:"; echo "$out"; exit 1; }
    echo "$out" | tail -1 | grep -Eq '^test accuracy: [0-9]+\.[0-9]{2}%$' ||
        { echo "example: the fp16 run has no final accuracy line"; exit 1; }
    unset ASAN_OPTIONS
    echo "example checks: ok"
}

# The CUDA backend loads on demand: a program linking the library maps no
# CUDA library; --backend cuda loads build/libdtrain_cuda.so (which, on a
# machine without a GPU, then says there is none); a missing plugin is a
# clear error.
plugin_checks() {
    [ -n "$CUDA_PLUGIN" ] || { echo "plugin checks: skipped: no nvcc, no CUDA backend"; return 0; }
    local fast=$BUILD/test/fashion_mnist_O2 out
    if ldd "$fast" | grep -E 'libcublas|libcudart'; then
        echo "plugin check: a program linking libdtrain maps CUDA libraries"; exit 1
    fi
    if out=$(DTRAIN_CUDA_LIB=/nonexistent/libdtrain_cuda.so "$fast" --backend cuda --epochs 1 \
             --limit-batches 1 2>&1); then
        echo "plugin check: --backend cuda ran without its plugin"; exit 1
    fi
    case "$out" in *"backend 'cuda' cannot be loaded (/nonexistent/libdtrain_cuda.so"*) ;;
        *) echo "plugin check: unclear error without the plugin:"; echo "$out"; exit 1 ;; esac
    if gpu_present; then echo "plugin checks: ok (gpu_checks train through the plugin)"; return 0; fi
    if out=$("$fast" --backend cuda --epochs 1 --limit-batches 1 2>&1); then
        echo "plugin check: no GPU here, yet --backend cuda ran"; exit 1
    fi
    case "$out" in *"cuda: no CUDA device is visible"*) ;;
        *) echo "plugin check: the plugin did not load and start:"; echo "$out"; exit 1 ;; esac
    echo "plugin checks: CPU programs map no CUDA library; --backend cuda loads the plugin," \
         "which finds no GPU here"
}

# The README's C example is a whole program: compile and run it, so the
# documentation cannot go stale.  It links the library's objects: the
# generated dtrain.c, compiled as a user compiles it.
readme_example() {
    awk '/^```c$/{f=1;next} /^```$/{f=0} f' README.md > $BUILD/test/readme_example.c
    local o=$BUILD/obj
    $CC $WARN $1 $DEFS -I. $BUILD/test/readme_example.c $o/dtrain.o \
        $LIBS -o $BUILD/test/readme_example
    $BUILD/test/readme_example
}
