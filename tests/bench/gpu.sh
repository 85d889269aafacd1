#!/usr/bin/env bash
# tests/bench/gpu.sh - dtrain's CUDA backend next to its peers on the same
# GPU, in one run:
#   1. training steps (bench_gpu.c vs bench_gpu_torch.py, PyTorch eager):
#      the benchmark MLP at batch 128 and 1024 and the CNN at batch 128,
#      fp32 (no TF32 on either side) and autocast bf16; inputs already on
#      the device (target: dtrain/PyTorch <= 1.00), and fed from host memory
#      every step (for reference: what the input copy costs each side)
#   2. matmul (bench_cublas.c): dt_matmul against the raw cuBLAS call in the
#      same process, 1024^3, 2048^3, 4096^3 and 1024x4096x1024 (MxKxN), fp32
#      (cublasSgemm, default and pedantic math), tf32 and bf16 (cublasGemmEx,
#      f32 output and compute) (target: >= 0.90 of raw); and, for reference,
#      torch.matmul on the same shapes (bench_gpu_torch.py --matmul: f32
#      inputs, bf16 under torch.autocast, which like dt_matmul converts both
#      operands on every call, while the raw bf16 call is fed bf16 operands
#      converted once before timing)
#   3. the GPT (examples/gpt.c --backend cuda vs bench_gpt_torch.py --device
#      cuda, the same model, AdamW, batch and shapes): a small config and
#      GPT-2 124M's shape (12 layers, 12 heads, 768 channels, context 1024,
#      batch 8, vocabulary 50257), fp32 and autocast bf16 (target:
#      dtrain/PyTorch <= 1.00; and dtrain's 124M bf16 step at least 1.5x
#      faster than its fp32 step).  dtrain reads a made-up text (random
#      bytes, written here): the step's time does not depend on the text
#
#   4. real sizes: GPT-2 124M (12 layers, 12 heads, 768 channels,
#      vocabulary 50257, context 1024, AdamW) at batch 8 (REAL_BATCHES), in
#      fp32, tf32 and bf16: tokens per second and peak device memory of
#      examples/gpt.c, llm.c's CUDA trainers (../shared/peers/llm.c:
#      train_gpt2cu for bf16, train_gpt2fp32cu for tf32, built here with
#      nvcc), PyTorch eager and torch.compile (F.scaled_dot_product_attention,
#      fused AdamW), and the model FLOPs utilisation (6 x 124.44M parameters
#      x tokens/s over the GPU's dense peak).  Targets: bf16 tokens/s >= 1.0x
#      llm.c, >= 1.3x PyTorch eager, >= 1.0x torch.compile; bf16 >= 1.5x fp32;
#      tf32 >= 1.0x llm.c's fp32 trainer; peak memory <= PyTorch eager's
#      (both the device memory nvidia-smi sees the process use)
#
#   bash tests/bench/gpu.sh      (from any cwd; builds what it needs itself)
#
# Without a GPU it prints "skipped: no GPU" and exits 0.  Everything goes to
# stdout and a copy to ${OUT:-build/bench}/gpu.txt (the parseable result
# lines of every run to gpu_results.txt beside it).
#
# Knobs: REPEATS=3 (process runs per side, the sides alternating; medians
# over runs), SECTIONS="1 2 3 4", GPT_CONFIGS=small (section 3; 124M is
# section 4's), REAL_BATCHES=8, REAL_PRECS=fp32,tf32,bf16, REAL_STEPS=15,
# REAL_REPEATS=1, REAL_COMPILE_PRECS=bf16 (the precisions torch.compile runs
# in), LLMC (llm.c's directory), CONFIGS=mlp:128,mlp:1024,cnn:128,
# PRECS=fp32,bf16 (also tf32), FEEDS=device,host, SHAPES (bench_cublas
# --shapes), TORCH_PYTHON (default: the first of /usr/bin/python3, python3
# whose torch sees a GPU), STRICT=1 (exit 1 on a missed target),
# BUILD_ONLY=1 (build everything and stop: works without a GPU),
# PREBUILT=1 (run the binaries a BUILD_ONLY=1 run left in tests/bench/build/gpu),
# TIMEOUT=300 (seconds per benchmark process), CUDA_HOME=/usr/local/cuda,
# NVCC, NVCC_GENCODE (default sm_90 + sm_80), EXTRA_LIBS (more link flags
# for the CUDA backend, e.g. -lcublasLt), DT_NATIVE=0 (no -march=native),
# GPT_DEVICE=cpu (section 3 only, on the CPU, no GPU needed: a dry run of
# the script itself; its numbers mean nothing for the targets).
# Every ratio compares numbers taken in this run on this GPU.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT" || exit 1

REPEATS=${REPEATS:-3}
SECTIONS=${SECTIONS:-"1 2 3 4"}
GPT_CONFIGS=${GPT_CONFIGS:-small}
REAL_BATCHES=${REAL_BATCHES:-8}
REAL_PRECS=${REAL_PRECS:-fp32,tf32,bf16}
REAL_STEPS=${REAL_STEPS:-15}            # each run's steps; its first 5 are warm-up
REAL_REPEATS=${REAL_REPEATS:-1}
REAL_COMPILE_PRECS=${REAL_COMPILE_PRECS:-bf16}   # torch.compile compiles for a minute a run
LLMC=${LLMC:-$ROOT/../shared/peers/llm.c}
GPT_DEVICE=${GPT_DEVICE:-cuda}
CONFIGS=${CONFIGS:-mlp:128,mlp:1024,cnn:128}
PRECS=${PRECS:-fp32,bf16}
FEEDS=${FEEDS:-device,host}
SHAPES=${SHAPES:-1024x1024x1024,2048x2048x2048,4096x4096x4096,1024x4096x1024}
STRICT=${STRICT:-0}
BUILD_ONLY=${BUILD_ONLY:-0}
TIMEOUT=${TIMEOUT:-300}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
NVCC_GENCODE=${NVCC_GENCODE:-"-gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80"}
CC=${CC:-gcc}
B="$HERE/build/gpu"                       # objects and binaries
RESDIR=${OUT:-$ROOT/build/bench}          # the copy of the output
mkdir -p "$B" "$RESDIR"
LOG="$RESDIR/gpu.txt"
RES="$RESDIR/gpu_results.txt"

