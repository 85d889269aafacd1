# tests/checks/jobs.sh - helpers for the checks that kill and restart jobs (preempt, elastic).
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Elastic restart (issue 23): Fashion-MNIST DDP on 3 ranks under
# `dtrun --max-restarts 2`, saving a checkpoint per epoch into a directory and
# resuming from the newest complete one (--resume auto).  A random rank is
# killed (SIGKILL) twice, at random moments; the job must finish, say both
# restarts, and end within 0.3 points of the same job run without a kill.
# (never fails: with pipefail an empty answer while the ranks are still
# starting would end the check silently under set -e)
children() { cat /proc/"$1"/task/*/children 2>/dev/null | tr ' ' '\n' | grep . || true; }

# newest_step DIR: the highest N of DIR/step-N.safetensors (-1: none yet).
newest_step() {
    local f n best=-1
    for f in "$1"/step-*.safetensors; do
        [ -e "$f" ] || continue
        n=${f##*/step-}; n=${n%.safetensors}
        [ "$n" -gt "$best" ] && best=$n
    done
    echo "$best"
}

# resumed_ok LOG K STEP [NEED]: LOG's restart K (rank 0's "[0] resumed from
# ... at step N (restart K)") resumed from a checkpoint of step STEP or
# later (the newest there was when its rank was killed), not from scratch;
# a missing line passes (the next kill came before it printed) unless NEED
# is 1.
resumed_ok() {
    local n
    n=$(sed -n "s/^\(\[0\] \)\{0,1\}resumed from .*step-[0-9]*\.safetensors at step \([0-9]*\) (restart $2)$/\2/p" "$1" | tail -1)
    if grep -q "resumed from nothing.*(restart $2)$" "$1"; then
        echo "elastic check: restart $2 started from scratch, though step $3 was saved before the kill"
        return 1
    fi
    if [ -z "$n" ]; then
        [ "${4:-0}" = 1 ] || return 0
        echo "elastic check: restart $2 printed no 'resumed from' line"
        return 1
    fi
    [ "$n" -ge "$3" ] && return 0
    echo "elastic check: restart $2 resumed from step $n, not the newest checkpoint (step $3)"
    return 1
}

# kill_a_rank JOB_PID CKPT_DIR: once CKPT_DIR holds a checkpoint, SIGKILL a
# random rank of the dtrun under JOB_PID; the newest step saved before the
# kill into $killed_at.
kill_a_rank() {
    local job=$1 dir=$2 dtrun_pid victim="" _
    for _ in $(seq 600); do   # the first checkpoint: the end of epoch 1
        [ "$(newest_step "$dir")" -ge 0 ] && break
        sleep 0.1
    done
    sleep "$(awk -v r=$RANDOM 'BEGIN { printf "%.1f", 0.2 + (r % 20) / 10 }')"
    for _ in $(seq 50); do   # the ranks: children of dtrun, the child of timeout
        dtrun_pid=$(children "$job" | head -1)
        victim=$(children "${dtrun_pid:-0}" | shuf -n 1)
        [ -z "$victim" ] || break
        sleep 0.2
    done
    killed_at=$(newest_step "$dir")
    [ -n "$victim" ] && [ "$killed_at" -ge 0 ] && kill -9 "$victim" &&
        echo "elastic check: killed rank process $victim (newest checkpoint then: step $killed_at)"
}
