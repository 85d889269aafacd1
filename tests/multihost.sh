#!/usr/bin/env bash
# tests/multihost.sh BUILD_DIR - two "hosts" in network namespaces
# (../shared/tools/netns-cluster.sh), two ranks each, running
# examples/allreduce: the store binds to rank 0's namespace address, each
# rank binds tcp to its host's, the transport is chosen by itself (tcp,
# because the hosts' names differ), and the allreduce is hierarchical
# (the host segment inside each namespace, tcp between the leaders).  Prints "multi-host: ok" or
# "multi-host: skipped (reason)"; exits non-zero only on a real failure.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build/test}
CLUSTER=$ROOT/../shared/tools/netns-cluster.sh
export NETNS_PREFIX=dtmh NETNS_SUBNET=10.79.0
if [[ ! -x $CLUSTER && ! -f $CLUSTER ]]; then
    echo "multi-host: skipped (no ../shared/tools/netns-cluster.sh beside the repository)"
    exit 0
fi
out=$(bash "$CLUSTER" up 2 2>&1)
rc=$?
if [[ $rc == 3 ]]; then
    echo "multi-host: skipped (${out##*error: })"
    exit 0
elif [[ $rc != 0 ]]; then
    echo "multi-host: could not create the namespaces: $out"
    exit 1
fi
trap 'bash "$CLUSTER" down >/dev/null 2>&1' EXIT
A0=$(bash "$CLUSTER" addr 0) A1=$(bash "$CLUSTER" addr 1)
PORT=29517
common=(env DTRAIN_WORLD_SIZE=4 DTRAIN_MASTER=$A0:$PORT DTRAIN_JOB_TOKEN=multihost-test
        DTRAIN_TIMEOUT_MS=20000 ASAN_OPTIONS=detect_leaks=1)
tmp=$(mktemp -d)
# ranks 0 and 2 on host 0, 1 and 3 on host 1: each host's ranks are not
# contiguous, and the leaders (0 and 1) allreduce over tcp
pids=()
# start_ranks OUT SECONDS VAR=VALUE... -- PROGRAM ARGS...: ranks 0-3 on their
# hosts, in the background (pids in pids[]), rank r's output in $tmp/OUT$r
start_ranks() {
    local out=$1 secs=$2 r h addr bind env=()
    shift 2
    while [[ $1 != -- ]]; do env+=("$1"); shift; done
    shift
    pids=()
    for r in 0 1 2 3; do
        h=$((r % 2))
        addr=$A0; ((h)) && addr=$A1
        bind=(); ((r == 0)) && bind=(DTRAIN_STORE_BIND=$A0)
        timeout -k 5 "$secs" bash "$CLUSTER" exec $h "${common[@]}" "${env[@]}" DTRAIN_RANK=$r \
            "${bind[@]}" DTRAIN_HOST=$addr "$@" > "$tmp/$out$r" 2>&1 &
        pids+=($!)
    done
}
start_ranks r 60 -- "$BUILD/allreduce"
ok=1 codes=""
for r in 0 1 2 3; do
    wait "${pids[$r]}"; rc=$?
    codes+=" $rc"
    ((rc == 0)) || ok=0
    grep -q "rank $r of 4 over tcp;ofi_rxm: sums 6 4 14 8 (2 hosts; inside a host: segment)" "$tmp/r$r" || ok=0
    grep -q "rank $r: 16 MiB allreduce checked" "$tmp/r$r" || ok=0
done
# data parallelism across the hosts: the example trains a few steps with
# DDP (hierarchical gradient allreduce) and evaluates the test set split
# over the 4 ranks
if [[ $ok == 1 && -x $BUILD/fashion_mnist ]]; then
    start_ranks d 120 DTRAIN_MASTER=$A0:$((PORT + 1)) -- "$BUILD/fashion_mnist" --model mlp \
        --epochs 1 --limit-batches 5 --batch 16
    for r in 0 1 2 3; do
        wait "${pids[$r]}"; rc=$?
        codes+=" ddp:$rc"
        ((rc == 0)) || ok=0
    done
    grep -q "x 4 ranks (DDP over tcp;ofi_rxm)" "$tmp/d0" || ok=0
    grep -Eq "^test accuracy: [0-9]+\.[0-9]{2}%$" "$tmp/d0" || ok=0
fi
# A link goes down: host 1's cable (its port on the switch) is pulled while
# the 4 ranks train with DDP and a 3 s timeout.  Nobody may hang: every rank
# ends with an error within 3 timeouts + 5 s of the cut, and those on host
# 0 say that a rank of host 1 went silent (the tcp connections stay open,
# nothing comes: the silent-peer path, not a closed-connection one).
linkdown=""
if [[ $ok == 1 && -x $BUILD/fashion_mnist ]]; then
    start_ranks l 120 DTRAIN_MASTER=$A0:$((PORT + 2)) DTRAIN_TIMEOUT_MS=3000 -- \
        "$BUILD/fashion_mnist" --model mlp --epochs 3 --batch 16
    sleep 6   # started, and training (its progress lines are buffered: not to wait on)
    ip -n "${NETNS_PREFIX}sw" link set p1 down
    cut=$EPOCHREALTIME
    for r in 0 1 2 3; do
        wait "${pids[$r]}"; rc=$?
        took=$(awk -v a="$EPOCHREALTIME" -v b="$cut" 'BEGIN { printf "%.1f", a - b }')
        codes+=" link:$rc"
        ((rc != 0 && rc != 124 && rc != 137)) || ok=0   # an error, not success or a hang
        linkdown+=$'\n'"  rank $r: exit $rc after $took s: $(grep -m1 '^fashion_mnist:' "$tmp/l$r")"
    done
    awk -v t="$took" 'BEGIN { exit !(t <= 3 * 3 + 5) }' || { ok=0; echo "multi-host: ranks took $took s after the cut"; }
    for r in 0 2; do
        grep -Eq "rank [13].*(sent nothing|is silent)|(rank [13]) (died|is silent)" "$tmp/l$r" || ok=0
    done
fi
if [[ $ok == 1 ]]; then
    echo "multi-host: a link down:$linkdown"
    echo "multi-host: ok (ranks 0,2 on $A0 and 1,3 on $A1: hierarchical allreduce, segment inside each host, tcp between leaders; DDP training and evaluation across them; a link going down)"
    rm -rf "$tmp"
    exit 0
fi
echo "multi-host: FAILED (exit codes$codes)"
for r in 0 1 2 3; do
    echo "--- rank $r:"; cat "$tmp/r$r"
    [[ -f $tmp/d$r ]] && cat "$tmp/d$r"
    [[ -f $tmp/l$r ]] && tail -5 "$tmp/l$r"
done
rm -rf "$tmp"
exit 1