main() {
    local t_begin=$SECONDS
    echo "# gpu.sh: commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(
        [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null | head -1) ]] &&
        echo ' + uncommitted changes'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname 2>/dev/null || uname -n), $(nproc) CPUs, $REPEATS repeats"
    echo "# sources: $(for f in dtrain.h dtrain.c backends/backend.h backends/cuda.cu; do
        [[ -f $f ]] && printf '%s %s  ' "$f" "$(sha256sum "$f" | cut -c1-12)"; done)"

    # ------------------------------------------------------- GPU present? ---
    local gpu=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpu=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
    fi
    if [[ -z $gpu && -f $CUDA_HOME/include/cuda_runtime.h ]]; then
        # no nvidia-smi (or it sees nothing): ask the CUDA runtime
        if $CC -std=c11 -D_GNU_SOURCE -O2 -DBENCH_RAW_ONLY -I"$CUDA_HOME/include" "$HERE/bench_cublas.c" \
            -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcublas -lcudart -lm \
            -o "$B/probe" 2>/dev/null && "$B/probe" --probe >/dev/null 2>&1; then
            gpu=$("$B/probe" --probe)
        fi
    fi
    if [[ $GPT_DEVICE == cpu ]]; then   # the dry run: sections 3 and 4 on the CPU
        SECTIONS="3 4"
        gpu="(none: GPT_DEVICE=cpu dry run)"
    fi
    if [[ -z $gpu && $BUILD_ONLY != 1 ]]; then
        echo "skipped: no GPU"
        return 0
    fi
    [[ -n $gpu ]] && echo "# $gpu"
    if command -v nvidia-smi >/dev/null 2>&1 && [[ -n $gpu ]]; then
        echo "# $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,persistence_mode \
            --format=csv,noheader 2>/dev/null | head -1); driver supports $(nvidia-smi 2>/dev/null |
            grep -o 'CUDA Version: [0-9.]*' | head -1)"
        local busy
        busy=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null | grep '^[0-9]' | head -3)
        [[ -n $busy ]] && echo "# WARNING: other processes on the GPU: $busy"
    fi

    # --------------------------------------------------------------- build ---
    local build_err=""
    build || build_err=$BUILD_ERR
    if [[ $BUILD_ONLY == 1 ]]; then
        [[ -z $build_err ]] && { echo "# build only: done ($B)"; return 0; }
        echo "gpu.sh: $build_err" >&2
        return 1
    fi
    [[ -n $build_err ]] && echo "# ERROR: $build_err; measuring PyTorch and raw cuBLAS only"

    local py=""
    local cand
    for cand in ${TORCH_PYTHON:-} /usr/bin/python3 python3 python; do
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() or sys.argv[1] == "cpu" else 1)' \
            "$GPT_DEVICE" >/dev/null 2>&1; then
            py=$cand
            break
        fi
    done
    if [[ -z $py ]]; then
        echo "# WARNING: no python whose torch sees a GPU (tried ${TORCH_PYTHON:+$TORCH_PYTHON }/usr/bin/python3 python3 python): no PyTorch columns"
    else
        echo "# torch: $py ($("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null))"
    fi

    : > "$RES"
    local r
    # ------------------------------------------------ 1. training steps ---
    if [[ " $SECTIONS " == *" 1 "* ]]; then
        echo
        echo "## 1. training steps: configs $CONFIGS, precisions $PRECS, feeds $FEEDS"
        for r in $(seq 1 "$REPEATS"); do
            if [[ -x $B/bench_gpu ]]; then
                echo "# repeat $r/$REPEATS: dtrain"
                timeout -k 10 "$TIMEOUT" "$B/bench_gpu" --configs "$CONFIGS" --precs "$PRECS" \
                    --feeds "$FEEDS" 2>&1 | tee -a "$RES" ||
                    echo "# bench_gpu exited with status ${PIPESTATUS[0]}"
            fi
            if [[ -n $py ]]; then
                echo "# repeat $r/$REPEATS: torch"
                timeout -k 10 "$TIMEOUT" "$py" "$HERE/bench_gpu_torch.py" --configs "$CONFIGS" \
                    --precs "$PRECS" --feeds "$FEEDS" 2>&1 | tee -a "$RES" ||
                    echo "# bench_gpu_torch.py exited with status ${PIPESTATUS[0]}"
            fi
        done
    fi

    # ------------------------------------------------------ 2. matmul ---
    if [[ " $SECTIONS " == *" 2 "* ]]; then
        echo
        echo "## 2. matmul: shapes $SHAPES (MxKxN)"
        local mm=$B/bench_cublas
        [[ -x $mm ]] || mm=$B/bench_cublas_raw
        [[ -x $mm ]] || echo "# ERROR: no bench_cublas binary"
        for r in $(seq 1 "$REPEATS"); do
            if [[ -x $mm ]]; then
                echo "# repeat $r/$REPEATS: $(basename "$mm")"
                timeout -k 10 "$TIMEOUT" "$mm" --shapes "$SHAPES" 2>&1 | tee -a "$RES" ||
                    echo "# $(basename "$mm") exited with status ${PIPESTATUS[0]}"
            fi
            if [[ -n $py ]]; then
                echo "# repeat $r/$REPEATS: torch matmul"
                timeout -k 10 "$TIMEOUT" "$py" "$HERE/bench_gpu_torch.py" --matmul "$SHAPES" 2>&1 |
                    tee -a "$RES" || echo "# bench_gpu_torch.py --matmul exited with status ${PIPESTATUS[0]}"
            fi
        done
    fi

    # ------------------------------------------------------------ 3. GPT ---
    if [[ " $SECTIONS " == *" 3 "* ]]; then
        echo
        echo "## 3. GPT: configs $GPT_CONFIGS, fp32 and bf16, on $GPT_DEVICE"
        gpt_section "$py"
    fi

    # ------------------------------------------------------ 4. real sizes ---
    if [[ " $SECTIONS " == *" 4 "* ]]; then
        echo
        real_section "$py"
    fi

    # --------------------------------------------------------------- tables ---
    echo
    table "$RES"
    local miss=$?
    if [[ " $SECTIONS " == *" 4 "* ]]; then
        real_table "$RES" "$gpu"
        miss=$((miss + $?))
        echo "$miss target(s) missed in all"
    fi
    echo "# gpu.sh: $((SECONDS - t_begin)) s; results in $RES"
    [[ -n $build_err ]] && return 1
    ((STRICT && miss)) && return 1
    return 0
}

