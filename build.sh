#!/usr/bin/env bash
# build.sh - build, test and demo dtrain.
#
#   ./build.sh            static + shared library and examples into build/
#   ./build.sh deps       install the Debian packages dtrain needs (as root),
#                         otherwise print the exact apt-get line
#   ./build.sh test       AddressSanitizer + UBSan build, run every test: the
#                         checks and the cmocka suite's 4 shards side by side,
#                         DT_JOBS at once (default 2 per core; logs in
#                         build/test/logs/); DT_BUILD_ONLY=1: build, run nothing
#   ./build.sh quick      the same build, then the cmocka suite alone (the edit
#                         loop; one test: DT_TEST_GROUPS=comm DT_TEST_ONLY=
#                         test_mismatch build/test/dtrain_tests)
#   ./build.sh stress     the comm and ddp groups (collectives, DDP, the
#                         parameter server) 30 times, 2 at once, beside a
#                         CPU hog per core: timing flakes show here
#                         (DT_STRESS_REPS, _GROUPS, _ONLY, _AT_ONCE, _HOGS)
#   ./build.sh amalgamate write dtrain.c from the modules in src/ (commit it;
#                         `test` fails when it is stale)
#   ./build.sh gpu        the GPU checks alone (cuda group, suites on cuda,
#                         the CNN on the GPU); DT_PREBUILT=1 skips the build
#   ./build.sh demo       the main job: the Fashion-MNIST CNN on 2 local ranks
#                         (DDP over shm); DT_EPOCHS, DT_RANKS to change it
#   ./build.sh valgrind   a short training run under valgrind's leak checker
#   ./build.sh bench      benchmarks against PyTorch (tests/bench/run.sh)
#   ./build.sh fuzz [S]   every libFuzzer harness of tests/fuzz/ for S seconds
#                         (default 60; clang), from its corpus
#   ./build.sh install PREFIX   the header, both libraries and dtrain.pc
#                         (pkg-config) under PREFIX (default /usr/local),
#                         built for any x86-64 into build/portable (the
#                         CPU kernels pick AVX2 / AVX-512 code at run time)
#   ./build.sh python     what `pip install ./bindings/python` ships, built
#                         for any x86-64 into build/portable: libdtrain.so
#                         and the dtrun launcher (and Debian's python3-venv,
#                         -numpy, -setuptools and -wheel, which pip needs
#                         without PyPI)
#   ./build.sh clean
#
# Environment: CC (default gcc), DT_NATIVE=0 to build without -march=native,
# DT_CUDA=0 to leave the CUDA backend out even where nvcc is found.
set -euo pipefail
cd "$(dirname "$0")"

CC=${CC:-gcc}
BUILD=build
# The core's modules (src/NAME.c), bottom layer first: src/modules.txt, the
# one list (the order of the generated dtrain.c; the layers tests/layers.py
# checks and docs/DESIGN.md describes).
SRC_MODULES=$(awk '$1 ~ /^[0-9]+$/ { printf "%s ", $2 }' src/modules.txt)
WARN="-std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror"
if [ "${DT_NATIVE:-1}" = 1 ]; then ARCH="-march=native"; else ARCH=""; fi
# The installed library must run on any CPU of its architecture: the
# baseline ISA (x86-64: SSE2), AVX2 and AVX-512 code chosen at run time by
# backends/cpu.c's dispatch, and by OpenBLAS for its own kernels.
case "$(uname -m)" in
    x86_64) PORTABLE_ARCH="-march=x86-64 -mtune=generic" ;;
    *) PORTABLE_ARCH="" ;;
