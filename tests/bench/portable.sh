#!/usr/bin/env bash
# tests/bench/portable.sh - step time of the installed (portable) library
# against the native build, in the same run on the same machine.
#
#   bash tests/bench/portable.sh        (builds what it needs; ~4 minutes)
#
# native:   build/libdtrain.a, compiled with -march=native (`./build.sh`)
# portable: PREFIX/lib/libdtrain.a from `./build.sh install PREFIX` (a
#           temporary prefix): baseline x86-64, the CPU kernels' AVX2 /
#           AVX-512 copies chosen at run time
# baseline: the same portable library with DTRAIN_CPU_KERNELS=baseline,
#           i.e. what a CPU without AVX2 would run of dtrain's own code
#           (OpenBLAS still picks its kernels for this CPU)
# The same program source (tests/bench/bench_train.c, examples/gpt.c) is
# linked against each.  Configs: the Fashion-MNIST MLP and CNN training
# steps of bench_train (synthetic batches, docs/PERFORMANCE.md), and the
# small GPT (4 layers, 4 heads, 128 channels, T 64, B 12, on fortunes).
# Each config runs REPEATS times per side, the sides interleaved; each run
# gives its median ms/step (GPT: mean after 5 warm-up steps); the table
# shows the min and the median of those over the runs, and
# portable/native and baseline/native of each.  Then the kernels one by
# one (bench_kernels.c) at each level.
#
# Environment: REPEATS (3), THREADS ("1 2"), CC (gcc); OTHER=path/libdtrain.a
# adds a side "other" (e.g. an older commit's `DT_NATIVE=0 ./build.sh`
# library, as the install built before it was portable).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT" || exit 1
REPEATS=${REPEATS:-3}
THREADS=${THREADS:-"1 2"}
CC=${CC:-gcc}
OUT=$ROOT/build/bench/portable
mkdir -p "$OUT"
PREFIX=$(mktemp -d)
trap 'rm -rf "$PREFIX"' EXIT

./build.sh build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; echo "portable.sh: build failed"; exit 1; }
./build.sh install "$PREFIX" > "$OUT/install.log" 2>&1 ||
    { tail "$OUT/install.log"; echo "portable.sh: install failed"; exit 1; }
LIBS=$(cat build/libdtrain.ldflags)
SIDES="native portable baseline${OTHER:+ other}"
for side in native portable ${OTHER:+other}; do
    lib=build/libdtrain.a
    [ "$side" != portable ] || lib=$PREFIX/lib/libdtrain.a
    [ "$side" != other ] || lib=$OTHER
    # shellcheck disable=SC2086
    if ! $CC -std=c11 -O2 -I. tests/bench/bench_train.c "$lib" $LIBS -o "$OUT/bench_$side" ||
       ! $CC -std=c11 -D_GNU_SOURCE -O2 -I. examples/gpt.c "$lib" $LIBS -o "$OUT/gpt_$side"; then
        echo "portable.sh: linking the $side programs failed"; exit 1
    fi
done
DTRAIN_LOG=1 "$OUT/gpt_portable" --steps 1 --eval-every 1 --eval-batches 1 --sample 0 2>&1 |
    grep '^dtrain: cpu kernels' | sed 's/^/# portable: /'
grep -m1 'model name' /proc/cpuinfo | sed 's/^model name\s*: /# cpu: /'

GPT="--layers 4 --heads 4 --embd 128 --context 64 --batch 12 --vocab 256 --steps 60 \
     --eval-every 60 --eval-batches 1 --sample 0"

# one_run SIDE CONFIG THREADS: that run's ms/step
# shellcheck disable=SC2086
one_run() {
    local side=$1 cfg=$2 t=$3 bin=$1 env=""
    [ "$side" != baseline ] || { bin=portable; env=DTRAIN_CPU_KERNELS=baseline; }
    case $cfg in
        mlp|cnn) env $env OPENBLAS_NUM_THREADS=1 "$OUT/bench_$bin" --threads "$t" --mode "$cfg" |
                     sed -n "s/^$cfg threads=.* ms=\([0-9.]*\) .*/\1/p" ;;
        gpt) env $env OPENBLAS_NUM_THREADS=1 "$OUT/gpt_$bin" $GPT --threads "$t" |
                 sed -n 's/^step 60: .* \([0-9.]*\) ms\/step$/\1/p' ;;
    esac
}

RES=$OUT/results.txt
: > "$RES"
for t in $THREADS; do
    for _ in $(seq 1 "$REPEATS"); do
        for cfg in mlp cnn gpt; do
            for side in $SIDES; do
                ms=$(one_run "$side" "$cfg" "$t")
                [ -n "$ms" ] || { echo "portable.sh: $side $cfg $t threads gave no time"; exit 1; }
                echo "$cfg $t $side $ms" | tee -a "$RES" | sed 's/^/# /'
            done
        done
    done