# Section 3: each config and precision, REPEATS runs a side, alternating;
# result lines "gpt CONFIG PREC IMPL ms=X" into $RES.
declare -A GPT_ARGS=([small]="--layers 4 --heads 4 --embd 128 --context 64 --batch 12 --vocab 256"
                     [124M]="--layers 12 --heads 12 --embd 768 --context 1024 --batch 8 --vocab 50257")
declare -A GPT_STEPS=([small]=60 [124M]=20)
gpt_section() {
    local py=$1 data=$B/gpt_text cfg prec r s line ms amp gpt=$B/gpt
    [[ $GPT_DEVICE == cpu ]] && gpt=$ROOT/build/gpt
    mkdir -p "$data"
    head -c 4000000 /dev/urandom > "$data/text"   # any text: the step's time does not depend on it
    [[ -x $gpt ]] || { echo "# ERROR: no $gpt to run"; return; }
    for cfg in ${GPT_CONFIGS//,/ }; do
        s=${GPT_STEPS[$cfg]}
        [[ $GPT_DEVICE == cpu ]] && s=8
        for prec in fp32 bf16; do
            amp=off
            [[ $prec == bf16 ]] && amp=bf16
            for r in $(seq 1 "$REPEATS"); do
                # shellcheck disable=SC2086
                line=$(timeout -k 10 "$TIMEOUT" "$gpt" ${GPT_ARGS[$cfg]} --backend "$GPT_DEVICE" --amp $amp \
                       --steps "$s" --eval-every "$s" --eval-batches 1 --sample 0 --data "$data" 2>&1 |
                       tee "$B/gpt_${cfg}_$prec.log" | grep "^step $s:")
                ms=$(echo "$line" | sed -n 's/.* \([0-9.]*\) ms\/step$/\1/p')
                echo "gpt $cfg $prec dtrain ms=${ms:-error}" | tee -a "$RES"
                [[ -n $ms ]] || tail -3 "$B/gpt_${cfg}_$prec.log"
                [[ -n $py ]] || continue
                # shellcheck disable=SC2086
                line=$(timeout -k 10 "$TIMEOUT" "$py" "$HERE/bench_gpt_torch.py" ${GPT_ARGS[$cfg]} \
                       --steps "$s" --device "$GPT_DEVICE" --amp $amp 2>&1 | tee "$B/gpt_torch.log" |
                       grep "^gpt impl=torch")
                ms=$(echo "$line" | sed -n 's/.* ms=\([0-9.]*\).*/\1/p')
                echo "gpt $cfg $prec torch ms=${ms:-error}" | tee -a "$RES"
                [[ -n $ms ]] || tail -3 "$B/gpt_torch.log"
            done
        done
    done
}

# Section 4.  Result lines "real BATCH PREC IMPL ms=X peak_mib=Y [alloc_mib=Z]"
# into $RES; IMPL: dtrain, llmc, torch (eager), torchc (torch.compile).
real_section() {
    # the model (a GPT_DEVICE=cpu dry run: a small one, same code paths)
    local L=12 H=12 C=768 T=1024 V=50257
    [[ $GPT_DEVICE == cpu ]] && L=2 H=2 C=64 T=128 V=512 REAL_BATCHES=2 REAL_STEPS=7
    REAL_T=$T REAL_L=$L REAL_H=$H
    REAL_ARGS="--layers $L --heads $H --embd $C --context $T --vocab $V"
    echo "## 4. real sizes: $REAL_ARGS, batches $REAL_BATCHES, $REAL_PRECS, $REAL_STEPS steps, on $GPT_DEVICE$(
        [[ $GPT_DEVICE == cpu ]] && echo " (dry run: a small model)")"
    local py=$1 d=$B/real gpt=$B/gpt b prec r amp ms peak out
    [[ $GPT_DEVICE == cpu ]] && gpt=$ROOT/build/gpt
    mkdir -p "$d" "$B/gpt_text"
    [[ -s $B/gpt_text/text ]] || head -c 4000000 /dev/urandom > "$B/gpt_text/text"
    real_llmc_inputs "$py" "$gpt" "$d"
    for b in ${REAL_BATCHES//,/ }; do
        for prec in ${REAL_PRECS//,/ }; do
            amp=$prec
            [[ $prec == fp32 ]] && amp=off
            for r in $(seq 1 "$REAL_REPEATS"); do
                [[ -x $gpt ]] && real_run "$b $prec dtrain" "$d/dtrain_${b}_$prec.log" \
                    "$gpt" $REAL_ARGS --batch "$b" --backend "$GPT_DEVICE" --amp "$amp" \
                    --steps "$REAL_STEPS" --eval-every "$REAL_STEPS" --eval-batches 1 --sample 0 \
                    --data "$B/gpt_text"
                real_llmc "$b" "$prec" "$d"
                if [[ -n $py ]]; then
                    real_run "$b $prec torch" "$d/torch_${b}_$prec.log" "$py" "$HERE/bench_gpt_torch.py" \
                        $REAL_ARGS --batch "$b" --steps "$REAL_STEPS" --device "$GPT_DEVICE" --amp "$amp"
                    [[ ,$REAL_COMPILE_PRECS, == *,$prec,* ]] &&
                        real_run "$b $prec torchc" "$d/torchc_${b}_$prec.log" "$py" "$HERE/bench_gpt_torch.py" \
                            $REAL_ARGS --batch "$b" --steps "$REAL_STEPS" --device "$GPT_DEVICE" --amp "$amp" --compile
                fi
            done
        done
    done
}

# The device memory this run's processes use, sampled every 0.2 s by
# nvidia-smi, into $1 until the file $1.stop appears: the largest sum over
# the compute processes, or where nvidia-smi lists none (a container's own
# PID namespace) the GPU's used memory above what it was before the run;
# nothing without nvidia-smi, and nothing when neither ever rose above 0.
real_watch_memory() {
    local out=$1 max=0 now base
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    while [[ ! -e $out.stop ]]; do
        now=$(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null |
              awk '$1 ~ /^[0-9]+$/ { s += $1 } END { print s + 0 }')
        if ((now == 0)) && [[ $base =~ ^[0-9]+$ ]]; then
            now=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
            [[ $now =~ ^[0-9]+$ ]] && now=$((now - base)) || now=0
        fi
        ((now > max)) && max=$now && echo "$max" > "$out"
        sleep 0.2
    done
}

# real_run "BATCH PREC IMPL" LOG CMD...: run it with its memory watched and
# write its result line.  ms: examples/gpt.c's last "ms/step", or the
# torch bench's ms=; a torch line "unavailable=compile" gives ms=unavailable.
real_run() {
    local what=$1 log=$2 ms peak alloc
    shift 2
    rm -f "$log.mem" "$log.mem.stop"
    real_watch_memory "$log.mem" &
    local watch=$!
    timeout -k 10 "$TIMEOUT" "$@" > "$log" 2>&1
    touch "$log.mem.stop"
    wait "$watch" 2>/dev/null
    ms=$(sed -n 's/^step [0-9]*: .* \([0-9.]*\) ms\/step$/\1/p' "$log" | tail -1)
    [[ -n $ms ]] || ms=$(sed -n 's/^gpt impl=torch ms=\([0-9.]*\).*/\1/p' "$log")
    grep -q "unavailable=compile" "$log" && ms=unavailable
    alloc=$(sed -n 's/.* max_alloc_mib=\([0-9.]*\).*/ alloc_mib=\1/p' "$log")
    [[ -z $alloc ]] && alloc=$(sed -n 's/^memory: step arena peak \([0-9.]*\) MiB, persistent \([0-9.]*\) MiB.*/ arena_mib=\1 persistent_mib=\2/p' "$log")
    peak=$(cat "$log.mem" 2>/dev/null)
    echo "real $what ms=${ms:-error} peak_mib=${peak:-n/a}$alloc" | tee -a "$RES"
    [[ -n $ms ]] || tail -3 "$log"
}

# llm.c's inputs in $3/llmc: random tokens in its file format (256 int32s:
# magic 20240520, version 1, count; then uint16 tokens), REAL_STEPS + 1
# batches of each REAL_BATCHES' size (its fp32 trainer runs one epoch of its
# file), and for the fp32 trainer a gpt2_124M.bin of dtrain's initial
# weights (examples/gpt.c --save-init, tests/bench/llmc_files.py)
real_llmc_inputs() {
    local py=$1 gpt=$2 d=$3 b
    [[ -x $B/llmc/train_gpt2cu || -x $B/llmc/train_gpt2fp32cu ]] || return 0
    [[ -n $py ]] || { echo "# llm.c: no python to write its inputs"; return 0; }
    mkdir -p "$d/llmc"
    for b in ${REAL_BATCHES//,/ }; do
        "$py" -c 'import sys, numpy as np
n = int(sys.argv[2]) * int(sys.argv[4]) * (int(sys.argv[3]) + 1) + 1
h = np.zeros(256, np.int32); h[:3] = (20240520, 1, n)
t = np.random.default_rng(5).integers(0, 256, n).astype(np.uint16)
open(sys.argv[1], "wb").write(h.tobytes() + t.tobytes())' "$d/llmc/tokens_$b.bin" "$b" "$REAL_STEPS" "$REAL_T" ||
            echo "# llm.c: could not write its tokens"
    done
    if [[ -x $B/llmc/train_gpt2fp32cu && -x $gpt && ! -s $d/llmc/gpt2_124M.bin ]]; then
        timeout -k 10 "$TIMEOUT" "$gpt" $REAL_ARGS --batch 1 --steps 1 --eval-batches 1 --sample 0 \
            --backend "$GPT_DEVICE" --data "$B/gpt_text" --save-init "$d/init.st" > "$d/init.log" 2>&1 &&
            "$py" "$HERE/llmc_files.py" "$d/init.st" "$B/gpt_text" "$d/llmc" "$REAL_L" "$REAL_H" "$REAL_T" \
                > "$d/llmc_files.log" 2>&1 ||
            { echo "# llm.c: no gpt2_124M.bin for its fp32 trainer:"; tail -3 "$d/init.log" "$d/llmc_files.log"; }
        rm -f "$d/init.st"
    fi
}

# llm.c at batch $1, precision $2: train_gpt2cu (bf16, random weights: -e
# d12) or train_gpt2fp32cu (tf32: it enables TF32 itself; dtrain's initial
# weights), its mean ms per step after 5, and the memory it used.
real_llmc() {
    local b=$1 prec=$2 d=$3 bin log ms
    case $prec in
        bf16) bin=$B/llmc/train_gpt2cu ;;
        tf32) bin=$B/llmc/train_gpt2fp32cu ;;
        *) return 0 ;;
    esac
    [[ -x $bin && -s $d/llmc/tokens_$b.bin ]] || { echo "real $b $prec llmc ms=n/a peak_mib=n/a"; return 0; }
    log=$d/llmc_${b}_$prec.log
    rm -f "$log.mem" "$log.mem.stop"
    real_watch_memory "$log.mem" &
    local watch=$!
    if [[ $prec == bf16 ]]; then
        (cd "$d/llmc" && timeout -k 10 "$TIMEOUT" "$bin" -i "tokens_$b.bin" -j "tokens_$b.bin" -e d12 \
            -b "$b" -t "$REAL_T" -d $((b * REAL_T)) -x "$REAL_STEPS" -v 100000 -m 1 -s 100000 -n 0 -h 0 -y 0) \
            > "$log" 2>&1
        ms=$(sed -n 's/^step *\([0-9]*\)\/.*| \([0-9.]*\) ms |.*/\1 \2/p' "$log" |
             awk '$1 > 5 { s += $2; n++ } END { if (n) printf "%.2f", s / n }')
    else
        (cd "$d/llmc" && timeout -k 10 "$TIMEOUT" "$bin" -i "tokens_$b.bin" -j "tokens_$b.bin" \
            -b "$b" -t "$REAL_T" -v 100000 -m 1 -s 100000) > "$log" 2>&1
        ms=$(sed -n 's/^step *\([0-9]*\)\/[0-9]*: train loss [0-9.]* (\([0-9.]*\) ms,.*/\1 \2/p' "$log" |
             awk '$1 > 5 { s += $2; n++ } END { if (n) printf "%.2f", s / n }')
    fi
    touch "$log.mem.stop"
    wait "$watch" 2>/dev/null
    echo "real $b $prec llmc ms=${ms:-error} peak_mib=$(cat "$log.mem" 2>/dev/null || echo n/a)" | tee -a "$RES"
    [[ -n $ms ]] || tail -3 "$log"
}

