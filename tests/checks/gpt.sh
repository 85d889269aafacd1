# tests/checks/gpt.sh - the GPT example: learning bars, PyTorch cross-checks, half precision.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The GPT example (optimized build) on Debian's fortunes: it learns (the
# validation loss after 80 steps well below ln 256 = 5.55 and below its
# first measurement), and 2 DDP ranks of 6 samples (global batches: the
# same 12 samples a step) end 20 steps with the parameters of one process
# of 12, within 1e-5.  That run uses SGD: AdamW's first steps move every
# weight by about lr * sign(g), so where a gradient is near 0 the last-bit
# differences of two summation orders become differences of lr (measured:
# 1.1e-5 after one AdamW step, 1.2e-4 after 20).
# GPT with autocast (--amp) on the CPU, which rounds as a GPU would: fp16
# (with loss scaling) ends within 0.1 of fp32's validation loss at step 80;
# bf16, whose 7-bit mantissa slows a model this small early on (PyTorch's
# CPU autocast too: 3.25 against fp32's 2.74 at step 300, where dtrain's
# gives 2.72 against 2.58), must still learn: 0.2 below the no-context
# floor (gpt_checks; 2.995 measured against fp32's 2.878), within 0.25 of
# fp32 and changed by the rounding (not fp32's number).
gpt_amp_check() {
    local g=$1 fp32=$2 amp out vl
    for amp in fp16 bf16; do
        out=$(OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 80 --eval-every 40 --eval-batches 8 \
              --sample 0 --amp $amp) || { echo "$out" | tail -5; echo "gpt check: --amp $amp failed"; exit 1; }
        vl=$(echo "$out" | sed -n 's/^step 80: .*val loss \([0-9.]*\).*/\1/p')
        [ -n "$vl" ] || { echo "$out" | tail -5; echo "gpt check: --amp $amp: no loss line"; exit 1; }
        if [ $amp = fp16 ]; then
            awk -v a="$vl" -v b="$fp32" 'BEGIN { d = a - b; exit !(d < 0.1 && d > -0.1) }' ||
                { echo "gpt check: fp16 validation loss $vl, fp32's $fp32"; exit 1; }
        else   # below the no-context floor (3.32 nats a byte), near fp32, not fp32 itself
            awk -v a="$vl" -v b="$fp32" -v h="$GPT_H0" \
                'BEGIN { d = a - b; exit !(a < h - 0.2 && d < 0.25 && d > -0.25 && a != b) }' ||
                { echo "gpt check: bf16 validation loss $vl (fp32's $fp32)"; exit 1; }
        fi
        echo "gpt check: autocast $amp: validation loss $vl at step 80 (fp32: $fp32)"
    done
}