esac
# -ffp-contract=off (also GCC's default under -std=c11): no a*b+c fused
# where the ISA has FMA, so every ISA's code rounds the same and a run is
# bit-identical on the native and the portable build.  -fno-trapping-math:
# nothing in dtrain reads the floating-point exception flags, and without it
# GCC leaves the exp/tanh loops (GELU, softmax) scalar below AVX-512, 3x
# slower in SSE2; the values computed are the same.
FPFLAGS="-fno-math-errno -ffp-contract=off -fno-trapping-math"
OPT="-O3 $ARCH $FPFLAGS"
LIBS="-lopenblas -lfabric -lmicrohttpd -lz -lm -lpthread"
# The library is dtrain.c alone: the amalgamation carries the backends, each
# compiled in by its macro (src/amalgamate.awk), as a vendored build is.
CORE_SRC="dtrain.c"
DEFS="-DDT_WITH_CPU -DDT_WITH_FABRIC -DDT_WITH_HTTP"
CPU_DEFS=$DEFS CPU_LIBS=$LIBS   # builds that leave CUDA out (valgrind)

# The CUDA backend is compiled whenever nvcc is found (CI always has the
# toolkit, not always a GPU).  The library and the programs linking it keep
# it out: it is build/libdtrain_cuda.so, which the core loads when a
# context asks for "cuda" (src/context.c), so CPU programs never map cuBLAS.
# The development build (the unit suite, the sanitized examples) compiles
# it in instead (-DDT_WITH_CUDA, DEV_DEFS / DEV_LIBS), as a vendored build
# can.  Without nvcc the build is CPU-only.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
CUDA_OBJ="" CUDA_PLUGIN=""
DEV_DEFS=$DEFS DEV_LIBS=$LIBS
CUDA_LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublas -lcudart -lstdc++"
if [ "${DT_CUDA:-1}" = 1 ] && [ -x "$NVCC" ]; then
    DEV_DEFS="$DEFS -DDT_WITH_CUDA"
    DEV_LIBS="$LIBS $CUDA_LIBS"
    CUDA_OBJ=$BUILD/obj/cuda.o
    CUDA_PLUGIN=$BUILD/libdtrain_cuda.so
fi
# A100 and H100 binaries, and PTX the driver can compile for newer GPUs.
CUDA_ARCH="-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
           -gencode arch=compute_90,code=compute_90"

# The checks ./build.sh test runs, one file per group (tests/checks/*.sh):
# functions that run_checks starts side by side.
for f in tests/checks/*.sh; do
    . "$f"
done

# backends/cuda.cu -> $CUDA_OBJ and the loadable $CUDA_PLUGIN (which
# exports dt_backend_cuda_iface alone), each rebuilt only when stale
build_cuda() {
    [ -n "$CUDA_OBJ" ] || return 0
    local BUILD=${CUDA_PLUGIN%/*}   # build/, also when the portable library is built
    mkdir -p $BUILD/obj $BUILD/test
    if stale "$CUDA_OBJ" backends/cuda.cu backends/backend.h backends/shape.h backends/half.h dtrain.h; then
        echo "build.sh: compiling the CUDA backend ($NVCC)"
        "$NVCC" -std=c++17 -O3 -Xcompiler -fPIC,-Wall,-Wextra -Werror all-warnings $CUDA_ARCH \
            -DDT_WITH_CUDA -I. -c backends/cuda.cu -o "$CUDA_OBJ"
    fi
    if stale "$CUDA_PLUGIN" "$CUDA_OBJ"; then
        printf '{\n  global: dt_backend_cuda_iface;\n  local: *;\n};\n' > $BUILD/cuda.map
        $CC -shared -Wl,--version-script=$BUILD/cuda.map "$CUDA_OBJ" $CUDA_LIBS -o "$CUDA_PLUGIN"
    fi
    # programs in build/test find it beside them (src/context.c, load_cuda_plugin)
    ln -sf ../libdtrain_cuda.so $BUILD/test/libdtrain_cuda.so
}

# dtrain.c, generated from src/ and backends/ (SQLite's amalgamation, with
# #line directives): src/amalgamate.awk says how.  To stdout.
amalgamate() {
    awk -v modules="$(echo $SRC_MODULES)" -v version="$(dt_version)" -f src/amalgamate.awk
}

# src/monitor_page.h, generated from src/monitor_page.html: the page as the
# C string mon_page, a literal per line (\ " and ? escaped: ?? would be a
# trigraph in C11).
page_header() {
    printf '/* GENERATED by `./build.sh amalgamate` from src/monitor_page.html: do not edit */\n'
    printf 'static const char mon_page[] =\n'
    sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/?/\\?/g' -e 's/^/    "/' -e 's/$/\\n"/' \
        src/monitor_page.html
    printf '    ;\n'
}