# Build the benchmarks into $B.  Returns 1 with BUILD_ERR set when dtrain
# with its CUDA backend cannot be built; the raw-cuBLAS-only bench_cublas is
# built whenever the CUDA toolkit is there.
BUILD_ERR=""
build() {
    local arch="-march=native"
    [[ ${DT_NATIVE:-1} == 1 ]] || arch=""
    local cinc="-I$CUDA_HOME/include"
    local cuda_libs="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcudart -lcublas -lstdc++"
    local bench_cflags="-std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Werror -I$ROOT $cinc"
    local libflags="-std=c11 -D_GNU_SOURCE -O3 $arch -fno-math-errno -I$ROOT -pthread"
    local t0=$SECONDS

    if [[ ${PREBUILT:-0} == 1 && -x $B/bench_gpu && -x $B/bench_cublas ]]; then
        echo "# build: PREBUILT=1: the binaries already in $B"
        return 0
    fi
    rm -f "$B/bench_cublas_raw" "$B/bench_gpu" "$B/bench_cublas"   # never run a stale build
    if [[ ! -f $CUDA_HOME/include/cuda_runtime.h ]]; then
        BUILD_ERR="no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)"
        return 1
    fi
    echo "# build: bench_cublas (raw cuBLAS only)"
    $CC $bench_cflags -DBENCH_RAW_ONLY "$HERE/bench_cublas.c" $cuda_libs -lm -o "$B/bench_cublas_raw" || {
        BUILD_ERR="bench_cublas.c (raw only) does not build"
        return 1
    }
    if [[ ! -f backends/cuda.cu ]]; then
        BUILD_ERR="backends/cuda.cu not found: no dtrain CUDA backend to measure"
        return 1
    fi
    [[ -x $NVCC ]] || NVCC=$(command -v nvcc || true)
    if [[ -z $NVCC ]]; then
        BUILD_ERR="no nvcc (looked at $CUDA_HOME/bin/nvcc and PATH)"
        return 1
    fi

    # nvcc in the background while gcc does the rest (llm.c's trainers too)
    build_llmc > "$B/llmc.log" 2>&1 &
    local llmc_pid=$!
    echo "# build: $NVCC backends/cuda.cu ($NVCC_GENCODE; $("$NVCC" --version | grep -o 'release [0-9.]*'))"
    "$NVCC" -std=c++17 -O3 -Xcompiler -fPIC $NVCC_GENCODE -DDT_WITH_CUDA -I. \
        -c backends/cuda.cu -o "$B/cuda.o" > "$B/nvcc.log" 2>&1 &
    local nvcc_pid=$!

    # The CPU backend and the libfabric transport are optional here: left
    # out (with a note) where OpenBLAS or libfabric are not installed.  Each
    # is compiled inside dtrain.c by its macro; its file alone is the probe.
    local defs="-DDT_WITH_CUDA" objs="$B/dtrain.o $B/cuda.o" libs=""
    if $CC $libflags -DDT_WITH_CPU -fsyntax-only backends/cpu.c 2> "$B/cpu.log" &&
       echo 'int main(void){return 0;}' | $CC -x c - -lopenblas -o "$B/conftest" 2>/dev/null; then
        defs="$defs -DDT_WITH_CPU" libs="$libs -lopenblas"
    else
        echo "# build: note: no CPU backend (backends/cpu.c or -lopenblas failed: $(head -c 300 "$B/cpu.log"))"
    fi
    if $CC $libflags -DDT_WITH_FABRIC -fsyntax-only backends/fabric.c 2> "$B/fabric.log" &&
       echo 'int main(void){return 0;}' | $CC -x c - -lfabric -o "$B/conftest" 2>/dev/null; then
        defs="$defs -DDT_WITH_FABRIC" libs="$libs -lfabric"
    else
        echo "# build: note: no libfabric transport (backends/fabric.c or -lfabric failed)"
    fi
    echo "# build: dtrain.c ($defs)"
    local ok=1
    $CC $libflags $defs -c dtrain.c -o "$B/dtrain.o" || ok=0
    $CC $bench_cflags -c "$HERE/bench_gpu.c" -o "$B/bench_gpu.o" || ok=0
    $CC $bench_cflags -c "$HERE/bench_cublas.c" -o "$B/bench_cublas.o" || ok=0
    $CC $bench_cflags -c examples/gpt.c -o "$B/gpt.o" || ok=0
    if ! wait "$nvcc_pid"; then
        cat "$B/nvcc.log"
        BUILD_ERR="backends/cuda.cu does not compile (nvcc)"
        return 1
    fi
    grep -v '^$' "$B/nvcc.log" | head -20
    wait "$llmc_pid"
    grep '^# ' "$B/llmc.log"
    if ((!ok)); then
        BUILD_ERR="dtrain.c or a benchmark does not compile"
        return 1
    fi
    libs="$libs ${EXTRA_LIBS:-} -lz -lm -lpthread"
    $CC "$B/bench_gpu.o" $objs $cuda_libs $libs -o "$B/bench_gpu" &&
        $CC "$B/bench_cublas.o" $objs $cuda_libs $libs -o "$B/bench_cublas" &&
        $CC "$B/gpt.o" $objs $cuda_libs $libs -o "$B/gpt" || {
        BUILD_ERR="linking the benchmarks failed"
        return 1
    }
    echo "# build: done in $((SECONDS - t0)) s"
    return 0
}

