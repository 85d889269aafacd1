#!/usr/bin/env bash
# tests/bench/zero_fit.sh - a model that does not fit, trained: GPT-2 124M's
# shape (tests/bench/zero.sh's), AdamW, 2 ranks x 1 thread, each rank in a
# memory cgroup of its own limited to LIMIT_MIB (default 2300: between zero
# 3's peak and plain DDP's, docs/PERFORMANCE.md).  Three runs, the loss
# printed side by side at every step:
#   - DDP (zero 0) without a limit: the reference curve;
#   - DDP under the limit: killed by the kernel's OOM killer, or refusing
#     (an allocation that fails is DT_ENOMEM);
#   - zero 3 under the limit: must train, and its losses must be the
#     reference's (the same averages, sharded: docs/DATA_PARALLEL.md).
# Each limited rank's cgroup high-water mark (what the limit sees) is
# printed too.  Needs root and a memory controller: cgroup v2's memory.max
# where /sys/fs/cgroup has one, else v1's memory.limit_in_bytes.
#
#   bash tests/bench/zero_fit.sh            (LIMIT_MIB=2300 STEPS=6; ./build.sh first)
#
# Exits 1 unless DDP fails under the limit and zero 3 trains to the same
# losses (within 1e-3 as printed with 4 decimals).
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT_MIB=${LIMIT_MIB:-2300}
STEPS=${STEPS:-6}
SHAPE="--layers 12 --heads 12 --embd 768 --context 64 --batch 4 --vocab 50257"
ARGS="$SHAPE --threads 1 --steps $STEPS --eval-every 1 --eval-batches 1 --sample 0"
[ -x build/gpt ] && [ -x build/dtrun ] || { echo "zero_fit.sh: build/gpt missing: run ./build.sh"; exit 1; }
out=$(mktemp -d)

# The memory controller: v2 (memory.max, memory.peak) or v1.
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
    root=/sys/fs/cgroup; limit_file=memory.max; peak_file=memory.peak
    echo "+memory" > $root/cgroup.subtree_control 2>/dev/null || true
elif [ -d /sys/fs/cgroup/memory ]; then
    root=/sys/fs/cgroup/memory; limit_file=memory.limit_in_bytes; peak_file=memory.max_usage_in_bytes
else
    echo "zero_fit.sh: no memory cgroup controller here"; exit 1
fi
groups=()
cleanup() {
    for g in "${groups[@]}"; do rmdir "$g" 2>/dev/null || true; done
    rm -rf "$out"
}
trap cleanup EXIT
for r in 0 1; do
    g=$root/dtrain_fit_$$_r$r
    mkdir "$g" || { echo "zero_fit.sh: cannot make cgroup $g (root needed)"; exit 1; }
    groups+=("$g")
    echo $((LIMIT_MIB << 20)) > "$g/$limit_file"
    [ ! -f "$g/memory.swap.max" ] || echo 0 > "$g/memory.swap.max"
    [ ! -f "$g/memory.memsw.limit_in_bytes" ] || echo $((LIMIT_MIB << 20)) > "$g/memory.memsw.limit_in_bytes" 2>/dev/null || true
done

# run NAME LIMITED ZERO: the job under dtrun; limited ranks enter their cgroup first
run() {
    local name=$1 limited=$2 zero=$3 wrap
    wrap='exec "$0" "$@"'
    [ "$limited" = 0 ] || wrap="echo \$\$ > $root/dtrain_fit_$$_r\$DTRAIN_RANK/cgroup.procs && exec \"\$0\" \"\$@\""
    set +e
    # shellcheck disable=SC2086
    OPENBLAS_NUM_THREADS=1 timeout -k 5 900 build/dtrun -n 2 --no-prefix sh -c "$wrap" build/gpt $ARGS --zero "$zero" \
        > "$out/$name.log" 2>&1
    echo $? > "$out/$name.rc"
    set -e
    for r in 0 1; do
        if [ "$limited" != 0 ]; then
            echo $(( $(cat "$root/dtrain_fit_$$_r$r/$peak_file") >> 20 )) > "$out/$name.peak$r"
        fi
    done
}
run ddp_free 0 0
run ddp_limited 1 0
for r in 0 1; do   # a fresh high-water mark for zero 3 (v1: reset by writing; v2: new groups)
    g=$root/dtrain_fit_$$_r$r
    if [ "$peak_file" = memory.max_usage_in_bytes ]; then echo 0 > "$g/$peak_file"
    else rmdir "$g" && mkdir "$g" && echo $((LIMIT_MIB << 20)) > "$g/$limit_file"; fi
done
run zero3_limited 1 3

loss() { sed -n "s/^step $2: train loss \\([0-9.]*\\),.*/\\1/p" "$out/$1.log" | head -1; }
why() {   # how a run ended, in a few words
    local rc; rc=$(cat "$out/$1.rc")
    if [ "$rc" = 0 ]; then echo "trained"
    elif grep -qiE "killed|signal 9|oom" "$out/$1.log"; then echo "killed (exit $rc)"
    elif grep -qiE "out of memory|ENOMEM" "$out/$1.log"; then echo "refused: out of memory (exit $rc)"
    else echo "failed (exit $rc)"; fi
}
echo "GPT-2 124M shape, AdamW, 2 ranks x 1 thread; limit ${LIMIT_MIB} MiB per rank (cgroup $limit_file)"
printf '%-6s %22s %22s %22s\n' step "DDP, no limit" "DDP, limited" "zero 3, limited"
bad=0
for s in $(seq 1 "$STEPS"); do
    a=$(loss ddp_free "$s"); b=$(loss ddp_limited "$s"); c=$(loss zero3_limited "$s")
    printf '%-6s %22s %22s %22s\n' "$s" "${a:--}" "${b:--}" "${c:--}"
    [ -n "$a" ] && [ -n "$c" ] && awk -v a="$a" -v c="$c" 'BEGIN { d = a - c; exit !(d < 1e-3 && d > -1e-3) }' || bad=1
done
printf '%-6s %22s %22s %22s\n' end "$(why ddp_free)" "$(why ddp_limited)" "$(why zero3_limited)"
printf '%-6s %22s %22s %22s\n' "peak" "-" "$(cat "$out/ddp_limited.peak0")/$(cat "$out/ddp_limited.peak1") MiB" \
    "$(cat "$out/zero3_limited.peak0")/$(cat "$out/zero3_limited.peak1") MiB"
echo "(peak: each rank's cgroup high-water mark, rank 0/rank 1; what the limit counts, page cache included)"
echo "DDP, limited, said: $(grep -iE "killed|signal|out of memory|ENOMEM" "$out/ddp_limited.log" | head -2 | tr '\n' ' ')"
if [ "$(cat "$out/ddp_limited.rc")" = 0 ]; then echo "zero_fit.sh: DDP trained under the limit: raise the model or lower LIMIT_MIB"; bad=1; fi
if [ "$bad" != 0 ]; then
    echo "zero_fit.sh: zero 3 did not train to the reference losses under the limit:"
    tail -5 "$out/zero3_limited.log"; exit 1
fi
