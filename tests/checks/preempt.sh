# tests/checks/preempt.sh - graceful pre-emption, also under Slurm.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Graceful pre-emption end to end (docs/RELIABILITY.md, "Pre-emption"): an
# uninterrupted 3-rank run's last checkpoint (200 steps), then
# DT_PREEMPT_RUNS (6) runs sent SIGTERM at a random moment of their training: even runs through
# dtrun (the scheduler's signal: dtrun exits 75, and a second run resumes),
# odd runs one random rank's process alone (a node taken back: dtrun
# --max-restarts 1 restarts the job).  Each must stop at one step for all
# ranks (the ranks exit 75 together; a disagreement fails a collective),
# save that step's checkpoint, resume from it and end with the
# uninterrupted run's bytes.  And a sharded (--zero 1) run the same.
preempt_checks() {
    local t=$BUILD/test/preempt fast=$BUILD/test/fashion_mnist_O2 dtrun=$BUILD/test/dtrun
    local args="--epochs 2 --limit-batches 100 --seed 4 --threads 1" runs=${DT_PREEMPT_RUNS:-6} i
    rm -rf "$t"
    mkdir -p "$t"
    for i in ref ref_zero; do
        timeout -k 5 300 $dtrun -n 3 $fast $args $([ $i = ref ] || echo --zero 1) --save "$t/$i/" \
            > "$t/$i.log" 2>&1 || { tail "$t/$i.log"; echo "preempt check: the $i run failed"; exit 1; }
    done
    for ((i = 0; i < runs; i++)); do
        preempt_one "$t" $i "$args" || exit 1
    done
    preempt_one "$t" zero "$args --zero 1" || exit 1
    preempt_grow "$t" || exit 1
    preempt_slurm "$t" "$args" || exit 1
    echo "preempt checks: $runs runs and a sharded one, SIGTERM at a random step: each saved" \
         "one agreed step and resumed to the uninterrupted run's bytes; 2 ranks grew to 3"
}

# The same under Slurm (Debian's slurm-wlm and munge, which ./build.sh test
# installs): a one-node cluster of our own (its config, state and ports
# under $BUILD/test/slurm), the job submitted with sbatch --requeue, and
# requeued mid-training with scontrol requeue, as Slurm's pre-emption
# (PreemptMode=REQUEUE) does: Slurm signals every process of the job, the
# ranks save and exit 75, dtrun exits 75, and Slurm runs the script again,
# which resumes (--resume auto) and ends with the uninterrupted run's bytes.
# (A requeued job waits 120 s before it may start again; the check lets it
# start at once.)
preempt_slurm() {
    local t=$1 args=$2 s=$PWD/$BUILD/test/slurm d=$1/slurm id n state
    if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null || [ "$(id -u)" != 0 ]; then
        skipped "preempt check under Slurm" "no slurm-wlm and munge, or not root"
        return 0
    fi
    rm -rf "$s" && mkdir -p "$s/state" "$s/spool"
    slurm_start "$s" || return 1
    printf '#!/bin/bash\nexec %s -n 3 %s %s --save %s/ --resume auto\n' "$PWD/$BUILD/test/dtrun" \
        "$PWD/$BUILD/test/fashion_mnist_O2" "$args" "$d" > "$s/job.sh"
    chmod +x "$s/job.sh"
    id=$(SLURM_CONF=$s/slurm.conf sbatch --parsable --requeue --open-mode=append -o "$s/job.log" -n 1 "$s/job.sh") ||
        { slurm_stop "$s"; echo "preempt check: sbatch failed"; return 1; }
    for _ in $(seq 600); do grep -q '^\[0\] model ' "$s/job.log" 2>/dev/null && break; sleep 0.1; done
    sleep 0.$((3 + RANDOM % 6))
    SLURM_CONF=$s/slurm.conf scontrol requeue "$id"
    for _ in $(seq 600); do   # pending again (its begin time 120 s away), then done
        state=$(SLURM_CONF=$s/slurm.conf squeue -h -j "$id" -o %T 2>/dev/null || true)
        [ "$state" = PENDING ] && SLURM_CONF=$s/slurm.conf scontrol update jobid="$id" StartTime=now
        grep -q '^\[0\] test accuracy' "$s/job.log" && [ -z "$state" ] && break
        sleep 0.5
    done
    slurm_stop "$s"
    n=$(sed -n 's/^\[0\] pre-empted at step \([0-9]*\) (SIGTERM), checkpoint saved in .*/\1/p' "$s/job.log" | head -1)
    if [ -z "$n" ] || ! grep -q "^dtrun: .*pre-empted: 3 of 3 ranks saved" "$s/job.log" ||
       ! grep -q "^\[0\] resumed from $d/step-$n.safetensors at step $n " "$s/job.log" ||
       ! cmp -s "$t/ref/step-200.safetensors" "$d/step-200.safetensors"; then
        tail -20 "$s/job.log"
        echo "preempt check: under Slurm: pre-empted at step '$n', resumed and ended with the uninterrupted run's bytes? no"
        return 1
    fi
    echo "preempt check: under Slurm (sbatch --requeue, scontrol requeue): pre-empted at step $n, requeued, resumed, the same bytes at step 200"
}