# llm.c's CUDA trainers (section 4's peers), from a copy of $LLMC in
# $B/llmc, as its Makefile builds them (make train_gpt2cu train_gpt2fp32cu
# NO_MULTI_GPU=1 USE_CUDNN=0) but by these nvcc lines: for sm_90 (NVCC_ARCH)
# and with tests/bench/llmc_cuda13.h force-included, which adapts its one
# cudaMemAdvise call to CUDA 13; without NVML (it only reports clocks).
build_llmc() {
    local src=$B/llmc/src arch=${NVCC_ARCH:-90}
    rm -f "$B/llmc/train_gpt2cu" "$B/llmc/train_gpt2fp32cu"
    [[ -f $LLMC/train_gpt2.cu ]] || { echo "# build: note: no llm.c at $LLMC: section 4 without it"; return 0; }
    mkdir -p "$B/llmc" && rm -rf "$src" && cp -r "$LLMC" "$src" || return 0
    local flags="--threads=0 -t=0 --use_fast_math -std=c++17 -O3
                 --generate-code arch=compute_$arch,code=[compute_$arch,sm_$arch] -include $HERE/llmc_cuda13.h"
    # shellcheck disable=SC2086
    (cd "$src" && "$NVCC" $flags -DENABLE_BF16 train_gpt2.cu -lcublas -lcublasLt -o "$B/llmc/train_gpt2cu") &&
        (cd "$src" && "$NVCC" $flags train_gpt2_fp32.cu -lcublas -lcublasLt -o "$B/llmc/train_gpt2fp32cu") &&
        echo "# build: llm.c's train_gpt2cu and train_gpt2fp32cu ($(sed -n 's/.*at commit \([0-9a-f]*\).*/llm.c \1/p' \
             "$LLMC/README.md" | head -1), sm_$arch)" ||
        echo "# build: note: llm.c's CUDA trainers did not build ($B/llmc.log): section 4 without them"
}

