#!/usr/bin/env bash
# build.sh - build, test and demo dtrain.
#
#   ./build.sh            static + shared library and examples into build/
#   ./build.sh deps       install the Debian packages dtrain needs (as root),
#                         otherwise print the exact apt-get line
#   ./build.sh test       AddressSanitizer + UBSan build, run every test
#                         (DT_BUILD_ONLY=1: build the test programs, run nothing)
#   ./build.sh gpu        the GPU checks alone (cuda group, suites on cuda,
#                         the CNN on the GPU); DT_PREBUILT=1 skips the build
#   ./build.sh demo       the main job: the Fashion-MNIST CNN on 2 local ranks
#                         (DDP over shm); DT_EPOCHS, DT_RANKS to change it
#   ./build.sh valgrind   a short training run under valgrind's leak checker
#   ./build.sh bench      benchmarks against PyTorch (tests/bench/run.sh)
#   ./build.sh install PREFIX   the header, both libraries and dtrain.pc
#                         (pkg-config) under PREFIX (default /usr/local)
#   ./build.sh clean
#
# Environment: CC (default gcc), DT_NATIVE=0 to build without -march=native,
# DT_CUDA=0 to leave the CUDA backend out even where nvcc is found.
set -euo pipefail
cd "$(dirname "$0")"

CC=${CC:-gcc}
BUILD=build
WARN="-std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror"
if [ "${DT_NATIVE:-1}" = 1 ]; then ARCH="-march=native"; else ARCH=""; fi
OPT="-O3 $ARCH -fno-math-errno"
LIBS="-lopenblas -lfabric -lz -lm -lpthread"
CORE_SRC="dtrain.c backends/cpu.c backends/fabric.c"
DEFS="-DDT_WITH_CPU -DDT_WITH_FABRIC"
CPU_DEFS=$DEFS CPU_LIBS=$LIBS   # builds that leave CUDA out (valgrind)

# The CUDA backend is compiled whenever nvcc is found (CI always has the
# toolkit, not always a GPU): the library then holds both backends and a
# context picks one by name.  Without nvcc the build is CPU-only.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
CUDA_OBJ=""
if [ "${DT_CUDA:-1}" = 1 ] && [ -x "$NVCC" ]; then
    DEFS="$DEFS -DDT_WITH_CUDA"
    LIBS="$LIBS -L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublas -lcudart -lstdc++"
    CUDA_OBJ=$BUILD/obj/cuda.o
fi
# A100 and H100 binaries, and PTX the driver can compile for newer GPUs.
CUDA_ARCH="-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
           -gencode arch=compute_90,code=compute_90"

# backends/cuda.cu -> $CUDA_OBJ, rebuilt only when it or the headers change
build_cuda() {
    [ -n "$CUDA_OBJ" ] || return 0
    mkdir -p $BUILD/obj
    if [ -f "$CUDA_OBJ" ] && [ ! backends/cuda.cu -nt "$CUDA_OBJ" ] &&
       [ ! backends/backend.h -nt "$CUDA_OBJ" ] && [ ! dtrain.h -nt "$CUDA_OBJ" ]; then
        return 0
    fi
    echo "build.sh: compiling the CUDA backend ($NVCC)"
    "$NVCC" -std=c++17 -O3 -Xcompiler -fPIC,-Wall,-Wextra -Werror all-warnings $CUDA_ARCH \
        -DDT_WITH_CUDA -I. -c backends/cuda.cu -o "$CUDA_OBJ"
}

# Debian packages: why each is here is in docs/DEPENDENCIES.md.
PKGS_BUILD="gcc make libopenblas-dev libfabric-dev zlib1g-dev libcmocka-dev pkg-config"
PKGS_DATA="dataset-fashion-mnist"
PKGS_TEST="valgrind"
PKGS_BENCH="python3-torch python3-numpy time"

missing_pkgs() {
    local m=""
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || m="$m $p"
    done
    echo "$m"
}

