#!/usr/bin/env bash
# tests/args_check.sh BUILD_DIR - every example's command line is strict
# (examples/args.h): junk after a number, an empty one, overflow, a value
# out of range or not among the choices, an unknown option, a missing
# value and a stray argument are each refused with exit status 2 and a
# message on stderr naming the option; --help exits 0 with the usage on
# stdout; and well-formed lines (every spelling getopt_long takes) are
# still accepted.  Prints one summary line; exits non-zero on any failure.
set -uo pipefail
B=${1:?usage: tests/args_check.sh BUILD_DIR (where the examples are, e.g. build/test)}
refused=0 accepted=0 failed=0 progs=()

# Each line is run after the program's guard arguments (a dataset or file
# that does not exist): a line wrongly accepted then fails fast, with a
# status other than 2, instead of training.
guard=()

# run PROG ARGS...: PROG guard ARGS; its exit status in rc, its stderr in err.
run() {
    local prog=$1
    shift
    err=$(timeout -k 5 60 "$B/$prog" "${guard[@]}" "$@" 2>&1 >/dev/null)
    rc=$?
}

# fail WHAT: say what went wrong, with the end of the stderr (a line a rank,
# had it started ranks).
fail() {
    echo "args check: $1 (stderr: $(tail -3 <<< "${err:-none}"))"
    failed=$((failed + 1))
}

