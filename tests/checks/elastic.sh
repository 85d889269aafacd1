# tests/checks/elastic.sh - elastic restarts.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

elastic_checks() {
    local fast=$BUILD/test/fashion_mnist_O2 t=$BUILD/test/elastic ref acc k
    local args="--epochs 3 --limit-batches 150 --seed 5 --threads 1"
    rm -rf "$t" && mkdir -p "$t"
    # shellcheck disable=SC2086
    ref=$(timeout -k 5 300 $BUILD/test/dtrun -n 3 "$fast" $args | tail -1 |
          sed -n 's/.*test accuracy: \([0-9.]*\)%$/\1/p')
    [ -n "$ref" ] || { echo "elastic check: the uninterrupted run printed no accuracy"; exit 1; }
    # shellcheck disable=SC2086
    timeout -k 5 600 $BUILD/test/dtrun -n 3 --max-restarts 2 "$fast" $args --save "$t/ckpt/" \
        --resume auto > "$t/out.log" 2> "$t/err.log" &
    local job=$! killed_at at=()
    for k in 1 2; do
        kill_a_rank $job "$t/ckpt/"
        at[k]=$killed_at
        sleep 1
    done
    wait $job || { echo "elastic check: the job failed:"; tail -5 "$t/err.log" "$t/out.log"; exit 1; }
    for k in 1 2; do   # each restart from the newest checkpoint, not an older one or scratch
        [ -n "${at[k]}" ] && [ "${at[k]}" -ge 0 ] ||
            { echo "elastic check: kill $k found no checkpoint to kill after"; exit 1; }
        resumed_ok "$t/out.log" $k "${at[k]}" $((k == 2)) || exit 1
    done
    acc=$(tail -1 "$t/out.log" | sed -n 's/.*test accuracy: \([0-9.]*\)%$/\1/p')
    grep "restarting the job" "$t/err.log" | sed 's/^/  /'
    grep "resumed from" "$t/out.log" | sed 's/^/  /'
    [ "$(grep -c "restarting the job" "$t/err.log")" = 2 ] ||
        { echo "elastic check: not 2 restarts"; cat "$t/err.log"; exit 1; }
    awk -v a="$acc" -v b="$ref" 'BEGIN { d = a - b; exit !(a != "" && d <= 0.3 && d >= -0.3) }' ||
        { echo "elastic check: $acc% after the restarts, $ref% without: more than 0.3 apart"; exit 1; }
    echo "elastic check: 2 restarts, test accuracy $acc% (uninterrupted: $ref%)"
    # --min-ranks 2: rank 2 of 3 cannot run again after the first kill (a
    # wrapper fails it whenever DTRAIN_RESTART > 0 and there are 3 ranks), so
    # after failing first twice it is left out; 2 ranks finish with the
    # same global batch of 384 (192 each) and must end within 0.3 points
    # of the uninterrupted 3-rank run.
    args="$args --global-batch 384"
    # shellcheck disable=SC2086
    ref=$(timeout -k 5 300 $BUILD/test/dtrun -n 3 "$fast" $args | tail -1 |
          sed -n 's/.*test accuracy: \([0-9.]*\)%$/\1/p')
    [ -n "$ref" ] || { echo "elastic check: the global-batch run printed no accuracy"; exit 1; }
    rm -rf "$t/ckpt"
    local wrap="[ \"\$DTRAIN_RESTART\" != 0 ] && [ \"\$DTRAIN_WORLD_SIZE\" = 3 ] && [ \"\$DTRAIN_RANK\" = 2 ] && exit 9; exec \"\$0\" \"\$@\""
    # shellcheck disable=SC2086
    timeout -k 5 600 $BUILD/test/dtrun -n 3 --max-restarts 3 --min-ranks 2 sh -c "$wrap" "$fast" \
        $args --save "$t/ckpt/" --resume auto > "$t/out2.log" 2> "$t/err2.log" &
    job=$!
    kill_a_rank $job "$t/ckpt/"
    at[1]=$killed_at
    wait $job || { echo "elastic check (min ranks): the job failed:"; tail -5 "$t/err2.log" "$t/out2.log"; exit 1; }
    local last
    last=$(grep -c "restarting the job" "$t/err2.log")
    [ "${at[1]}" -ge 0 ] || { echo "elastic check (min ranks): no checkpoint before the kill"; exit 1; }
    for k in $(seq "$last"); do   # every restart from it (the last one must say so)
        resumed_ok "$t/out2.log" "$k" "${at[1]}" $((k == last)) ||
            { echo "elastic check (min ranks): a restart not from the newest checkpoint"; exit 1; }
    done
    acc=$(tail -1 "$t/out2.log" | sed -n 's/.*test accuracy: \([0-9.]*\)%$/\1/p')
    grep "restarting the job" "$t/err2.log" | sed 's/^/  /'
    grep -q "with one rank fewer" "$t/err2.log" && grep -q "x 2 ranks" "$t/out2.log" ||
        { echo "elastic check: the job did not go on with 2 ranks"; cat "$t/err2.log"; exit 1; }
    awk -v a="$acc" -v b="$ref" 'BEGIN { d = a - b; exit !(a != "" && d <= 0.3 && d >= -0.3) }' ||
        { echo "elastic check: $acc% on 2 ranks after the restarts, $ref% on 3: more than 0.3 apart"; exit 1; }
    echo "elastic check: rank 2 left out, finished on 2 ranks: test accuracy $acc% (3 ranks uninterrupted: $ref%)"
}