ensure_pkgs() {
    local m
    m=$(missing_pkgs "$@")
    [ -z "$m" ] && return 0
    if [ "$(id -u)" = 0 ]; then
        echo "build.sh: installing:$m"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null
        apt-get -o DPkg::Lock::Timeout=300 install -y -q $m >/dev/null
    else
        echo "build.sh: missing Debian packages:$m" >&2
        echo "  run: sudo apt-get update && sudo apt-get install -y$m" >&2
        exit 1
    fi
}

# The version from dtrain.h: "0.1.0", or its major number with "major".
dt_version() {
    local v
    v=$(sed -n 's/^#define DTRAIN_VERSION_STRING "\(.*\)"$/\1/p' dtrain.h)
    if [ "${1:-}" = major ]; then echo "${v%%.*}"; else echo "$v"; fi
}

# Run the commands read from stdin, one per line, as many at once as there
# are cores (longest first is best); after all have ended, fails if any did.
run_parallel() {
    local max running=0 failed=0 cmd
    max=$(nproc)
    while IFS= read -r cmd; do
        [ -n "$cmd" ] || continue
        bash -c "$cmd" &
        running=$((running + 1))
        if [ $running -ge "$max" ]; then
            wait -n || failed=1
            running=$((running - 1))
        fi
    done
    while [ $running -gt 0 ]; do
        wait -n || failed=1
        running=$((running - 1))
    done
    return $failed
}

# The library's compile commands: its objects (-O3, PIC), and the core alone,
# which must compile without any backend or BLAS header.
lib_compile_cmds() {
    local f
    for f in $CORE_SRC; do
        echo "$CC $WARN $OPT $DEFS -fPIC -I. -c $f -o $BUILD/obj/$(basename "${f%.c}").o"
    done
    echo "$CC $WARN -O1 -I. -c dtrain.c -o $BUILD/obj/core_only.o"
}