# The bars are the text's own floors (tests/text_entropy.py, on the
# held-out tenth: 3.376 nats a byte for the best model without context,
# 2.618 for the best that sees the previous byte).  A model 0.05 below the
# second uses more than the byte before: its attention works.  480 steps
# get there (2.477 measured; 2.64 at step 240).  The half-precision runs,
# 80 steps, must be 0.2 below the first (fp32 is at 2.88 there).
gpt_checks() {
    local g=$BUILD/test/gpt_O2 t=$BUILD/test out first last floors
    floors=$(/usr/bin/python3 tests/text_entropy.py) || { echo "gpt check: no text entropies"; exit 1; }
    GPT_H0=$(echo "$floors" | awk '{print $3}') GPT_H1=$(echo "$floors" | awk '{print $6}')
    echo "gpt check: the text's floors: $floors"
    out=$(OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 480 --eval-every 80 --eval-batches 8 \
          --sample 60) || { echo "$out" | tail -5; echo "gpt check: the run failed"; exit 1; }
    first=$(echo "$out" | sed -n 's/^step 80: .*val loss \([0-9.]*\).*/\1/p')
    last=$(echo "$out" | sed -n 's/^step 480: .*val loss \([0-9.]*\).*/\1/p')
    [ -n "$first" ] && [ -n "$last" ] || { echo "$out" | tail -5; echo "gpt check: no loss lines"; exit 1; }
    awk -v a="$first" -v b="$last" -v h="$GPT_H1" 'BEGIN { exit !(b < a && b < h - 0.05) }' ||
        { echo "gpt check: validation loss $first -> $last: not 0.05 below the previous-byte floor $GPT_H1"; exit 1; }
    echo "gpt check: validation loss $first at step 80, $last at step 480 (previous-byte floor $GPT_H1)"
    gpt_amp_check "$g" "$first"
    OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 20 --eval-every 100 --sample 0 --batch 12 \
        --optim sgd --lr 0.05 --save $t/gpt_1.safetensors > /dev/null ||
        { echo "gpt check: 1-process run failed"; exit 1; }
    OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 20 --eval-every 100 --sample 0 --batch 6 \
        --optim sgd --lr 0.05 --ranks 2 --save $t/gpt_2.safetensors > /dev/null ||
        { echo "gpt check: 2-rank run failed"; exit 1; }
    /usr/bin/python3 tests/compare_safetensors.py $t/gpt_1.safetensors $t/gpt_2.safetensors 1e-5 ||
        { echo "gpt check: 2 ranks differ from 1 process"; exit 1; }
    # sharded (zero 2: optimizer state and gradients; 3: parameters too) ends
    # where DDP does; each rank saves its shard, consolidated into one file
    for z in 2 3; do
        rm -rf $t/gpt_z$z
        OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 20 --eval-every 10 --eval-batches 2 \
            --sample 0 --batch 6 --optim sgd --lr 0.05 --ranks 2 --zero $z \
            --save $t/gpt_z$z > /dev/null || { echo "gpt check: --zero $z run failed"; exit 1; }
        $BUILD/test/consolidate $t/gpt_z$z $t/gpt_z$z.safetensors > /dev/null ||
            { echo "gpt check: --zero $z's sharded checkpoint did not consolidate"; exit 1; }
        /usr/bin/python3 tests/compare_safetensors.py $t/gpt_2.safetensors $t/gpt_z$z.safetensors 1e-6 ||
            { echo "gpt check: --zero $z differs from DDP"; exit 1; }
    done
    gpt_half_checks "$g"
    echo "gpt checks: ok"
}

# bf16 parameters with f32 masters (--params bf16) and bf16 moments: 2 ranks
# at zero 3 learn as autocast bf16 alone does (0.2 below the no-context
# floor at step 80, where gpt_amp_check holds bf16); and, where Debian's python3-torch is installed
# (./build.sh test installs it), 20 steps against torch on the same weights
# and batches (tests/gpt_crosscheck.py: every parameter within 1e-4 of
# torch's f32 run; --bf16 against torch.autocast: losses within 1%,
# parameters within 5 lr, the distance of torch's own f32 run).
gpt_half_checks() {
    local g=$1 out vl
    out=$(OPENBLAS_NUM_THREADS=1 timeout -k 5 300 "$g" --steps 80 --eval-every 40 --eval-batches 8 \
          --sample 0 --ranks 2 --batch 6 --zero 3 --params bf16 --moments bf16 --amp bf16) ||
        { echo "$out" | tail -5; echo "gpt check: --zero 3 --params bf16 --moments bf16 failed"; exit 1; }
    vl=$(echo "$out" | sed -n 's/^step 80: .*val loss \([0-9.]*\).*/\1/p')
    awk -v a="$vl" -v h="$GPT_H0" 'BEGIN { exit !(a != "" && a < h - 0.2) }' ||
        { echo "$out" | tail -3; echo "gpt check: bf16 parameters at zero 3: validation loss '$vl'"; exit 1; }
    echo "gpt check: 2 ranks, zero 3, bf16 parameters (f32 masters) and moments: validation loss $vl at step 80"
    if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
        out=$(/usr/bin/python3 tests/gpt_crosscheck.py "$g") ||
            { echo "$out" | tail -4; echo "gpt check: f32 against torch"; exit 1; }
        echo "gpt check: $(echo "$out" | tail -1)"
        out=$(/usr/bin/python3 tests/gpt_crosscheck.py "$g" --bf16) ||
            { echo "$out" | tail -4; echo "gpt check: bf16 parameters against torch.autocast"; exit 1; }
        echo "gpt check: $(echo "$out" | tail -1)"
    else
        skipped "gpt check: bf16 against torch.autocast" "no python3-torch"
    fi
}
