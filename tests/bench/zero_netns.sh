#!/usr/bin/env bash
# tests/bench/zero_netns.sh - zero 3 across two hosts joined by a shaped
# link: two network namespaces (../shared/tools/netns-cluster.sh, RATE per
# direction, default 1gbit), one rank each, the GPT of examples/gpt (SHAPE,
# default its own 4 layers x 128 channels), DDP and zero 3 (units of
# BUCKET bytes, default 256 KiB, so there is a next unit to prefetch).
# Both run profiled (DTRAIN_PROFILE=1); the table gives rank 0's step time,
# and for zero 3 the all-gathers' time per step and the share of it hidden
# behind compute (the end-of-job report's "sharded parameters" line, from
# dt_ddp_stats.gather_s and gather_exposed_s).
#
#   bash tests/bench/zero_netns.sh         (root; RATE=1gbit STEPS=60; ./build.sh first)

set -uo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=../shared/tools/netns-cluster.sh
RATE=${RATE:-1gbit}
STEPS=${STEPS:-60}
BUCKET=${BUCKET:-262144}
SHAPE=${SHAPE:-"--layers 4 --heads 4 --embd 128 --context 64 --batch 12"}
export NETNS_PREFIX=dtz NETNS_SUBNET=10.81.0
[ -x build/gpt ] || { echo "zero_netns.sh: build/gpt missing: run ./build.sh"; exit 1; }
[ -f "$CLUSTER" ] || { echo "zero_netns.sh: no $CLUSTER beside the repository"; exit 1; }
bash "$CLUSTER" up 2 --rate "$RATE" > /dev/null || { echo "zero_netns.sh: no namespaces here (root?)"; exit 1; }
out=$(mktemp -d)
trap 'bash "$CLUSTER" down > /dev/null 2>&1; rm -rf "$out"' EXIT
A0=$(bash "$CLUSTER" addr 0) A1=$(bash "$CLUSTER" addr 1)

# run NAME ZERO PORT: rank r on host r
run() {
    local name=$1 zero=$2 port=$3 r addr bind pids=()
    for r in 0 1; do
        addr=$A0; [ $r = 1 ] && addr=$A1
        bind=(); [ $r = 0 ] && bind=(DTRAIN_STORE_BIND=$A0)
        # shellcheck disable=SC2086
        timeout -k 5 900 bash "$CLUSTER" exec $r env DTRAIN_RANK=$r DTRAIN_WORLD_SIZE=2 \
            DTRAIN_MASTER=$A0:$port DTRAIN_JOB_TOKEN=zero-netns DTRAIN_HOST=$addr "${bind[@]}" \
            DTRAIN_PROFILE=1 DTRAIN_BUCKET_BYTES=$BUCKET OPENBLAS_NUM_THREADS=1 \
            build/gpt $SHAPE --threads 1 --steps "$STEPS" --eval-every "$STEPS" --eval-batches 1 \
            --sample 0 --zero "$zero" > "$out/$name$r.log" 2>&1 &
        pids+=($!)
    done
    for r in 0 1; do
        wait "${pids[$r]}" || { echo "zero_netns.sh: $name rank $r failed:"; tail -5 "$out/$name$r.log"; exit 1; }
    done
}

run ddp 0 29611
run zero3 3 29612
ms() { sed -n 's/^step [0-9]*: .*, \([0-9.]*\) ms\/step$/\1/p' "$out/$1" | tail -1; }
line=$(grep '^sharded parameters:' "$out/zero30.log")
gather=$(echo "$line" | sed -n 's/.*all-gathers ran \([0-9.]*\) ms per step.*/\1/p')
exposed=$(echo "$line" | sed -n 's/.*(\([0-9.]*\) ms the step waited).*/\1/p')
hidden=$(echo "$line" | sed -n 's/.*, \([0-9]*\)% hidden behind compute.*/\1/p')
echo "2 hosts (network namespaces), $RATE links, 1 rank x 1 thread each; gpt $SHAPE; units of $BUCKET bytes"
printf '%-12s %10s %16s %16s %8s\n' run "ms/step" "gathers ms/step" "exposed ms/step" hidden
printf '%-12s %10s %16s %16s %8s\n' "DDP" "$(ms ddp0.log)" - - -
printf '%-12s %10s %16s %16s %8s\n' "zero 3" "$(ms zero30.log)" "$gather" "$exposed" "${hidden}%"
grep -h '^communication:' "$out/zero30.log" | sed 's/^/# zero 3 /'