# The library is current when it was built with these flags after every
# source and header last changed (and after the CUDA object).
LIB_STAMP=$BUILD/obj/lib.stamp
lib_is_current() {
    local f
    [ -f "$LIB_STAMP" ] && [ -f $BUILD/libdtrain.so ] && [ -f $BUILD/libdtrain.a ] || return 1
    [ "$(cat "$LIB_STAMP")" = "$CC $WARN $OPT $DEFS $LIBS" ] || return 1
    for f in $CORE_SRC dtrain.h backends/*.h $CUDA_OBJ ${CUDA_OBJ:+backends/cuda.cu}; do
        [ "$f" -nt "$LIB_STAMP" ] && return 1
    done
    return 0
}

link_lib() {
    local objs="$BUILD/obj/dtrain.o $BUILD/obj/cpu.o $BUILD/obj/fabric.o $CUDA_OBJ"
    printf 'DTRAIN_%s {\n  global: dt_*;\n  local: *;\n};\n' "$(dt_version major)" > $BUILD/dtrain.map
    rm -f $BUILD/libdtrain.a
    ar rcs $BUILD/libdtrain.a $objs
    echo "$LIBS" > $BUILD/libdtrain.ldflags   # what a program linking the library needs
    # the soname carries the API's major version; only dt_ symbols leave it
    $CC -shared -o $BUILD/libdtrain.so.$(dt_version) -Wl,-soname,libdtrain.so.$(dt_version major) \
        -Wl,--version-script=$BUILD/dtrain.map $objs $LIBS
    ln -sf libdtrain.so.$(dt_version) $BUILD/libdtrain.so.$(dt_version major)
    ln -sf libdtrain.so.$(dt_version major) $BUILD/libdtrain.so
    echo "$CC $WARN $OPT $DEFS $LIBS" > "$LIB_STAMP"
}

# libdtrain.a and libdtrain.so, compiled on every core (nvcc alongside),
# or nothing at all when they are current.
build_lib() {
    mkdir -p $BUILD/obj $BUILD/shared
    lib_is_current && return 0
    build_cuda &
    local nv=$!
    lib_compile_cmds | run_parallel
    wait $nv
    link_lib
}

build_examples() {
    for f in examples/*.c; do
        $CC $WARN $OPT -I. "$f" $BUILD/libdtrain.a $LIBS -o "$BUILD/$(basename "${f%.c}")"
    done
}

cmd_build() {
    ensure_pkgs $PKGS_BUILD
    build_lib
    build_examples
    echo "build.sh: built $BUILD/libdtrain.a, $BUILD/libdtrain.so and examples"
}

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
    # data parallel: 2 ranks over shm (the demo's setup, shortened)
    out=$($ex --model cnn --epochs 1 --limit-batches 4 --batch 16 --ranks 2)
    echo "$out" | grep -q "x 2 ranks (DDP over shm)" || { echo "example: no DDP run:"; echo "$out"; exit 1; }
    echo "$out" | grep -q "exposed communication" || { echo "example: no step breakdown"; exit 1; }
    echo "$out" | tail -1 | grep -Eq '^test accuracy: [0-9]+\.[0-9]{2}%$' ||
        { echo "example: 2-rank run has no final accuracy line"; exit 1; }
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

# The parameter server end to end.  Accuracy: the Fashion-MNIST MLP with 2
# workers and 1 server in each consistency mode (optimized build, 3 epochs,
# cosine decay on the servers); ASP and SSP must end within 1 point of BSP.
# Sparse: the click model on 2 servers (sanitized build, small) learns.
ps_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 out acc bsp m
    for m in bsp asp ssp; do
        out=$(timeout -k 5 300 "$fast" --ranks 3 --servers 1 --ps-mode $m --epochs 3)
        acc=$(echo "$out" | tail -1 | sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
        [ -n "$acc" ] || { echo "ps check: $m run has no accuracy line:"; echo "$out" | tail -5; exit 1; }
        echo "ps check: $m test accuracy $acc%"
        if [ $m = bsp ]; then bsp=$acc
        elif ! awk -v a="$acc" -v b="$bsp" 'BEGIN { exit !(a >= b - 1.0) }'; then
            echo "ps check: $m is more than 1 point below bsp ($bsp%)"; exit 1
        fi
    done
    out=$(ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 timeout -k 5 300 $BUILD/test/ps_sparse \
          --ranks 4 --servers 2 --samples 100000 --test 5000 --rows 65536 --prefetch)
    acc=$(echo "$out" | tail -1 | sed -n 's/^test auc: \([0-9.]*\)$/\1/p')
    if [ -z "$acc" ] || ! awk -v a="$acc" 'BEGIN { exit !(a > 0.55) }'; then
        echo "ps check: the sparse model did not learn:"; echo "$out" | tail -5; exit 1
    fi
    echo "ps check: sparse model test auc $acc"
    echo "ps checks: ok"
}

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

# The Python binding (bindings/python) on Debian's python3 + numpy.  Its unit
# tests run against a sanitized libdtrain.so (ASan and UBSan preloaded into
# the interpreter): layouts of the mirrored structs, errors with the C
# message, zero copy, lifetimes, gradients, checkpoints, DDP under dtrun
# and a dead peer.  Then the Fashion-MNIST example in Python must reach the
# C example's accuracy to the digit with the same seed, alone and as 2 DDP
# ranks under the launcher (optimized library and programs).
python_checks() {
    local py=/usr/bin/python3 so=$BUILD/test/pysan/libdtrain.so c p want got
    DTRAIN_LIB=$PWD/$so DTRUN=$PWD/$BUILD/test/dtrun CC=$CC \
        LD_PRELOAD="$($CC -print-file-name=libasan.so) $($CC -print-file-name=libubsan.so)" \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 OPENBLAS_NUM_THREADS=1 \
        $py bindings/python/tests/test_dtrain.py > $BUILD/test/python.log 2>&1 ||
        { tail -40 $BUILD/test/python.log; echo "python checks: the binding's tests failed"; exit 1; }
    tail -1 $BUILD/test/python.log
    build_examples
    for ranks in 1 2; do
        if [ $ranks = 1 ]; then
            c=$($BUILD/fashion_mnist --epochs 1 --limit-batches 150 --seed 4)
            p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so $py bindings/python/examples/fashion_mnist.py \
                --epochs 1 --limit-batches 150 --seed 4)
        else
            c=$($BUILD/fashion_mnist --epochs 1 --limit-batches 100 --seed 4 --ranks 2)
            p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so $BUILD/dtrun -n 2 $py \
                bindings/python/examples/fashion_mnist.py --epochs 1 --limit-batches 100 --seed 4)
        fi
        want=$(echo "$c" | sed -n 's/^test accuracy: //p')
        got=$(echo "$p" | sed -n 's/^\(\[0\] \)\{0,1\}test accuracy: //p')
        if [ -z "$want" ] || [ "$want" != "$got" ]; then
            echo "python checks: $ranks rank(s): the Python example reached '$got', C '$want':"
            echo "$p" | tail -5; exit 1
        fi
        echo "python checks: $ranks rank(s): Python and C example both reach $want test accuracy"
    done
}

# dtrun end to end: 3 ranks join through the environment, the store and
# the token it sets, pick shm (one host), and agree on the sums.
launcher_checks() {
    local out
    out=$(ASAN_OPTIONS=detect_leaks=1 timeout -k 5 60 $BUILD/test/dtrun -n 3 $BUILD/test/allreduce)
    for r in 0 1 2; do
        case "$out" in
            *"[$r] rank $r of 3 over shm: sums 3 3 5 6"*) ;;
            *) echo "launcher check: rank $r's line missing in:"; echo "$out"; exit 1 ;;
        esac
    done
    out=$(DTRAIN_TRANSPORT=tcp DTRAIN_HOST=127.0.0.1 timeout -k 5 60 $BUILD/test/dtrun -n 2 $BUILD/test/allreduce)
    case "$out" in *"[1] rank 1 of 2 over tcp;ofi_rxm: sums 1 2 1 4"*) ;;
        *) echo "launcher check (tcp) failed:"; echo "$out"; exit 1 ;; esac
    echo "launcher checks: ok"
}

# The README's C example is a whole program: compile and run it, so the
# documentation cannot go stale.
readme_example() {
    awk '/^```c$/{f=1;next} /^```$/{f=0} f' README.md > $BUILD/test/readme_example.c
    local o=$BUILD/test/obj
    $CC $WARN $1 $DEFS -I. $BUILD/test/readme_example.c $o/dtrain.o $o/cpu.o $o/fabric.o \
        $CUDA_OBJ $LIBS -o $BUILD/test/readme_example
    $BUILD/test/readme_example
}

# docs/API.md stays true: every DT_API function of dtrain.h has exactly one
# row there, and every ```c block compiles warning-free (whole programs and
# whole functions, each with its own includes); the programs link and run.
api_doc_checks() {
    local dir f n missing="" b ran=0
    dir=$(mktemp -d)
    for f in $(grep '^DT_API' dtrain.h | grep -o 'dt_[a-z0-9_]*(' | tr -d '(' | sort -u); do
        n=$(grep -c "^| \`$f(" docs/API.md || true)
        [ "$n" = 1 ] || missing="$missing $f($n rows)"
    done
    [ -z "$missing" ] || { echo "api doc checks: not documented once in docs/API.md:$missing"; exit 1; }
    awk -v d="$dir" '/^```c$/ { n++; f = 1; next } /^```$/ { f = 0 }
        f { print > sprintf("%s/blk_%02d.c", d, n) }' docs/API.md
    for b in "$dir"/blk_*.c; do
        if grep -q 'int main(' "$b"; then
            $CC $WARN -O1 -I. "$b" $BUILD/libdtrain.a $LIBS -o "${b%.c}" &&
                (cd "$dir" && timeout -k 5 120 "${b%.c}" > "${b%.c}.out") ||
                { echo "api doc checks: $(basename "$b") ($(head -c 300 "$b" | head -3)) failed"; exit 1; }
            ran=$((ran + 1))
        else
            $CC $WARN -fsyntax-only -I. "$b" ||
                { echo "api doc checks: $(basename "$b") does not compile"; exit 1; }
        fi
    done
    echo "api doc checks: $(ls "$dir"/blk_*.c | wc -l) examples compile, $ran programs run: ok"
    rm -rf "$dir"
}

# The core and DDP suites again on cpu-staged: the CPU kernels behind a
# device's memory rules (nothing read in place, copies that happen only when
# waited for), so the paths a GPU takes through the core run here too.
DEVICE_GROUPS="core_forward,core_grad,core_optim,core_ckpt,core_data,core_memory,core_amp,parallel"
DEVICE_DDP="test_equivalence,test_reproducible,test_no_sync,test_unused,test_concat"
DEVICE_DDP="$DEVICE_DDP,test_compression_exact,test_compression_momentum,test_ps_bsp,test_ps_chunked"
DEVICE_DDP="$DEVICE_DDP,test_dead_rank,test_misuse"
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

# Mixed precision on the CPU (which rounds GEMM inputs exactly as a GPU's
# tensor cores read them): one epoch of the MLP in bf16 and in fp16 with
# loss scaling must end within 0.3 points of fp32 (same seed, so the runs
# are reproducible and the check cannot flake).
amp_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 acc fp32 amp
    for amp in off bf16 fp16; do
        acc=$(timeout -k 5 300 "$fast" --model mlp --epochs 1 --threads 2 --amp $amp | tail -1 |
              sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
        [ -n "$acc" ] || { echo "amp check: the $amp run printed no accuracy"; exit 1; }
        echo "amp check: MLP on cpu, autocast $amp: test accuracy $acc%"
        if [ $amp = off ]; then
            fp32=$acc
        elif ! awk -v a="$acc" -v b="$fp32" 'BEGIN { d = a - b; exit !(d <= 0.3 && d >= -0.3) }'; then
            echo "amp check: $amp is more than 0.3 points from fp32 ($fp32%)"; exit 1
        fi
    done
}

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

# ./build.sh gpu: the GPU's share of `test` alone: the cuda group of the
# unit suite, then gpu_checks.  Builds the sanitized programs first, unless
# DT_PREBUILT=1 (programs built elsewhere by `./build.sh test` or
# `DT_BUILD_ONLY=1 ./build.sh test`, copied with the tree).
cmd_gpu() {
    local san="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    if [ "${DT_PREBUILT:-0}" != 1 ]; then
        ensure_pkgs $PKGS_BUILD $PKGS_DATA
        mkdir -p $BUILD/test
        build_test_programs "$san"
    fi
    if ! gpu_present; then echo "gpu checks: skipped: no GPU"; return 0; fi
    local rc=0
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:protect_shadow_gap=0 \
        LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp UBSAN_OPTIONS=print_stacktrace=1 \
        OPENBLAS_NUM_THREADS=1 DT_TEST_GROUPS=cuda timeout -k 5 300 $BUILD/test/dtrain_tests || rc=1
    (timed gpu_checks) || rc=1
    return $rc
}

# The profiler end to end (optimized build): a 2-rank run's merged trace
# is valid trace-event JSON with both ranks' phases and collectives, and on
# each rank the phase events add up to the step events within 5% (the rest
# is idle, outside dtrain's calls); with rank 1 made 3x slower the report
# names it and load balancing moves rank 0's share of the global batch up.
profile_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 trace=$BUILD/test/trace.json out share
    rm -f "$trace"
    out=$(timeout -k 5 120 "$fast" --ranks 2 --model mlp --epochs 1 --limit-batches 40 --profile \
          --trace "$trace")
    echo "$out" | grep -q "^dtrain profile: 2 ranks, 40 steps on rank 0, timeline in $trace" ||
        { echo "profile check: no report:"; echo "$out" | tail -20; exit 1; }
    /usr/bin/python3 - "$trace" <<'PY' || exit 1
import json, sys
t = json.load(open(sys.argv[1]))
ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
for r in (0, 1):
    mine = [e for e in ev if e["pid"] == r]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "step"]
    steps = sum(b - a for a, b in spans)
    # phases inside the steps (evaluation after the last step is in none)
    phases = sum(e["dur"] for e in mine if e["cat"] == "phase" and
                 any(a - 1 <= e["ts"] and e["ts"] + e["dur"] <= b + 1 for a, b in spans))
    comm = [e for e in mine if e["tid"] == 2 and e["cat"] == "comm"]
    n = sum(1 for e in mine if e["cat"] == "step")
    assert n == 40, f"rank {r}: {n} steps"
    assert comm and all(e["args"]["busbw_GBps"] >= 0 for e in comm), f"rank {r}: no collectives"
    assert abs(phases - steps) <= 0.05 * steps, f"rank {r}: phases {phases} us, steps {steps} us"
    print(f"profile check: rank {r}: 40 steps, phases {phases/1e3:.1f} ms of {steps/1e3:.1f} ms, "
          f"{len(comm)} collectives")
PY
    out=$(timeout -k 5 120 "$fast" --ranks 2 --model mlp --epochs 1 --limit-batches 60 --profile \
          --slow 1:3 --balance)
    echo "$out" | grep -q "^straggler: rank 1 computes" ||
        { echo "profile check: the slowed rank is not named:"; echo "$out" | tail -20; exit 1; }
    share=$(echo "$out" | sed -n "s/^load balancing: rank 0's share of each global batch \([0-9.]*\)%$/\1/p")
    if [ -z "$share" ] || ! awk -v s="$share" 'BEGIN { exit !(s >= 60) }'; then
        echo "profile check: balancing did not move the load (rank 0's share '$share')"; exit 1
    fi
    echo "profile check: rank 1 named a straggler; balanced, rank 0 takes $share% of each batch"
    echo "profile checks: ok"
}

# ./build.sh install PREFIX: include/dtrain.h, lib/libdtrain.{a,so*} and
# lib/pkgconfig/dtrain.pc.  Static linking takes `pkg-config --static`.
cmd_install() {
    local prefix=${1:-/usr/local}
    build_lib
    mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
    cp dtrain.h "$prefix/include/"
    cp $BUILD/libdtrain.a $BUILD/libdtrain.so.$(dt_version) "$prefix/lib/"
    ln -sf libdtrain.so.$(dt_version) "$prefix/lib/libdtrain.so.$(dt_version major)"
    ln -sf libdtrain.so.$(dt_version major) "$prefix/lib/libdtrain.so"
    {
        echo "prefix=$prefix"
        echo 'includedir=${prefix}/include'
        echo 'libdir=${prefix}/lib'
        echo
        echo "Name: dtrain"
        echo "Description: distributed deep-learning training in C (OpenBLAS CPU, CUDA, libfabric)"
        echo "Version: $(dt_version)"
        echo 'Cflags: -I${includedir}'
        echo 'Libs: -L${libdir} -ldtrain'
        echo "Libs.private: $LIBS"
    } > "$prefix/lib/pkgconfig/dtrain.pc"
    echo "build.sh: installed dtrain $(dt_version) under $prefix (pkg-config: $prefix/lib/pkgconfig)"
}

# Embedding end to end.  Vendoring: dtrain.h, dtrain.c and the backend's
# files copied into an empty directory with a program, compiled with one cc
# line, CPU-only without libfabric and with it.  Installing: the program
# built with `pkg-config --cflags --libs dtrain` against a fresh prefix,
# shared and static.  And the shared library exports dt_ symbols only,
# under a soname carrying the major version.
embed_checks() {
    local dir out out_so bad
    dir=$(mktemp -d)
    cp dtrain.h dtrain.c tests/embed/vendored.c "$dir/"
    mkdir "$dir/backends"
    cp backends/backend.h backends/shape.h backends/transport.h backends/cpu.c backends/fabric.c \
       "$dir/backends/"
    printf '%s\n' "cd $dir && $CC $WARN -O2 -DDT_WITH_CPU vendored.c dtrain.c backends/cpu.c \
        -lopenblas -lz -lm -lpthread -o v_cpu" \
        "cd $dir && $CC $WARN -O2 -DDT_WITH_CPU -DDT_WITH_FABRIC vendored.c dtrain.c backends/cpu.c \
        backends/fabric.c -lopenblas -lfabric -lz -lm -lpthread -o v_fab" | run_parallel ||
        { echo "embed check: a vendored build did not compile"; exit 1; }
    (cd "$dir" && ./v_cpu) || { echo "embed check: the CPU-only vendored build failed"; exit 1; }
    (cd "$dir" && ./v_fab) || { echo "embed check: the vendored build with libfabric failed"; exit 1; }
    cmd_install "$dir/prefix" >/dev/null
    (cd "$dir" && export PKG_CONFIG_PATH="$dir/prefix/lib/pkgconfig" &&
        $CC $WARN vendored.c $(pkg-config --cflags --libs dtrain) -o v_pc &&
        LD_LIBRARY_PATH="$dir/prefix/lib" ./v_pc &&
        $CC $WARN vendored.c $(pkg-config --cflags dtrain) "$dir/prefix/lib/libdtrain.a" \
            $(pkg-config --libs --static dtrain | sed 's/-ldtrain//') -o v_static && ./v_static) ||
        { echo "embed check: building against the installed prefix with pkg-config failed"; exit 1; }
    out_so=$(readelf -d "$dir/prefix/lib/libdtrain.so" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
    [ "$out_so" = "libdtrain.so.$(dt_version major)" ] ||
        { echo "embed check: soname '$out_so', expected libdtrain.so.$(dt_version major)"; exit 1; }
    bad=$(nm -D --defined-only "$dir/prefix/lib/libdtrain.so" | awk '$3 !~ /^dt_/ && $3 !~ /^DTRAIN_/ {print $3}')
    [ -z "$bad" ] || { echo "embed check: exported symbols without dt_: $bad"; exit 1; }
    # the small embedding example: a line fitted to y = 3 size - 2 age + 10 + noise
    awk 'BEGIN { srand(7); print "size,age,price"; for (i = 0; i < 500; i++) { s = 50 + 100 * rand();
         a = 30 * rand(); n = (rand() + rand() + rand() - 1.5) * 2;
         printf "%.3f,%.3f,%.4f\n", s, a, 3 * s - 2 * a + 10 + n } }' > "$dir/h.csv"
    out=$(ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 $BUILD/test/csv_regress "$dir/h.csv")
    echo "$out" | awk '/R\^2/ { r2 = $NF } /^price =/ { s = $3; a = $6; c = $NF }
        END { exit !(r2 >= 0.999 && s > 2.95 && s < 3.05 && a > -2.05 && a < -1.95 && c > 9 && c < 11) }' ||
        { echo "embed check: csv_regress did not recover the line:"; echo "$out"; exit 1; }
    printf 'a,b\n1,2\n3,x\n' > "$dir/bad.csv"
    if $BUILD/test/csv_regress "$dir/bad.csv" 2>/dev/null; then
        echo "embed check: csv_regress accepted a malformed file"; exit 1
    fi
    rm -rf "$dir"
    echo "embed checks: vendored (cpu; cpu + libfabric), pkg-config (shared; static), soname $out_so,"
    echo "  csv_regress: $(echo "$out" | tail -1): ok"
}

# Everything the checks run, each source compiled once, on every core, with
# nvcc alongside: the core, the tests and the examples sanitized (the core's
# objects linked into the unit suite, the examples and the README's program),
# the library (-O3; the fast example and build_examples link it), and the
# sanitized shared library the Python binding's tests load (no CUDA: ASan in
# an interpreter is enough to debug).
build_test_programs() {
    local san=$1 o=$BUILD/test/obj py=$BUILD/test/pysan f n tobj=""
    local core="$o/dtrain.o $o/cpu.o $o/fabric.o $CUDA_OBJ"
    mkdir -p $o $py $BUILD/obj $BUILD/shared
    build_cuda &
    local nv=$!
    {
        for f in $CORE_SRC; do   # the long ones first
            n=$(basename "${f%.c}")
            echo "$CC $WARN $san $DEFS -I. -c $f -o $o/$n.o"
            echo "$CC $WARN $san -fPIC $CPU_DEFS -I. -c $f -o $py/$n.o"
        done
        lib_is_current || lib_compile_cmds
        echo "$CC $WARN -O2 $DEFS -I. -c examples/fashion_mnist.c -o $o/fashion_mnist_O2.o"
        for f in tests/test_*.c examples/*.c; do
            echo "$CC $WARN $san $DEFS -I. -c $f -o $o/$(basename "${f%.c}").o"
        done
    } | run_parallel
    wait $nv
    lib_is_current || link_lib
    for f in tests/test_*.c; do tobj="$tobj $o/$(basename "${f%.c}").o"; done
    $CC $san $core $tobj $LIBS -lcmocka -o $BUILD/test/dtrain_tests
    for f in examples/*.c; do   # the examples must build too (and stay warning-free)
        n=$(basename "${f%.c}")
        $CC $san $o/$n.o $core $LIBS -o $BUILD/test/$n
    done
    $CC $o/fashion_mnist_O2.o $BUILD/libdtrain.a $LIBS -o $BUILD/test/fashion_mnist_O2
    $CC $san -shared $py/dtrain.o $py/cpu.o $py/fabric.o $CPU_LIBS -o $py/libdtrain.so
}

# Run a check and say how long it took (CI's budget is 30 minutes on 2 cores).
timed() {
    local t0=$SECONDS what=${1##*/}
    [ "$what" != bash ] || what=${2##*/}
    "$@"
    echo "build.sh: $what: $((SECONDS - t0)) s"
}