cmd_amalgamate() {
    page_header > src/monitor_page.h.tmp
    if cmp -s src/monitor_page.h.tmp src/monitor_page.h; then
        rm src/monitor_page.h.tmp
    else
        mv src/monitor_page.h.tmp src/monitor_page.h
    fi
    amalgamate > dtrain.c.tmp
    if cmp -s dtrain.c.tmp dtrain.c; then   # unchanged: keep its time, so nothing rebuilds
        rm dtrain.c.tmp
        echo "build.sh: dtrain.c is already what src/ makes"
    else
        mv dtrain.c.tmp dtrain.c
        echo "build.sh: wrote dtrain.c ($(wc -l < dtrain.c) lines) from src/"
    fi
}

# ./build.sh test fails when the committed dtrain.c is not what src/ makes.
amalgamation_check() {
    page_header | cmp -s - src/monitor_page.h ||
        { echo "amalgamation check: src/monitor_page.h is stale: run ./build.sh amalgamate"; exit 1; }
    amalgamate > $BUILD/dtrain.c.gen
    if ! cmp -s $BUILD/dtrain.c.gen dtrain.c; then
        diff -u dtrain.c $BUILD/dtrain.c.gen | head -20
        echo "amalgamation check: dtrain.c is stale: run ./build.sh amalgamate and commit it"
        exit 1
    fi
    echo "amalgamation check: dtrain.c is what src/ makes"
}

# Debian packages (tests/packages.sh; why each is here: docs/DEPENDENCIES.md),
# for the commands that set a machine up.
packages() { bash tests/packages.sh "$@"; }

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
    echo "$CC $WARN $OPT $DEFS -fPIC -I. -c dtrain.c -o $BUILD/obj/dtrain.o"
    echo "$CC $WARN -O1 -I. -c dtrain.c -o $BUILD/obj/core_only.o"
}

# The library is current when it was built with these flags after every
# source and header last changed.
LIB_STAMP=$BUILD/obj/lib.stamp
lib_is_current() {
    local f
    [ -f "$LIB_STAMP" ] && [ -f $BUILD/libdtrain.so ] && [ -f $BUILD/libdtrain.a ] || return 1
    [ "$(cat "$LIB_STAMP")" = "$CC $WARN $OPT $DEFS $LIBS" ] || return 1
    for f in $CORE_SRC dtrain.h; do
        [ "$f" -nt "$LIB_STAMP" ] && return 1
    done
    return 0
}

link_lib() {
    local objs="$BUILD/obj/dtrain.o"
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
    build_cuda &
    local nv=$!
    lib_is_current || lib_compile_cmds | run_parallel
    wait $nv
    lib_is_current || link_lib
}

# The library as installed: build_lib for the baseline ISA into
# build/portable, beside (not over) the development build in build/.  The
# CUDA plugin is the same in both: it stays in build/.
build_portable_lib() {
    local BUILD=$BUILD/portable OPT="-O3 $PORTABLE_ARCH $FPFLAGS"
    local LIB_STAMP=$BUILD/obj/lib.stamp
    build_lib
}

