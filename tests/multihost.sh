#!/usr/bin/env bash
# tests/multihost.sh BUILD_DIR - two "hosts" in network namespaces
# (../shared/tools/netns-cluster.sh), one rank each, running
# examples/allreduce: the store binds to rank 0's namespace address, each
# rank binds tcp to its own, and the transport is chosen by itself (tcp,
# because the hosts' names differ).  Prints "multi-host: ok" or
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
common=(env DTRAIN_WORLD_SIZE=2 DTRAIN_MASTER=$A0:$PORT DTRAIN_JOB_TOKEN=multihost-test
        DTRAIN_TIMEOUT_MS=20000 ASAN_OPTIONS=detect_leaks=1)
tmp=$(mktemp -d)
timeout -k 5 60 bash "$CLUSTER" exec 0 "${common[@]}" DTRAIN_RANK=0 DTRAIN_STORE_BIND=$A0 \
    DTRAIN_HOST=$A0 "$BUILD/allreduce" > "$tmp/r0" 2>&1 &
p0=$!
timeout -k 5 60 bash "$CLUSTER" exec 1 "${common[@]}" DTRAIN_RANK=1 DTRAIN_HOST=$A1 \
    "$BUILD/allreduce" > "$tmp/r1" 2>&1 &
p1=$!
wait $p0; r0=$?
wait $p1; r1=$?
ok=1
grep -q "rank 0 of 2 over tcp;ofi_rxm: sums 1 2 1 4" "$tmp/r0" || ok=0
grep -q "rank 1 of 2 over tcp;ofi_rxm: sums 1 2 1 4" "$tmp/r1" || ok=0
if [[ $ok == 1 && $r0 == 0 && $r1 == 0 ]]; then
    echo "multi-host: ok (rank 0 on $A0, rank 1 on $A1, tcp chosen by hostname)"
    rm -rf "$tmp"
    exit 0
fi
echo "multi-host: FAILED (exit codes $r0, $r1)"
echo "--- rank 0:"; cat "$tmp/r0"
echo "--- rank 1:"; cat "$tmp/r1"
rm -rf "$tmp"
exit 1