cmd_test() {
    ensure_pkgs $PKGS_BUILD $PKGS_DATA python3-numpy iproute2 iputils-ping
    mkdir -p $BUILD/test
    local san="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    local t0=$SECONDS
    build_test_programs "$san"
    echo "build.sh: compiling the library, the tests and the examples: $((SECONDS - t0)) s"
    [ "${DT_BUILD_ONLY:-0}" = 0 ] || return 0
    timed example_checks
    timed embed_checks
    timed ps_checks
    timed pipeline_checks
    timed python_checks
    timed launcher_checks
    timed bash tests/multihost.sh "$PWD/$BUILD/test"
    timed readme_example "$san"
    timed api_doc_checks
    timed staged_checks
    timed amp_checks
    timed profile_checks
    timed gpu_checks
    echo "build.sh: the checks took $SECONDS s; the unit suite follows"
    # protect_shadow_gap=0: the CUDA driver maps memory where ASan's gap is
    # and tests/lsan.supp: the driver's own allocations are not leaks of ours
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1${CUDA_OBJ:+:protect_shadow_gap=0} \
        LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp UBSAN_OPTIONS=print_stacktrace=1 \
        OPENBLAS_NUM_THREADS=1 $BUILD/test/dtrain_tests
}

cmd_demo() {
    ensure_pkgs $PKGS_BUILD $PKGS_DATA
    build_lib
    build_examples
    local ranks=${DT_RANKS:-2} threads
    threads=$(( $(nproc) / ranks )); [ "$threads" -ge 1 ] || threads=1
    echo "build.sh: training the CNN on Fashion-MNIST: $ranks ranks over shm (DDP), $threads thread(s) each"
    $BUILD/fashion_mnist --model cnn --epochs "${DT_EPOCHS:-6}" --ranks "$ranks" --threads "$threads" "$@"
}