# The side-by-side tables from the result lines; returns the number of
# missed targets (capped at 255 by the shell).
table() {
    awk -v repeats="$REPEATS" -v sections=" $SECTIONS " '
    function med(list,    n, v, i, j, t) {
        n = split(list, v, " ")
        if (n == 0) return ""
        for (i = 2; i <= n; i++) { t = v[i] + 0; for (j = i - 1; j >= 1 && v[j] + 0 > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
        return (n % 2) ? v[(n + 1) / 2] + 0 : (v[n / 2] + v[n / 2 + 1]) / 2
    }
    function cnt(list,    v) { return split(list, v, " ") }
    function add(arr, k, x,    t) { t = (k in arr) ? arr[k] " " x : x; arr[k] = t }
    function verdict(ok) { if (!ok) miss++; return ok ? "PASS" : "MISS" }
    ($1 == "dtrain" || $1 == "torch") && NF >= 6 && $3 ~ /^b[0-9]+$/ {
        k = $2 " " $3 " " $4 " " $5
        if (!(k in seen)) { seen[k] = 1; keys[++nk] = k }
        if ($6 == "error") { add(err, $1 SUBSEP k, $7); next }
        split("", f)
        for (i = 6; i < NF; i += 2) f[$i] = $(i + 1)
        add(step, $1 SUBSEP k, f["step_ms"]); add(sync, $1 SUBSEP k, f["sync_ms"])
    }
    $1 == "matmul" && NF >= 5 {
        k = $2 " " $3
        if (!(k in mseen)) { mseen[k] = 1; mkeys[++nm] = k }
        split("", f)
        for (i = 4; i < NF; i += 2) f[$i] = $(i + 1)
        add(raw, k, f["raw_tflops"])
        if (f["dtrain_tflops"] != "nan" && f["dtrain_tflops"] != "-nan") {
            add(dtf, k, f["dtrain_tflops"]); add(rat, k, f["ratio"])
            if (f["ok"] + 0 != 1) bad[k] = 1
            if (!(k in mrel) || f["maxrel"] + 0 > mrel[k] + 0) mrel[k] = f["maxrel"]
        }
    }
    $1 == "gpt" && NF >= 5 && $5 ~ /^ms=[0-9.]+$/ {
        k = $2 " " $3
        if (!(k in gseen)) { gseen[k] = 1; gkeys[++ng] = k }
        add(gms, $4 SUBSEP k, substr($5, 4))
    }
    $1 == "torchmm" && NF >= 5 && $4 == "torch_tflops" && $5 != "nan" && $5 != "-nan" { add(ptf, $2 " " $3, $5); npt++ }
    END {
        if (!nk && index(sections, " 1 ")) { printf "== 1. training step: no results ==\n\n"; miss++ }
        if (nk) {
            printf "== 1. training step: median ms/step over %d runs (a run: the median round of queued steps, one sync per round) ==\n", repeats
            printf "%-4s %6s %-5s %-7s| %9s %9s %8s | %9s %9s %8s | %7s %6s\n", "net", "batch", "prec", "feed", \
                "dtrain", "torch", "dt/torch", "dt_sync", "pt_sync", "dt/torch", "target", "result"
            for (i = 1; i <= nk; i++) {
                k = keys[i]; split(k, id, " ")
                d = med(step["dtrain" SUBSEP k]); p = med(step["torch" SUBSEP k])
                ds = med(sync["dtrain" SUBSEP k]); ps = med(sync["torch" SUBSEP k])
                dev = id[4] == "device"
                ds_ = d == "" ? (("dtrain" SUBSEP k) in err ? "error" : "n/a") : sprintf("%.4f", d)
                ps_ = p == "" ? (("torch" SUBSEP k) in err ? "error" : "n/a") : sprintf("%.4f", p)
                r_ = (d != "" && p > 0) ? sprintf("%.3f", d / p) : "-"
                rs_ = (ds != "" && ps > 0) ? sprintf("%.3f", ds / ps) : "-"
                res = dev ? verdict(d != "" && p > 0 && d / p <= 1.0 + 1e-9) : "(ref)"
                printf "%-4s %6s %-5s %-7s| %9s %9s %8s | %9s %9s %8s | %7s %6s\n", id[1], substr(id[2], 2), id[3], id[4], \
                    ds_, ps_, r_, (ds == "" ? "-" : sprintf("%.4f", ds)), (ps == "" ? "-" : sprintf("%.4f", ps)), rs_, \
                    (dev ? "<=1.00" : "-"), res
                nrun = cnt(step["dtrain" SUBSEP k])
                if (nrun && nrun < repeats) printf "     (dtrain: %d of %d runs gave a result)\n", nrun, repeats
                if (("dtrain" SUBSEP k) in err) printf "     (dtrain errors: %s)\n", err["dtrain" SUBSEP k]
                if (("torch" SUBSEP k) in err) printf "     (torch errors: %s)\n", err["torch" SUBSEP k]
            }
            hosts = 0
            for (i = 1; i <= nk; i++) { split(keys[i], id, " "); if (id[4] == "host") hosts++ }
            if (hosts) {
                printf "\n-- input copy per step (host feed minus device feed, ms) --\n"
                printf "%-4s %6s %-5s| %9s %9s\n", "net", "batch", "prec", "dtrain", "torch"
            }
            for (i = 1; i <= nk; i++) {
                k = keys[i]; split(k, id, " ")
                if (id[4] != "host") continue
                kd = id[1] " " id[2] " " id[3] " device"
                out = ""
                for (s = 1; s <= 2; s++) {
                    impl = s == 1 ? "dtrain" : "torch"
                    h = med(step[impl SUBSEP k]); dv = med(step[impl SUBSEP kd])
                    out = out sprintf(" %9s", (h != "" && dv != "") ? sprintf("%.4f", h - dv) : "-")
                }
                printf "%-4s %6s %-5s|%s\n", id[1], substr(id[2], 2), id[3], out
            }
            printf "\n"
        }
        if (!nm && index(sections, " 2 ")) { printf "== 2. matmul: no results ==\n\n"; miss++ }
        if (nm) {
            printf "== 2. matmul: dt_matmul vs raw cuBLAS, same process, rounds interleaved (TFLOP/s, median over %d runs) ==\n", repeats
            printf "%-16s %-6s| %9s %9s %8s | %8s %8s | %8s | %7s %6s\n", "MxKxN", "prec", "raw", "dtrain", "fraction", \
                "torch", "dt/torch", "maxrel", "target", "result"
            for (i = 1; i <= nm; i++) {
                k = mkeys[i]; split(k, id, " ")
                rw = med(raw[k]); dt = med(dtf[k]); fr = med(rat[k])
                if (dt == "") { res = verdict(0); dt_ = "n/a"; fr_ = "-"; mr = "-" }
                else {
                    dt_ = sprintf("%.2f", dt); fr_ = sprintf("%.3f", fr); mr = mrel[k]
                    res = (k in bad) ? "WRONG" : verdict(fr >= 0.90 - 1e-9)
                    if (k in bad) miss++
                }
                pt = med(ptf[id[1] " " (id[2] == "fp32p" ? "fp32" : id[2])])
                pt_ = pt == "" ? "-" : sprintf("%.2f", pt)
                dp_ = (dt != "" && pt > 0) ? sprintf("%.3f", dt / pt) : "-"
                printf "%-16s %-6s| %9.2f %9s %8s | %8s %8s | %8s | %7s %6s\n", id[1], id[2], rw, dt_, fr_, pt_, dp_, mr, ">=0.90", res
            }
            printf "(fraction: the median over runs of each run'"'"'s dtrain/raw; fp32 = cublasSgemm default math, fp32p = pedantic math; WRONG: dt_matmul differs from cuBLAS)\n"
            if (npt) printf "(torch: torch.matmul on the same f32 inputs, median over runs, in its own process; bf16 under torch.autocast, converting both operands each call like dt_matmul; tf32 with allow_tf32; the fp32p row shows torch fp32; dt/torch: median dtrain / median torch)\n"
            printf "\n"
        }
        if (ng) {
            printf "== 3. GPT: median ms/step over %d runs (examples/gpt.c vs bench_gpt_torch.py) ==\n", repeats
            printf "%-6s %-5s| %9s %9s %8s | %7s %6s\n", "config", "prec", "dtrain", "torch", "dt/torch", "target", "result"
            for (i = 1; i <= ng; i++) {
                k = gkeys[i]; split(k, id, " ")
                d = med(gms["dtrain" SUBSEP k]); p = med(gms["torch" SUBSEP k])
                res = verdict(d != "" && p > 0 && d / p <= 1.0 + 1e-9)
                printf "%-6s %-5s| %9s %9s %8s | %7s %6s\n", id[1], id[2], (d == "" ? "n/a" : sprintf("%.2f", d)), \
                    (p == "" ? "n/a" : sprintf("%.2f", p)), ((d != "" && p > 0) ? sprintf("%.3f", d / p) : "-"), "<=1.00", res
            }
            g32 = med(gms["dtrain" SUBSEP "124M fp32"]); gbf = med(gms["dtrain" SUBSEP "124M bf16"])
            if (g32 != "" && gbf > 0)
                printf "124M: dtrain bf16 is %.2fx faster than its fp32 (target >= 1.50): %s\n", g32 / gbf, verdict(g32 / gbf >= 1.5)
            printf "\n"
        } else if (index(sections, " 3 ")) { printf "== 3. GPT: no results ==\n\n"; miss++ }
        printf "%d target(s) missed\n", miss
        exit (miss > 255 ? 255 : miss)
    }' "$1"
}

# Section 4's table; returns its missed targets.  MFU: 6 x 124.44M (GPT-2
# 124M's parameters, the vocabulary unpadded) x tokens/s over the GPU's
# dense peak for the precision (H100 SXM and H200: bf16 989.4, TF32 494.7,
# fp32 66.9 TFLOP/s; H100 PCIe: 756.5, 378.0, 51.2; unknown GPU: no MFU).
real_table() {
    local gpu=$2 pb=0 pt=0 pf=0
    case $gpu in
        *H100*PCIe*) pb=756.5 pt=378.0 pf=51.2 ;;
        *H100*|*H200*) pb=989.4 pt=494.7 pf=66.9 ;;
    esac
    awk -v T="${REAL_T:-1024}" -v N=124439808 -v pb="$pb" -v pt="$pt" -v pf="$pf" -v runs="$REAL_REPEATS" '
    function med(list,    n, v, i, j, t) {
        n = split(list, v, " ")
        if (n == 0) return ""
        for (i = 2; i <= n; i++) { t = v[i] + 0; for (j = i - 1; j >= 1 && v[j] + 0 > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
        return (n % 2) ? v[(n + 1) / 2] + 0 : (v[n / 2] + v[n / 2 + 1]) / 2
    }
    function add(arr, k, x) { arr[k] = (k in arr) ? arr[k] " " x : x }
    function tok(b, ms) { return ms > 0 ? b * T * 1000 / ms : 0 }
    function fmt(x) { return x > 0 ? sprintf("%.0f", x) : "-" }
    function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.3f", a / b) : "-" }
    function check(name, ok) { if (!ok) { miss++; bad = bad " " name } }
    $1 == "real" && NF >= 6 {
        k = $2 " " $3
        if (!(k in seen)) { seen[k] = 1; keys[++nk] = k }
        for (i = 5; i <= NF; i++) {
            split($i, kv, "=")
            if (kv[1] == "ms" && kv[2] ~ /^[0-9.]+$/) add(ms, $4 SUBSEP k, kv[2])
            if (kv[1] == "ms" && kv[2] == "unavailable") unavail[$4 SUBSEP k] = 1
            if (kv[1] == "peak_mib" && kv[2] ~ /^[0-9.]+$/ && kv[2] + 0 > 0) add(pk, $4 SUBSEP k, kv[2])
            if (kv[1] == "alloc_mib") add(al, $4 SUBSEP k, kv[2])
            if (kv[1] == "arena_mib") add(ar, $4 SUBSEP k, kv[2])
            if (kv[1] == "persistent_mib") add(ps, $4 SUBSEP k, kv[2])
        }
    }
    END {
        if (!nk) { printf "== 4. real sizes: no results ==\n1 target(s) missed in section 4\n"; exit 1 }
        printf "== 4. real sizes: %s, context %d: tokens/s (median over %d runs), MFU, peak device MiB ==\n", \
            (T == 1024 ? "GPT-2 124M shape" : "dry run"), T, runs
        printf "%-5s %-5s| %8s %8s %8s %8s | %8s %8s %8s | %6s %6s | %7s %7s %7s %7s | %s\n", "batch", "prec", \
            "dtrain", "llm.c", "torch", "compile", "dt/llmc", "dt/torch", "dt/comp", "MFU dt", "llm.c", \
            "dt MiB", "torch", "llm.c", "compile", "targets missed"
        for (i = 1; i <= nk; i++) {
            k = keys[i]; split(k, id, " "); b = id[1]; p = id[2]; bad = ""
            d = tok(b, med(ms["dtrain" SUBSEP k])); l = tok(b, med(ms["llmc" SUBSEP k]))
            t = tok(b, med(ms["torch" SUBSEP k])); c = tok(b, med(ms["torchc" SUBSEP k]))
            peak = p == "bf16" ? pb : p == "tf32" ? pt : pf
            mfu_d = (peak > 0 && d > 0) ? sprintf("%.1f%%", 600 * N * d / (peak * 1e12)) : "-"
            mfu_l = (peak > 0 && l > 0) ? sprintf("%.1f%%", 600 * N * l / (peak * 1e12)) : "-"
            md = med(pk["dtrain" SUBSEP k]); mt = med(pk["torch" SUBSEP k])
            ml = med(pk["llmc" SUBSEP k]); mc = med(pk["torchc" SUBSEP k])
            if (p == "bf16") {
                check("llm.c>=1.0", d > 0 && l > 0 && d / l >= 1.0)
                check("torch>=1.3", d > 0 && t > 0 && d / t >= 1.3)
                if (!(("torchc" SUBSEP k) in unavail)) check("compile>=1.0", d > 0 && c > 0 && d / c >= 1.0)
            }
            if (p == "tf32") check("llm.c-fp32>=1.0", d > 0 && l > 0 && d / l >= 1.0)
            check((md != "" && mt != "") ? "memory<=torch" : "memory-not-measured", md != "" && mt != "" && md + 0 <= mt + 0)
            tk[b " " p] = d
            printf "%-5s %-5s| %8s %8s %8s %8s | %8s %8s %8s | %6s %6s | %7s %7s %7s %7s | %s\n", b, p, fmt(d), \
                (p == "fp32" ? "(none)" : fmt(l)), fmt(t), ((("torchc" SUBSEP k) in unavail) ? "n/a" : fmt(c)), \
                ratio(d, l), ratio(d, t), ratio(d, c), mfu_d, mfu_l, (md == "" ? "-" : md), (mt == "" ? "-" : mt), \
                (ml == "" ? "-" : ml), (mc == "" ? "-" : mc), (bad == "" ? "none" : bad)
            if (("dtrain" SUBSEP k) in ar)
                printf "      dtrain: step arena peak %s MiB + persistent %s MiB (dt_mem_stats)%s\n", med(ar["dtrain" SUBSEP k]), \
                    med(ps["dtrain" SUBSEP k]), (("torch" SUBSEP k) in al) ? sprintf("; torch.cuda.max_memory_allocated %s MiB", med(al["torch" SUBSEP k])) : ""
        }
        for (kk in tk) {
            split(kk, id, " ")
            if (id[2] != "bf16" || !((id[1] " fp32") in tk)) continue
            f = tk[id[1] " fp32"]; g = tk[kk]
            printf "batch %s: dtrain bf16 is %sx its fp32 tokens/s (target >= 1.50)\n", id[1], ratio(g, f)
            if (!(g > 0 && f > 0 && g / f >= 1.5)) miss++
        }
        printf "(tokens/s: batch x context / the median ms per step after 5 warm-up steps; MiB: the most device memory nvidia-smi saw the run use, CUDA context and allocator caches included; llm.c: train_gpt2cu for bf16 (random weights, -e d12), train_gpt2fp32cu for tf32 (dtrain'"'"'s initial weights); compile n/a: this PyTorch has no torch.compile)\n"
        printf "%d target(s) missed in section 4\n", miss
        exit (miss > 255 ? 255 : miss)
    }' "$1"
}

main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