# A one-node Slurm in DIR: munged (if none runs), slurmctld and slurmd on
# ports of their own, as root, no cgroups.
slurm_start() {
    local s=$1 host cpus
    host=$(hostname -s) cpus=$(nproc)
    cat > "$s/slurm.conf" <<EOF2
ClusterName=dtrain
SlurmctldHost=$host
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=dtrain Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF2
    if ! pgrep -x munged > /dev/null; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        [ -f /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        runuser -u munge -- munged || { echo "preempt check: munged did not start"; return 1; }
    fi
    SLURM_CONF=$s/slurm.conf slurmctld && SLURM_CONF=$s/slurm.conf slurmd ||
        { echo "preempt check: the Slurm daemons did not start"; return 1; }
    for _ in $(seq 100); do
        SLURM_CONF=$s/slurm.conf sinfo -h -o %t 2>/dev/null | grep -q idle && return 0
        sleep 0.2
    done
    cat "$s/slurmctld.log" "$s/slurmd.log" | tail -20
    echo "preempt check: the Slurm node never became idle"
    return 1
}

slurm_stop() {
    local f
    for f in "$1/slurmd.pid" "$1/slurmctld.pid"; do
        [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
    done
    return 0
}

# Elastic growth: a 2-rank job (global batch 384) pre-empted as Slurm's
# scancel does (SIGTERM to dtrun and to every rank, so each rank gets it
# twice: the repeat is the same notice) comes back on 3 ranks (a replaced node): it resumes from the step it
# saved, with 128 samples a rank (the same global batch), and ends within
# 0.5 points of the uninterrupted 3-rank run's test accuracy (the reduction
# order differs, so not bit for bit).
preempt_grow() {
    local t=$1 d=$1/grow fast=$BUILD/test/fashion_mnist_O2 n ref got
    local args="--epochs 2 --limit-batches 100 --seed 4 --threads 1 --global-batch 384"
    timeout -k 5 300 $BUILD/test/dtrun -n 3 $fast $args > "$t/grow-ref.log" 2>&1 ||
        { tail "$t/grow-ref.log"; echo "preempt check: the 3-rank growth reference failed"; return 1; }
    timeout -k 5 300 $BUILD/test/dtrun -n 2 $fast $args --save "$d/" --resume auto > "$t/grow.log" 2>&1 &
    local job=$!
    for _ in $(seq 600); do grep -q '^\[0\] model ' "$t/grow.log" && break; sleep 0.1; done
    sleep 0.$((1 + RANDOM % 5))   # of 200 steps (1.5 s here unloaded)
    local dt
    dt=$(children $job | head -1)
    kill -TERM $dt $(children "${dt:-0}")   # as scancel: every process, dtrun passes it on too
    wait $job && { echo "preempt check: the 2-rank growth run was not pre-empted"; return 1; }
    n=$(sed -n 's/^\[0\] pre-empted at step \([0-9]*\) .*/\1/p' "$t/grow.log")
    timeout -k 5 300 $BUILD/test/dtrun -n 3 $fast $args --save "$d/" --resume auto >> "$t/grow.log" 2>&1 ||
        { tail "$t/grow.log"; echo "preempt check: the growth run's resume on 3 ranks failed"; return 1; }
    ref=$(sed -n 's/^\[0\] test accuracy: \([0-9.]*\)%$/\1/p' "$t/grow-ref.log")
    got=$(sed -n 's/^\[0\] test accuracy: \([0-9.]*\)%$/\1/p' "$t/grow.log" | tail -1)
    if [ -z "$n" ] || ! grep -q "^\[0\] resumed from $d/step-$n.safetensors at step $n " "$t/grow.log" ||
       ! grep -q "batch 128 per rank x 3 ranks" "$t/grow.log" ||
       ! awk -v a="$got" -v b="$ref" 'BEGIN { d = a - b; exit !(a != "" && d < 0.5 && d > -0.5) }'; then
        tail -20 "$t/grow.log"
        echo "preempt check: growth: pre-empted at step '$n', accuracy $got% against $ref%"
        return 1
    fi
    echo "preempt check: 2 ranks pre-empted at step $n, resumed on 3 (128 a rank): test accuracy $got%, uninterrupted 3 ranks $ref%"
}

# preempt_one DIR I ARGS: one pre-empted run (I even or "zero": dtrun
# signalled; odd: a rank), checked against DIR/ref (or DIR/ref_zero).
preempt_one() {
    local t=$1 i=$2 args=$3 d=$1/run$2 log=$1/run$2.log ref=$1/ref job dt victim n _ rc=0 ms
    local restarts="" whom=dtrun
    [ "$i" = zero ] && ref=$t/ref_zero
    [[ $i =~ ^[0-9]+$ ]] && [ $((i % 2)) = 1 ] && restarts="--max-restarts 1" whom=rank
    timeout -k 5 300 $BUILD/test/dtrun -n 3 $restarts $BUILD/test/fashion_mnist_O2 $args \
        --save "$d/" --resume auto > "$log" 2>&1 &
    job=$!
    for _ in $(seq 600); do grep -q '^\[0\] model ' "$log" && break; sleep 0.1; done
    ms=$((100 + RANDOM % 800))   # into the 200 steps (2 s here unloaded, longer under load)
    sleep "$((ms / 1000)).$(printf %03d $((ms % 1000)))"
    dt=$(children $job | head -1)
    victim=$dt
    [ $whom = dtrun ] || victim=$(children "${dt:-0}" | shuf -n 1)
    [ -n "$victim" ] && kill -TERM "$victim"
    wait $job || rc=$?
    n=$(sed -n 's/^\[0\] pre-empted at step \([0-9]*\) (SIGTERM), checkpoint saved in .*/\1/p' "$log" | head -1)
    if [ -z "$n" ] || { [ $whom = dtrun ] && [ $rc != 75 ]; } || { [ $whom = rank ] && [ $rc != 0 ]; }; then
        tail -20 "$log"
        echo "preempt check: run $i (SIGTERM to the $whom after $ms ms): exit $rc, pre-empted at step '${n}'"
        return 1
    fi
    if [ $whom = dtrun ]; then   # the scheduler's requeue: the job run again
        timeout -k 5 300 $BUILD/test/dtrun -n 3 $BUILD/test/fashion_mnist_O2 $args --save "$d/" \
            --resume auto >> "$log" 2>&1 || { tail -20 "$log"; echo "preempt check: run $i's resume failed"; return 1; }
    fi
    if ! grep -q "^\[0\] resumed from $d/step-$n\(\.safetensors\)\{0,1\} at step $n " "$log"; then
        tail -20 "$log"
        echo "preempt check: run $i did not resume from its pre-emption's checkpoint (step $n)"
        return 1
    fi
    if [ "$i" = zero ]; then
        for f in "$ref"/step-200/*; do
            cmp -s "$f" "$d/step-200/${f##*/}" ||
                { echo "preempt check: run $i's ${f##*/} differs from the uninterrupted run's"; return 1; }
        done
    elif ! cmp -s "$ref/step-200.safetensors" "$d/step-200.safetensors"; then
        echo "preempt check: run $i (pre-empted at step $n) ends unlike the uninterrupted run"
        return 1
    fi
    echo "preempt check: run $i: SIGTERM to the $whom after $ms ms, pre-empted at step $n, resumed, the same bytes at step 200"
}