done

# min and median over the runs, per config, threads and side
awk -v sides="$SIDES" '
    function stat(k, which,   n, i, j, v, tmp) {
        n = cnt[k]; for (i = 1; i <= n; i++) v[i] = ms[k, i]
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { tmp = v[i]; v[i] = v[j]; v[j] = tmp }
        return which == "min" ? v[1] : (n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2)
    }
    { k = $1 " " $2 " " $3; ms[k, ++cnt[k]] = $4; if (!seen[$1 " " $2]++) order[++n] = $1 " " $2 }
    END {
        ns = split(sides, side, " ")
        head = "| config | threads |"; rule = "|---|---|"
        for (s = 1; s <= ns; s++) { head = head " " side[s] " ms (min / median) |"; rule = rule "---|" }
        for (s = 2; s <= ns; s++) { head = head " " side[s] " / native |"; rule = rule "---|" }
        print head; print rule
        name["mlp"] = "MLP"; name["cnn"] = "CNN"; name["gpt"] = "GPT small"
        for (i = 1; i <= n; i++) {
            split(order[i], c, " ")
            line = "| " name[c[1]] " | " c[2] " |"
            for (s = 1; s <= ns; s++) {
                lo[s] = stat(order[i] " " side[s], "min"); md[s] = stat(order[i] " " side[s], "med")
                line = line sprintf(" %.2f / %.2f |", lo[s], md[s])
            }
            for (s = 2; s <= ns; s++)
                line = line sprintf(s == 2 ? " **%.3f / %.3f** |" : " %.3f / %.3f |", lo[s] / lo[1], md[s] / md[1])
            print line
        }
    }' "$RES"

# The kernels one by one (tests/bench/bench_kernels.c), compiled with each
# library's own flags (their build stamps); the portable one run at each
# level this CPU has.  Microseconds per call, best over the runs.
flags() { sed -n 's/.* -Werror \(.*\) -DDT_WITH_CPU.*/\1/p' "$1"; }
pflags=$(flags build/portable/obj/lib.stamp) nflags=$(flags build/obj/lib.stamp)
if [ -z "$pflags" ] || [ -z "$nflags" ]; then echo "portable.sh: no flags in the build stamps"; exit 1; fi
for side in portable native; do
    f=$pflags
    [ $side = portable ] || f=$nflags
    # shellcheck disable=SC2086
    $CC -std=c11 -D_GNU_SOURCE $f -DDT_WITH_CPU -I. tests/bench/bench_kernels.c -lopenblas -lm \
        -lpthread -o "$OUT/kernels_$side" || { echo "portable.sh: bench_kernels did not build"; exit 1; }
done
KRES=$OUT/kernels.txt
: > "$KRES"
levels=$(DTRAIN_LOG=1 "$OUT/kernels_portable" 2>&1 >/dev/null |
         sed -n 's/.*best on this CPU: \([a-z0-9]*\).*/\1/p')
case $levels in avx512) levels="baseline avx2 avx512" ;; avx2) levels="baseline avx2" ;; *) levels=baseline ;; esac
for _ in $(seq 1 "$REPEATS"); do
    for l in $levels native; do
        if [ "$l" = native ]; then
            OPENBLAS_NUM_THREADS=1 "$OUT/kernels_native"
        else
            DTRAIN_CPU_KERNELS=$l OPENBLAS_NUM_THREADS=1 "$OUT/kernels_portable"
        fi | sed "s/^/$l\t/" >> "$KRES"
    done
done
echo
awk -F'\t' -v cols="$levels native" '
    { k = $2; if (!(k in seen)) { seen[k] = 1; order[++n] = k }
      if (!(($1, k) in best) || $3 < best[$1, k]) best[$1, k] = $3 }
    END {
        nc = split(cols, c, " ")
        head = "| kernel (us per call, 1 thread) |"; rule = "|---|"
        for (i = 1; i <= nc; i++) { head = head " " (c[i] == "native" ? "native build" : "portable, " c[i]) " |"; rule = rule "---|" }
        print head " baseline / best level |"; print rule "---|"
        for (j = 1; j <= n; j++) {
            line = "| " order[j] " |"
            for (i = 1; i <= nc; i++) line = line sprintf(" %.1f |", best[c[i], order[j]])
            print line sprintf(" %.2f |", best["baseline", order[j]] / best[c[nc - 1], order[j]])
        }
    }' "$KRES"
