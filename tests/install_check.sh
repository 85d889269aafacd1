#!/usr/bin/env bash
# tests/install_check.sh [PREFIX] - the installed library, as a user gets it.
#
# `./build.sh install PREFIX` (default PREFIX: a new temporary directory,
# removed afterwards), then:
#  1. tests/embed/kernels.c is built against PREFIX with pkg-config, linked
#     to the shared and to the static library;
#  2. the CPU kernels' level the library takes (its DTRAIN_LOG line "dtrain:
#     cpu kernels: LEVEL") is the best this CPU has, by __builtin_cpu_supports
#     (the program's "cpu supports: LEVEL");
#  3. every level up to that one (DTRAIN_CPU_KERNELS) gives the same losses
#     and parameters, bit for bit, and so does the static build;
#  4. libdtrain.so holds no instruction beyond baseline x86-64 (SSE2) outside
#     the kernels' *_avx2 / *_avx512 copies, and those copies use ymm / zmm;
#  5. where qemu-x86_64 is installed (Debian's qemu-user), the program runs
#     on emulated CPUs without AVX-512 (Haswell: avx2) and without AVX at
#     all (Nehalem: baseline) and takes those levels.
# Prints one summary line; exits 1 at the first failure.  About 3 s when
# build/portable is current, 15-40 s on 2 cores when the library must be
# compiled first.
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC:-gcc}
fail() { echo "install check: $*"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=${1:-$work/prefix}   # (a PREFIX given stays)
./build.sh install "$prefix" > "$work/install.log" 2>&1 ||
    { cat "$work/install.log"; fail "./build.sh install $prefix failed"; }

# 1. the program, against the installed header and libraries
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
prog=tests/embed/kernels.c
# shellcheck disable=SC2046
$CC -std=c11 -Wall -Wextra -Werror "$prog" $(pkg-config --cflags --libs dtrain) \
    -o "$work/kernels" || fail "$prog does not build with pkg-config (shared)"
# shellcheck disable=SC2046
$CC -std=c11 -Wall -Wextra -Werror "$prog" $(pkg-config --cflags dtrain) "$prefix/lib/libdtrain.a" \
    $(pkg-config --libs --static dtrain | sed 's/-ldtrain//') -o "$work/kernels_static" ||
    fail "$prog does not build with pkg-config (static)"
nm "$work/kernels" | grep -q ' U dt_ctx_new' || fail "the shared build did not link libdtrain.so"

# run [ENV...] BINARY: its stdout, its stderr's "cpu kernels" level
run() {
    env LD_LIBRARY_PATH="$prefix/lib" DTRAIN_LOG=1 OPENBLAS_NUM_THREADS=1 "$@" \
        > "$work/out" 2> "$work/err" || { cat "$work/err"; fail "$* failed"; }
    level=$(sed -n 's/^dtrain: cpu kernels: \([a-z0-9]*\) .*/\1/p' "$work/err")
    [ -n "$level" ] || { cat "$work/err"; fail "$*: no 'dtrain: cpu kernels' line"; }
}

# 2. the level taken is the best the CPU has
run "$work/kernels"
best=$(sed -n 's/^cpu supports: //p' "$work/out")
[ "$level" = "$best" ] || fail "the library took '$level'; this CPU supports '$best'"
grep -v '^cpu supports' "$work/out" > "$work/want"
grep -q '^params: ' "$work/want" || fail "the program printed no parameter hash"

# 3. the same bits at every level up to it, and from the static library
levels=""
for l in baseline avx2 avx512; do
    run DTRAIN_CPU_KERNELS=$l "$work/kernels"
    [ "$level" = "$l" ] || fail "DTRAIN_CPU_KERNELS=$l took '$level'"
    grep -v '^cpu supports' "$work/out" | cmp -s - "$work/want" ||
        { diff <(grep -v '^cpu supports' "$work/out") "$work/want"; fail "level $l gives other bits than $best"; }
    levels="$levels $l"
    [ "$l" != "$best" ] || break
done
run "$work/kernels_static"
grep -v '^cpu supports' "$work/out" | cmp -s - "$work/want" || fail "the static build gives other bits"

# 4. no instruction beyond SSE2 outside the per-level copies: no VEX/EVEX
# (v...), no ymm/zmm/mask registers, none of SSE3-4.2's, POPCNT's, LZCNT's,
# BMI's or MOVBE's mnemonics (TZCNT is left out: it runs as BSF on older
# CPUs, and GCC emits it for any x86-64)
so=$(readlink -f "$prefix/lib/libdtrain.so")
objdump -d --no-show-raw-insn "$so" > "$work/dis" || fail "objdump $so failed"
awk '
    /^[0-9a-f]+ <.*>:$/ { fn = $2; copy = fn ~ /_avx(2|512)[>.]/; if (copy) copies[fn] = 1; next }
    NF < 2 { next }
    {
        line = $0; sub(/^[ \t]*[0-9a-f]+:[ \t]*/, "", line); split(line, w, /[ \t]+/); op = w[1]
        wide = line ~ /%[yz]mm[0-9]|%k[0-7]([^0-9]|$)/
        if (copy) { if (wide) nwide++; next }
        if ((op ~ /^v/ && op !~ /^ver[rw]/) || wide ||
            op ~ /^(addsubp[sd]|h(add|sub)p[sd]|movs[hl]dup|movddup|lddqu|pshufb|ph(add|sub)(sw|w|d)|pmaddubsw|pmulhrsw|psign[bwd]|pabs[bwd]|palignr|ptest|pblendw|pblendvb|blendv?p[sd]|dpp[sd]|extractps|insertps|pextr[bdq]|pinsr[bdq]|pmuldq|pmulld|pmin(sb|sd|uw|ud)|pmax(sb|sd|uw|ud)|pmov[sz]x[bwd][wdq]|packusdw|pcmp(eq|gt)q|pcmp[ei]str[im]|round[ps][sd]|mpsadbw|phminposuw|movntdqa|crc32[bwlq]?|(popcnt|lzcnt|andn|bextr|blsi|blsmsk|blsr|bzhi|pdep|pext|rorx|sarx|shlx|shrx|mulx|movbe)[wlq]?)$/) {
            print fn, line; bad++
        }
    }
    END { n = 0; for (f in copies) n++; print "copies", n, "wide", nwide + 0 > "/dev/stderr"; exit bad > 0 }
' "$work/dis" > "$work/beyond" 2> "$work/copies" ||
    { head -20 "$work/beyond"; fail "$so: instructions beyond baseline x86-64 outside the *_avx2/*_avx512 copies"; }
read -r _ ncopies _ nwide < "$work/copies"
if [ "$ncopies" -lt 2 ] || [ "$nwide" -eq 0 ]; then
    fail "$so: $ncopies *_avx2/*_avx512 copies with $nwide ymm/zmm instructions: no dispatched kernels?"
fi

# 5. emulated CPUs without AVX-512 and without AVX
emulated="no qemu-x86_64: emulated CPUs not run"
if command -v qemu-x86_64 > /dev/null; then
    emulated=""
    for cpu in Haswell:avx2 Nehalem:baseline; do
        # OpenBLAS's own detection can see the host through qemu (on an AMD
        # EPYC host it took Haswell kernels under -cpu Nehalem: SIGILL in
        # sgemm_beta_HASWELL); its documented override names the model
        run OPENBLAS_CORETYPE="${cpu%:*}" qemu-x86_64 -cpu "${cpu%:*}" "$work/kernels"
        if [ "$level" != "${cpu#*:}" ] || ! grep -q "^cpu supports: ${cpu#*:}$" "$work/out"; then
            fail "under qemu -cpu ${cpu%:*}: took '$level', expected '${cpu#*:}'"
        fi
        emulated="$emulated${emulated:+, }qemu ${cpu%:*} took ${cpu#*:}"
    done
fi
echo "install check: $prefix: pkg-config shared and static builds run; cpu kernels $best," \
     "as __builtin_cpu_supports says; levels$levels give the same bits;" \
     "libdtrain.so baseline x86-64 outside $ncopies per-level copies ($nwide ymm/zmm instructions);" \
     "$emulated"