# (only those older than their source or the library: checks running at
# once must not relink a program another is running)
build_examples() {
    local f out
    for f in examples/*.c; do
        out=$BUILD/$(basename "${f%.c}")
        stale "$out" "$f" examples/*.h dtrain.h $BUILD/libdtrain.a || continue
        $CC $WARN $OPT -I. "$f" $BUILD/libdtrain.a $LIBS -o "$out.tmp" && mv "$out.tmp" "$out"
    done
}

# ./build.sh python: the portable library and dtrun, which
# bindings/python/setup.py puts into the wheel (dtrun as the `dtrun` command).
cmd_python() {
    packages build python
    local t0=$SECONDS
    echo "build.sh: building libdtrain.so and dtrun for any x86-64 into $BUILD/portable" \
        "(a minute or two on 2 cores the first time)"
    build_portable_dtrun
    echo "build.sh: built $BUILD/portable/libdtrain.so and $BUILD/portable/dtrun in $((SECONDS - t0)) s"
}

build_portable_dtrun() {
    build_portable_lib
    local BUILD=$BUILD/portable OPT="-O3 $PORTABLE_ARCH $FPFLAGS"
    [ $BUILD/dtrun -nt $BUILD/libdtrain.a ] && [ $BUILD/dtrun -nt examples/dtrun.c ] ||
        $CC $WARN $OPT -I. examples/dtrun.c $BUILD/libdtrain.a $LIBS -o $BUILD/dtrun
}

cmd_build() {
    build_lib
    build_examples
    echo "build.sh: built $BUILD/libdtrain.a, $BUILD/libdtrain.so and examples"
}

# The core and DDP suites again on cpu-staged: the CPU kernels behind a
# device's memory rules (nothing read in place, copies that happen only when
# waited for), so the paths a GPU takes through the core run here too.

# ./build.sh gpu: the GPU's share of `test` alone: the cuda group of the
# unit suite, then gpu_checks.  Builds the sanitized programs first, unless
# DT_PREBUILT=1 (programs built elsewhere by `./build.sh test` or
# `DT_BUILD_ONLY=1 ./build.sh test`, copied with the tree).
cmd_gpu() {
    local san="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    if [ "${DT_PREBUILT:-0}" != 1 ]; then
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

# ./build.sh install PREFIX: include/dtrain.h, lib/libdtrain.{a,so*} and
# lib/pkgconfig/dtrain.pc.  Static linking takes `pkg-config --static`.
cmd_install() {
    local prefix=${1:-/usr/local}
    build_portable_lib
    local BUILD=$BUILD/portable   # what is installed from here on
    mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
    cp dtrain.h "$prefix/include/"
    cp $BUILD/libdtrain.a $BUILD/libdtrain.so.$(dt_version) "$prefix/lib/"
    ln -sf libdtrain.so.$(dt_version) "$prefix/lib/libdtrain.so.$(dt_version major)"
    ln -sf libdtrain.so.$(dt_version major) "$prefix/lib/libdtrain.so"
    [ -z "$CUDA_PLUGIN" ] || cp "$CUDA_PLUGIN" "$prefix/lib/"   # loaded on demand, beside it
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

# An object must be compiled again when it is missing or older than any of
# the files after it.
stale() {
    local obj=$1 dep
    shift
    [ -f "$obj" ] || return 0
    for dep in "$@"; do [ "$dep" -nt "$obj" ] && return 0; done
    return 1
}

# Compile commands for what is stale in one object directory: the core's
# modules (src/), the backends, and (with tests=1) the tests and examples,
# all with the flags "$2"; a change of flags empties the directory first.
# Every module includes src/internal.h (the distributed ones also src/dist.h), dtrain.h and the backend headers.
obj_compile_cmds() {
    local dir=$1 flags=$2 tests=${3:-0} m f n hdrs="src/*.h dtrain.h backends/*.h"
    if [ "$(cat "$dir/flags" 2>/dev/null)" != "$flags" ]; then
        rm -f "$dir"/*.o
        echo "$flags" > "$dir/flags"
    fi
    for m in $SRC_MODULES; do   # the long ones first would be nicer; all are short now
        stale "$dir/src_$m.o" "src/$m.c" $hdrs &&
            echo "$CC $flags -I. -c src/$m.c -o $dir/src_$m.o"
    done
    for f in backends/cpu.c backends/fabric.c backends/http.c; do
        stale "$dir/$(basename "${f%.c}").o" "$f" dtrain.h backends/*.h &&
            echo "$CC $flags -I. -c $f -o $dir/$(basename "${f%.c}").o"
    done
    [ "$tests" = 1 ] || return 0
    for f in tests/test_*.c examples/*.c; do
        n=$(basename "${f%.c}")
        stale "$dir/$n.o" "$f" tests/*.h examples/*.h src/*.h dtrain.h backends/*.h &&
            echo "$CC $flags -I. -c $f -o $dir/$n.o"
    done
    return 0
}

# Everything the checks run, on every core, with nvcc alongside, compiled
# again only where stale.  The development build compiles the core as its
# modules (src/*.c, separately and incrementally), sanitized, into the unit
# suite, the examples, the README's program and the sanitized shared library
# the Python binding's tests load (no CUDA: ASan in an interpreter is enough
# to debug).  The library (-O3; the fast example and build_examples link
# it) is compiled from the generated dtrain.c, as a user compiles it.
build_test_programs() {
    local san=$1 o=$BUILD/test/obj py=$BUILD/test/pysan f n tobj="" m core="" pycore=""
    mkdir -p $o $py $BUILD/obj $BUILD/shared
    for m in $SRC_MODULES; do core="$core $o/src_$m.o"; pycore="$pycore $py/src_$m.o"; done
    core="$core $o/cpu.o $o/fabric.o $o/http.o $CUDA_OBJ"
    pycore="$pycore $py/cpu.o $py/fabric.o $py/http.o"
    build_cuda &
    local nv=$!
    {
        lib_is_current || lib_compile_cmds
        obj_compile_cmds $o "$WARN $san $DEV_DEFS" 1
        obj_compile_cmds $py "$WARN $san -fPIC $CPU_DEFS"
        for n in fashion_mnist gpt; do
            if stale $o/${n}_O2.o examples/$n.c examples/*.h dtrain.h; then
                echo "$CC $WARN -O2 $DEFS -I. -c examples/$n.c -o $o/${n}_O2.o"
            fi
        done
    } | run_parallel
    wait $nv
    lib_is_current || link_lib
    for f in tests/test_*.c; do tobj="$tobj $o/$(basename "${f%.c}").o"; done
    $CC $san $core $tobj $DEV_LIBS -lcmocka -o $BUILD/test/dtrain_tests
    for f in examples/*.c; do   # the examples must build too (and stay warning-free)
        n=$(basename "${f%.c}")
        $CC $san $o/$n.o $core $DEV_LIBS -o $BUILD/test/$n
    done
    $CC $o/fashion_mnist_O2.o $BUILD/libdtrain.a $LIBS -o $BUILD/test/fashion_mnist_O2
    $CC $o/gpt_O2.o $BUILD/libdtrain.a $LIBS -o $BUILD/test/gpt_O2
    $CC $san -shared $pycore $CPU_LIBS -o $py/libdtrain.so
}

cmd_fuzz() {
    packages build fuzz
    fuzz_available || { echo "build.sh fuzz: clang cannot build a libFuzzer harness"; exit 1; }
    fuzz_build || exit 1
    fuzz_run "${1:-60}"
}

# run_checks CMD...: every command (a check function, or a command line) in
# the background, at most DT_JOBS at once (default twice the cores: most
# checks wait on processes, sockets and timeouts more than they compute),
# started in the order given (longest first).  Each one's output goes to
# $BUILD/test/logs/N.log and is printed whole when it ends, with its time.
# Returns 1 after all have ended if any failed.
run_checks() {
    local max=${DT_JOBS:-$(( $(nproc) * 2 ))} logs=$BUILD/test/logs failed=0 pid i=0 rc
    local -A name_of=() start_of=() log_of=()
    mkdir -p "$logs"
    for cmd in "$@"; do
        while [ ${#name_of[@]} -ge "$max" ]; do check_reap || failed=1; done
        i=$((i + 1))
        ( eval "$cmd" ) > "$logs/$i.log" 2>&1 < /dev/null &
        name_of[$!]=$cmd
        start_of[$!]=$SECONDS
        log_of[$!]=$logs/$i.log
    done
    while [ ${#name_of[@]} -gt 0 ]; do check_reap || failed=1; done
    return $failed
}

# (run_checks' helper: waits for one check, prints it, forgets it)
check_reap() {
    local pid rc=0 what
    wait -n -p pid || rc=$?
    [ -n "$pid" ] || return 0
    what=${name_of[$pid]}
    cat "${log_of[$pid]}"
    if [ $rc = 0 ]; then
        echo "build.sh: $what: $((SECONDS - start_of[$pid])) s"
    else
        echo "build.sh: $what: FAILED (exit $rc) after $((SECONDS - start_of[$pid])) s"
    fi
    unset "name_of[$pid]" "start_of[$pid]" "log_of[$pid]"
    return $rc
}

# ./build.sh quick: the same build, then only the cmocka suite (its shards
# side by side) and the baseline kernels: the edit loop's check (about 2
# minutes on 2 cores), not a substitute for ./build.sh test.
#
# ./build.sh test: everything is built first (the shared builds too, so no
# two checks ever build the same file at once), then the checks and the
# cmocka suite's shards run side by side (run_checks); the suite's summed
# summary is the last line.  DT_JOBS=1 runs one thing at a time.
cmd_test() {
    packages build data fuzz python ci
    mkdir -p $BUILD/test
    local san="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    local t0=$SECONDS shards=${DT_TEST_SHARDS:-4} k checks=() ok=1
    amalgamation_check
    layer_checks
    build_test_programs "$san"
    build_examples
    build_portable_dtrun
    ! fuzz_available || fuzz_build > $BUILD/fuzz-build.log 2>&1 ||
        { cat $BUILD/fuzz-build.log; echo "fuzz checks: the harnesses did not build"; exit 1; }
    echo "build.sh: compiling the library, the tests, the examples and the fuzzers: $((SECONDS - t0)) s"
    [ "${DT_BUILD_ONLY:-0}" = 0 ] || return 0
    for ((k = 0; k < shards; k++)); do
        checks+=("unit_shard_check $k $shards")
    done
    [ "${DT_QUICK:-0}" = 0 ] || checks+=(baseline_kernels_check)
    [ "${DT_QUICK:-0}" = 1 ] || checks+=(fuzz_checks staged_checks monitor_checks python_checks example_checks ps_checks
             embed_checks "bash tests/args_check.sh $PWD/$BUILD/test" gpt_checks elastic_checks
             multihost_check preempt_checks zero_checks amp_checks pipeline_checks readme_vendoring_checks
             api_doc_checks "bash tests/install_check.sh" launcher_checks makefile_checks
             plugin_checks "readme_example '$san'" gpu_checks baseline_kernels_check)
    rm -rf $BUILD/test/logs
    run_checks "${checks[@]}" || ok=0
    if [ "${DT_QUICK:-0}" = 1 ]; then
        DT_JOBS=1 run_checks "unit_shard_check serial" || ok=0
    else
        DT_JOBS=1 run_checks "unit_shard_check serial" profile_checks || ok=0
    fi
    echo "build.sh: the checks and the suite took $((SECONDS - t0)) s in all"
    unit_summary "$shards" && [ $ok = 1 ]
}

# ./build.sh stress: the distributed groups of the suite (DT_STRESS_GROUPS,
# default comm,ddp: collectives, DDP, the parameter server, ZeRO) again and
# again, DT_STRESS_REPS times (default 30), DT_STRESS_AT_ONCE copies side by
# side (default 2), with DT_STRESS_HOGS busy loops (default one per core)
# taking CPU from them all the while: rare failures of timing (a rank
# descheduled at the wrong moment) show here long before they show in CI.
# DT_STRESS_ONLY=prefix narrows it to some tests (DT_TEST_ONLY).  Each
# repetition's output is $BUILD/stress/rep-N.log; the last line says how
# many failed, and which tests.
cmd_stress() {
    local san="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    local reps=${DT_STRESS_REPS:-30} hogs=${DT_STRESS_HOGS:-$(nproc)} i hog_pids=() failed=0 t0=$SECONDS
    mkdir -p $BUILD/test
    build_test_programs "$san"
    rm -rf $BUILD/stress && mkdir -p $BUILD/stress
    for ((i = 0; i < hogs; i++)); do
        ( trap 'exit 0' TERM; while :; do :; done ) &
        hog_pids+=($!)
    done
    trap 'kill "${hog_pids[@]}" 2>/dev/null' EXIT
    echo "build.sh: stress: $reps repetitions of ${DT_STRESS_GROUPS:-comm,ddp}${DT_STRESS_ONLY:+ ($DT_STRESS_ONLY*)}," \
         "${DT_STRESS_AT_ONCE:-2} at once, beside $hogs CPU hogs"
    local cmds=()
    for ((i = 1; i <= reps; i++)); do cmds+=("stress_rep $i"); done
    DT_JOBS=${DT_STRESS_AT_ONCE:-2} run_checks "${cmds[@]}" > $BUILD/stress/run.log 2>&1 || failed=1
    kill "${hog_pids[@]}" 2>/dev/null; wait "${hog_pids[@]}" 2>/dev/null || true
    trap - EXIT   # (at exit hog_pids, local here, is gone: a bare kill would fail the run)
    local bad
    bad=$(grep -l '^[0-9]* passed, [1-9][0-9]* failed$\|ended without' $BUILD/stress/rep-*.log | wc -l || true)
    grep -h '^\[  FAILED  \] test' $BUILD/stress/rep-*.log 2>/dev/null | sort | uniq -c || true
    echo "build.sh: stress: $reps repetitions in $((SECONDS - t0)) s, $bad failed (logs: $BUILD/stress/)"
    [ $failed = 0 ] && [ "$bad" = 0 ]
}

# (one repetition: the summary line or "ended without" is its log's last)
stress_rep() {
    local log=$BUILD/stress/rep-$1.log
    DT_TEST_GROUPS=${DT_STRESS_GROUPS:-comm,ddp} DT_TEST_ONLY=${DT_STRESS_ONLY:-} unit_shard 0 1 > "$log" 2>&1 ||
        { tail -1 "$log" | grep -q 'passed, .* failed$' || echo "ended without its summary" >> "$log"; return 1; }
}

cmd_demo() {
    packages build data
    build_lib
    build_examples
    local ranks=${DT_RANKS:-2} threads
    threads=$(( $(nproc) / ranks )); [ "$threads" -ge 1 ] || threads=1
    echo "build.sh: training the CNN on Fashion-MNIST: $ranks ranks over shm (DDP), $threads thread(s) each"
    $BUILD/fashion_mnist --model cnn --epochs "${DT_EPOCHS:-6}" --ranks "$ranks" --threads "$threads" "$@"
}

cmd_valgrind() {
    packages build data test
    mkdir -p $BUILD/vg
    $CC $WARN -O1 -g $CPU_DEFS -I. examples/fashion_mnist.c $CORE_SRC $CPU_LIBS -o $BUILD/vg/fashion_mnist
    OPENBLAS_NUM_THREADS=1 valgrind --leak-check=full --show-leak-kinds=definite,indirect,possible \
        --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=3 \
        $BUILD/vg/fashion_mnist --model mlp --epochs 1 --limit-batches 30 --threads 2
}

case "${1:-build}" in
    build) cmd_build ;;
    python) cmd_python ;;
    deps) packages build data test ;;
    test) cmd_test ;;
    quick) DT_QUICK=1 cmd_test ;;
    stress) cmd_stress ;;
    amalgamate) cmd_amalgamate ;;
    gpu) cmd_gpu ;;
    demo) shift; cmd_demo "$@" ;;
    valgrind) cmd_valgrind ;;
    fuzz) shift; cmd_fuzz "$@" ;;
    bench) packages build data bench; build_lib; bash tests/bench/run.sh ;;
    install) shift; cmd_install "$@" ;;
    clean) rm -rf $BUILD ;;
    *) echo "usage: ./build.sh [build|deps|test|quick|stress|amalgamate|gpu|demo|valgrind|bench|fuzz [SECONDS]|install|clean]" >&2; exit 2 ;;
esac
