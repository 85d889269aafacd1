# tests/checks/embed.sh - vendoring the two files.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Embedding end to end.  Vendoring: dtrain.h and dtrain.c alone copied into
# an empty directory with a program, compiled with one cc line, CPU-only
# without libfabric and with it (and with backends/cuda.cu as a third file
# where nvcc is, run on the CPU); a vendored AddressSanitizer build's report
# names the src/ and backends/ lines (#line directives), the very line of the
# copy.  Installing: the program built with `pkg-config --cflags --libs
# dtrain` against a fresh prefix, shared and static.  And the shared library
# exports dt_ symbols only, under a soname carrying the major version.
embed_checks() {
    local dir out out_so bad line cmds
    dir=$(mktemp -d)
    cp dtrain.h dtrain.c tests/embed/vendored.c tests/embed/overflow.c "$dir/"
    cmds="cd $dir && $CC $WARN -O2 -DDT_WITH_CPU vendored.c dtrain.c -lopenblas -lz -lm -lpthread -o v_cpu
cd $dir && $CC $WARN -O2 -DDT_WITH_CPU -DDT_WITH_FABRIC vendored.c dtrain.c -lopenblas -lfabric -lz -lm -lpthread -o v_fab
cd $dir && $CC $WARN -O0 -g -fsanitize=address -DDT_WITH_CPU overflow.c dtrain.c -lopenblas -lz -lm -lpthread -o v_asan"
    if [ -n "$CUDA_OBJ" ]; then
        mkdir "$dir/gpu"
        cp dtrain.h dtrain.c backends/cuda.cu tests/embed/vendored.c "$dir/gpu/"
        cmds="$cmds
cd $dir/gpu && $NVCC -std=c++17 -O1 -Werror all-warnings -gencode arch=compute_90,code=sm_90 -DDT_WITH_CUDA -c cuda.cu -o cuda.o && $CC $WARN -O0 -DDT_WITH_CPU -DDT_WITH_CUDA vendored.c dtrain.c cuda.o -lopenblas -lz -lm -lpthread $CUDA_LIBS -o v_cuda"
    fi
    echo "$cmds" | run_parallel || { echo "embed check: a vendored build did not compile"; exit 1; }
    (cd "$dir" && ./v_cpu) || { echo "embed check: the CPU-only vendored build failed"; exit 1; }
    (cd "$dir" && ./v_fab) || { echo "embed check: the vendored build with libfabric failed"; exit 1; }
    [ -z "$CUDA_OBJ" ] || (cd "$dir/gpu" && ./v_cuda) ||
        { echo "embed check: the vendored build with backends/cuda.cu failed"; exit 1; }
    # the report's frames: the backend's copy, then dt_tensor_set at its to_device call
    out=$( (cd "$dir" && ASAN_OPTIONS=detect_leaks=0 ./v_asan) 2>&1) &&
        { echo "embed check: the vendored ASan build missed a heap overflow"; exit 1; }
    line=$(awk '/^dt_status dt_tensor_set\(/ { f = 1 } f && /be->to_device\(ctx->be, t->data, host, bytes\)/ { print NR; exit }' src/tensor.c)
    if ! echo "$out" | grep -q "in dt_tensor_set src/tensor.c:$line\$" ||
       ! echo "$out" | grep -q "in cpu_[a-z_]* backends/cpu.c:[0-9]*\$"; then
        echo "$out" | head -12
        echo "embed check: the ASan report does not name src/tensor.c:$line and backends/cpu.c"; exit 1
    fi
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
    echo "embed checks: vendored, two files (cpu; cpu + libfabric${CUDA_OBJ:+; + backends/cuda.cu}),"
    echo "  ASan names src/tensor.c:$line, pkg-config (shared; static), soname $out_so,"
    echo "  csv_regress: $(echo "$out" | tail -1): ok"
}
