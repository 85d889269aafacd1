#!/usr/bin/env bash
# tests/packages.sh - the Debian packages a command of ./build.sh needs,
# installed when they are missing (as root), else the apt-get line to run.
# Why each one is here: docs/DEPENDENCIES.md.
#
#   bash tests/packages.sh GROUP...     build data test bench python fuzz ci
#
# Only the commands that set a machine up call it (./build.sh demo, test,
# deps, bench, fuzz, python): a plain build, `make` and the rest never ask
# a package manager, and on a system without dpkg this says what it would
# have installed and returns, leaving the compiler to name what is missing.
set -euo pipefail

declare -A GROUP=(
    [build]="gcc make libopenblas-dev libfabric-dev libmicrohttpd-dev zlib1g-dev libcmocka-dev pkg-config"
    [data]="dataset-fashion-mnist fortunes"
    [test]="valgrind clang"   # clang: the layer check reads its syntax trees (tests/layers.py)
    [bench]="python3-torch python3-numpy time"
    [python]="python3-venv python3-numpy python3-setuptools python3-wheel"
    [fuzz]="clang libclang-rt-14-dev"   # libFuzzer (tests/fuzz/)
    # what ./build.sh test's end-to-end checks run besides the library
    [ci]="python3-pip python3-setuptools qemu-user iproute2 iputils-ping
          python3-prometheus-client chromium python3-torch slurm-wlm munge"
)

want=""
for g in "$@"; do
    [ -n "${GROUP[$g]+x}" ] || { echo "tests/packages.sh: no group '$g' (${!GROUP[*]})" >&2; exit 2; }
    want="$want ${GROUP[$g]}"
done
if ! command -v dpkg-query > /dev/null; then
    echo "tests/packages.sh: no dpkg here; not checked:$(echo $want | tr -s ' \n' ' ' | sed 's/^/ /')" >&2
    exit 0
fi
missing=""
for p in $want; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "build.sh: installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -q > /dev/null
    apt-get -o DPkg::Lock::Timeout=300 install -y -q $missing > /dev/null
else
    echo "build.sh: missing Debian packages:$missing" >&2
    echo "  run: sudo apt-get update && sudo apt-get install -y$missing" >&2
    exit 1
fi
