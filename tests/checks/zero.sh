# tests/checks/zero.sh - ZeRO stages 1-3 end to end.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Sharded data parallelism end to end: the Fashion-MNIST MLP on 3 ranks
# (optimized build, one epoch's first 100 batches) reaches DDP's test
# accuracy with --zero 2 and --zero 3 (the same averages, reduce-scattered).
zero_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 out acc ddp z
    for z in 0 2 3; do
        out=$(timeout -k 5 300 "$fast" --ranks 3 --zero $z --epochs 1 --limit-batches 100 --seed 4)
        acc=$(echo "$out" | tail -1 | sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
        [ -n "$acc" ] || { echo "zero check: --zero $z has no accuracy line:"; echo "$out" | tail -5; exit 1; }
        if [ $z = 0 ]; then ddp=$acc
        elif ! awk -v a="$acc" -v b="$ddp" 'BEGIN { exit !(a >= b - 0.1 && a <= b + 0.1) }'; then
            echo "zero check: --zero $z reached $acc%, DDP $ddp%"; exit 1
        fi
        echo "zero check: 3 ranks, --zero $z: test accuracy $acc%"
    done
    # Sharded checkpoints: 3 ranks at zero 3 save after each epoch (every
    # rank its shard); 2 ranks at zero 1 and one process resume from epoch
    # 1's with the same global batch and must end at the uninterrupted
    # run's accuracy (within 0.3 points, as the elastic check allows a new
    # world size; measured: the same to the digit).
    local t=$BUILD/test/zero_ckpt ck ref args="--epochs 2 --limit-batches 50 --global-batch 192 --seed 4"
    rm -rf "$t" && mkdir -p "$t"
    # shellcheck disable=SC2086
    ref=$(timeout -k 5 300 "$fast" --ranks 3 --zero 3 $args --save "$t/" | tail -1 |
          sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
    ck=$t/step-50
    [ -n "$ref" ] && [ -f "$ck/index.json" ] && [ -f "$ck/shard-00002-of-00003.safetensors" ] ||
        { echo "zero check: 3 ranks at zero 3 wrote no sharded checkpoint $ck"; ls -R "$t"; exit 1; }
    for z in "--ranks 2 --zero 1" "--ranks 1"; do
        # shellcheck disable=SC2086
        out=$(timeout -k 5 300 "$fast" $z $args --resume "$ck")
        acc=$(echo "$out" | tail -1 | sed -n 's/^test accuracy: \([0-9.]*\)%$/\1/p')
        echo "$out" | grep -q "resumed from $ck at step 50" ||
            { echo "zero check: $z did not resume from $ck:"; echo "$out" | tail -5; exit 1; }
        awk -v a="$acc" -v b="$ref" 'BEGIN { d = a - b; exit !(a != "" && d <= 0.3 && d >= -0.3) }' ||
            { echo "zero check: $z resumed reached $acc%, uninterrupted $ref%"; exit 1; }
        echo "zero check: saved by 3 ranks at zero 3, resumed with $z: $acc% (uninterrupted $ref%)"
    done
    # Elastic restart of a sharded job: once epoch 1's sharded checkpoint is
    # whole (its index written), a rank is killed; dtrun restarts the job,
    # which resumes from it (--resume auto: dt_checkpoint_latest lists it).
    local el=$t/elastic job dtrun_pid victim
    mkdir -p "$el"
    # shellcheck disable=SC2086
    timeout -k 5 300 $BUILD/test/dtrun -n 3 --max-restarts 1 "$fast" --zero 3 $args \
        --save "$el/ckpt/" --resume auto > "$el/out.log" 2> "$el/err.log" &
    job=$!
    for _ in $(seq 600); do [ -f "$el/ckpt/step-50/index.json" ] && break; sleep 0.1; done
    dtrun_pid=$(children $job | head -1)
    victim=$(children "${dtrun_pid:-0}" | head -1)
    [ -n "$victim" ] && kill -9 "$victim"
    wait $job || { echo "zero check: the restarted sharded job failed:"; tail -5 "$el/err.log" "$el/out.log"; exit 1; }
    grep -q "restarting the job" "$el/err.log" && grep -q "resumed from $el/ckpt/step-" "$el/out.log" ||
        { echo "zero check: the sharded job did not restart from its checkpoint:"; tail -5 "$el/err.log" "$el/out.log"; exit 1; }
    acc=$(tail -1 "$el/out.log" | sed -n 's/.*test accuracy: \([0-9.]*\)%$/\1/p')
    awk -v a="$acc" -v b="$ref" 'BEGIN { d = a - b; exit !(a != "" && d <= 0.3 && d >= -0.3) }' ||
        { echo "zero check: the restarted sharded job reached $acc%, uninterrupted $ref%"; exit 1; }
    echo "zero check: a rank of a zero 3 job killed; $(grep -o "resumed from [^ ]* at step [0-9]*" "$el/out.log" | head -1)," \
         "test accuracy $acc% (uninterrupted $ref%)"
}