cmd_valgrind() {
    ensure_pkgs $PKGS_BUILD $PKGS_DATA $PKGS_TEST
    mkdir -p $BUILD/vg
    $CC $WARN -O1 -g $CPU_DEFS -I. examples/fashion_mnist.c $CORE_SRC $CPU_LIBS -o $BUILD/vg/fashion_mnist
    OPENBLAS_NUM_THREADS=1 valgrind --leak-check=full --show-leak-kinds=definite,indirect,possible \
        --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=3 \
        $BUILD/vg/fashion_mnist --model mlp --epochs 1 --limit-batches 30 --threads 2
}

case "${1:-build}" in
    build) cmd_build ;;
    deps) ensure_pkgs $PKGS_BUILD $PKGS_DATA $PKGS_TEST ;;
    test) cmd_test ;;
    gpu) cmd_gpu ;;
    demo) shift; cmd_demo "$@" ;;
    valgrind) cmd_valgrind ;;
    bench) ensure_pkgs $PKGS_BUILD $PKGS_DATA $PKGS_BENCH; build_lib; bash tests/bench/run.sh ;;
    install) shift; ensure_pkgs $PKGS_BUILD; cmd_install "$@" ;;
    clean) rm -rf $BUILD ;;
    *) echo "usage: ./build.sh [build|deps|test|gpu|demo|valgrind|bench|install|clean]" >&2; exit 2 ;;
esac