# says_the_value ARGS...: does the message (the first line of $err; the
# usage text after it does not count) say which value it refused: quote an
# argument or a part of one ('0.5' of --slow 1:0.5), give an option with
# its value ("--batch 2 is less than --micro 4"), or say that the option
# needs a value, takes none, or is required (nothing to quote)?
says_the_value() {
    local q a prev="" msg=${err%%$'\n'*}
    [[ $msg == *"needs a value"* || $msg == *"takes no value"* || $msg == *"is required"* ||
       $msg == *"no program to run"* ]] && return 0
    for a in "$@"; do
        [[ $prev == -* && $a != -* && $msg == *"$prev $a"* ]] && return 0
        prev=$a
    done
    while IFS= read -r q; do
        q=${q:1:${#q}-2}
        for a in "$@"; do
            [ -z "$q" ] && [ -z "$a" ] && return 0
            [ -n "$q" ] && [[ $a == *"$q"* ]] && return 0
        done
    done < <(grep -o "'[^']*'" <<< "$msg")
    return 1
}

# bad PROG WORD ARGS...: PROG guard ARGS exits 2, and the first line of its
# stderr (the message, not the usage after it) names WORD (the option, or
# what is wrong) and says the value it refused (says_the_value).
bad() {
    local prog=$1 word=$2 err rc
    shift 2
    run "$prog" "$@"
    if [ "$rc" != 2 ]; then
        fail "$prog $*: exit status $rc, not 2"
    elif [[ ${err%%$'\n'*} != *"$word"* ]]; then
        fail "$prog $*: refused, but the message does not name '$word'"
    elif [ $# -gt 0 ] && ! says_the_value "$@"; then
        fail "$prog $*: refused, but the message does not say which value"
    else
        refused=$((refused + 1))
    fi
}

# good PROG STATUS ARGS...: a well-formed line passes the parser; PROG guard
# ARGS ends with STATUS (1: the guard's missing data, found after parsing).
good() {
    local prog=$1 want=$2 err rc
    shift 2
    run "$prog" "$@"
    if [ "$rc" != "$want" ]; then
        fail "$prog $*: exit status $rc, expected $want"
    else
        accepted=$((accepted + 1))
    fi
}

# help_ok PROG: --help and -h exit 0 with "usage" on stdout.
help_ok() {
    local out flag
    progs+=("$1")
    for flag in --help -h; do
        out=$("$B/$1" $flag 2>/dev/null) && [[ $out == *usage* ]] && continue
        err="" fail "$1 $flag: not a usage text with exit status 0"
    done
}

help_ok fashion_mnist
guard=(--data /nonexistent)
bad fashion_mnist --epochs --epochs 12abc
bad fashion_mnist --epochs --epochs ""
bad fashion_mnist --batch --batch 99999999999999999999
bad fashion_mnist --ranks --ranks 0
bad fashion_mnist --threads --threads 5000
bad fashion_mnist --lr --lr 0
bad fashion_mnist --lr --lr inf
bad fashion_mnist --lr --lr=x
bad fashion_mnist --seed --seed -1
bad fashion_mnist --slow --slow 1
bad fashion_mnist --slow --slow 1:0.5
bad fashion_mnist --slow --slow x:2
bad fashion_mnist --model --model rnn
bad fashion_mnist --amp --amp fp8
bad fashion_mnist --profile --profile=1
bad fashion_mnist --bogus --bogus 1
bad fashion_mnist --epochs --epochs
bad fashion_mnist extra extra
bad fashion_mnist --resume --resume auto
good fashion_mnist 1 --model=cnn --epochs 3 --batch=64 --lr 1e-2 --optim sgd --amp off --threads 2 \
    --seed 18446744073709551615 --slow 0:1.5 --balance --limit-batches 5 --ps-mode asp --stal 3

help_ok pipeline_mnist
guard=(--data /nonexistent)
bad pipeline_mnist --stages --stages 12abc
bad pipeline_mnist --stages --stages 9
bad pipeline_mnist --micro --micro 99999999999999999999
bad pipeline_mnist --micro --batch 2 --micro 4
bad pipeline_mnist --schedule --schedule 2f2b
bad pipeline_mnist --limit-batches --limit-batches -1
bad pipeline_mnist --seed --seed x
bad pipeline_mnist --bogus --bogus
bad pipeline_mnist --epochs --epochs
bad pipeline_mnist extra extra
good pipeline_mnist 1 --stages 1 --replicas 1 --micro 2 --schedule gpipe --batch 32 \
    --limit-batches 0

help_ok ps_sparse
guard=(--dump /nonexistent/clicks.bin)
bad ps_sparse --ranks --ranks 1
bad ps_sparse --rows --rows 2147483647
bad ps_sparse --samples --samples 99999999999999999999
bad ps_sparse --dim --dim 16x
bad ps_sparse --lr --lr -1
bad ps_sparse --mode --mode hogwild
bad ps_sparse --prefetch --prefetch=1
bad ps_sparse --bogus --bogus
bad ps_sparse --batch --batch
bad ps_sparse extra extra
good ps_sparse 1 --ranks 4 --servers 2 --mode ssp --staleness 0 --samples 1000 --test 100 \
    --rows 65536 --dim 8 --batch 64 --lr 0.1 --prefetch

help_ok csv_regress
guard=(/nonexistent.csv)
bad csv_regress --hidden --hidden x
bad csv_regress --steps --steps 0
bad csv_regress --steps --steps 99999999999999999999
bad csv_regress --lr --lr ""
bad csv_regress --bogus --bogus 3
bad csv_regress --lr --lr
bad csv_regress extra.csv extra.csv
guard=()
bad csv_regress FILE.csv
guard=(/nonexistent.csv)
good csv_regress 1 --hidden 8 --steps 10 --lr=0.01
guard=()
good csv_regress 1 --hidden 8 /nonexistent.csv --steps 10

help_ok dtrun
guard=()
bad dtrun nproc -n 12abc true
bad dtrun nproc -n 0 true
bad dtrun nproc --nproc 99999999999999999999 true
bad dtrun --grace -n 2 --grace x true
bad dtrun --max-restarts -n 2 --max-restarts 1001 true
bad dtrun --min-ranks -n 2 --min-ranks "" true
bad dtrun --no-bind -n 2 --no-bind=1 true
bad dtrun --bogus -n 2 --bogus true
bad dtrun nproc -n
bad dtrun -n true
bad dtrun program -n 2
# the program's own options are its own: they reach it as they are
good dtrun 0 -n 2 --no-prefix --grace 100 sh -c '[ "$*" = "-n 5 --bogus -- x" ]' sh \
    -n 5 --bogus -- x
good dtrun 0 --nproc=1 --max-restarts 1 --min-ranks 1 --no-bind -- true --epochs 12abc

help_ok allreduce
bad allreduce --bogus --bogus
bad allreduce extra extra

help_ok gpt
guard=(--data /nonexistent)
bad gpt --steps --steps 12abc
bad gpt --steps --steps 99999999999999
bad gpt --steps --steps 0
bad gpt --lr --lr x
bad gpt --vocab --vocab 10
bad gpt --seed --seed -1
bad gpt --bogus --bogus 1
bad gpt --steps --steps
bad gpt extra extra
bad gpt --amp --amp fp8

summary="$refused malformed command lines refused by ${#progs[@]} examples, each with exit status 2"
summary="$summary and a message naming the option and the value; $accepted well-formed ones accepted"
[ $failed = 0 ] || summary="$summary; FAILED: $failed"
echo "args check: $summary"
[ $failed = 0 ]
