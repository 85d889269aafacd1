# tests/checks/python.sh - the Python binding.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The Python binding (bindings/python) on Debian's python3 + numpy.  Its unit
# tests run against a sanitized libdtrain.so (ASan and UBSan preloaded into
# the interpreter): layouts of the mirrored structs, errors with the C
# message, zero copy, lifetimes, gradients, checkpoints, DDP under dtrun
# and a dead peer.  Then the Fashion-MNIST example in Python must reach the
# C example's accuracy to the digit with the same seed, alone and as 2 DDP
# ranks under the launcher (optimized library and programs).
python_checks() {
    local py=/usr/bin/python3 so=$BUILD/test/pysan/libdtrain.so c p want got
    DTRAIN_LIB=$PWD/$so DTRUN=$PWD/$BUILD/test/dtrun CC=$CC \
        LD_PRELOAD="$($CC -print-file-name=libasan.so) $($CC -print-file-name=libubsan.so)" \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 OPENBLAS_NUM_THREADS=1 \
        $py bindings/python/tests/test_dtrain.py > $BUILD/test/python.log 2>&1 ||
        { tail -40 $BUILD/test/python.log; echo "python checks: the binding's tests failed"; exit 1; }
    tail -1 $BUILD/test/python.log
    $py bindings/python/tests/coverage.py | tail -1
    build_examples
    for ranks in 1 2; do
        if [ $ranks = 1 ]; then
            c=$($BUILD/fashion_mnist --epochs 1 --limit-batches 150 --seed 4)
            p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so $py bindings/python/examples/fashion_mnist.py \
                --epochs 1 --limit-batches 150 --seed 4)
        else
            c=$($BUILD/fashion_mnist --epochs 1 --limit-batches 100 --seed 4 --ranks 2)
            p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so $BUILD/dtrun -n 2 $py \
                bindings/python/examples/fashion_mnist.py --epochs 1 --limit-batches 100 --seed 4)
        fi
        want=$(echo "$c" | sed -n 's/^test accuracy: //p')
        got=$(echo "$p" | sed -n 's/^\(\[0\] \)\{0,1\}test accuracy: //p')
        if [ -z "$want" ] || [ "$want" != "$got" ]; then
            echo "python checks: $ranks rank(s): the Python example reached '$got', C '$want':"
            echo "$p" | tail -5; exit 1
        fi
        echo "python checks: $ranks rank(s): Python and C example both reach $want test accuracy"
    done
    # the GPT twin, its text a NumPy array: the same training losses as the C example
    c=$(OPENBLAS_NUM_THREADS=1 $BUILD/gpt --steps 30 --eval-every 15 --eval-batches 2 --sample 0 |
        sed -n 's/^step \([0-9]*\): train loss \([0-9.]*\),.*/\1 \2/p')
    p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so OPENBLAS_NUM_THREADS=1 $py bindings/python/examples/gpt.py \
        --steps 30 --eval-every 15 --eval-batches 2 | sed -n 's/^step \([0-9]*\): train loss \([0-9.]*\),.*/\1 \2/p')
    if [ -z "$c" ] || [ "$c" != "$p" ]; then
        echo "python checks: the GPT twin's losses '$p' differ from C's '$c'"; exit 1
    fi
    echo "python checks: the GPT twin and the C example have the same train losses ($(echo $c))"
    python_ps_check
    python_pip_check
    python_readme_install_check
}

# 2 workers and a parameter server (BSP) under dtrun: the Python example
# reaches the C example's test accuracy.
python_ps_check() {
    local py=/usr/bin/python3 c p
    c=$($BUILD/fashion_mnist --ranks 3 --servers 1 --epochs 1 --limit-batches 60 --seed 4 |
        sed -n 's/^test accuracy: //p')
    p=$(DTRAIN_LIB=$PWD/$BUILD/libdtrain.so $BUILD/dtrun -n 3 $py \
        bindings/python/examples/fashion_mnist.py --servers 1 --epochs 1 --limit-batches 60 \
        --seed 4 | sed -n 's/^\[0\] test accuracy: //p')
    if [ -z "$c" ] || [ "$c" != "$p" ]; then
        echo "python checks: with a parameter server the Python example reached '$p', C '$c'"; exit 1
    fi
    echo "python checks: 2 workers + 1 parameter server: Python and C example both reach $c"
}

# pip install ./bindings/python into a fresh virtual environment (Debian's
# setuptools and NumPy: no index to download from), then both examples from
# it, outside the tree and without DTRAIN_LIB: they load the installed
# module and the libdtrain.so it ships, and match the C examples.
python_pip_check() {
    local venv=$PWD/$BUILD/test/venv root=$PWD acc c p lib
    rm -rf $venv
    /usr/bin/python3 -m venv --system-site-packages $venv
    $venv/bin/pip install --quiet --no-build-isolation --no-index ./bindings/python > $BUILD/test/pip.log 2>&1 ||
        { tail -20 $BUILD/test/pip.log; echo "python checks: pip install failed"; exit 1; }
    lib=$(cd / && env -u DTRAIN_LIB $venv/bin/python -c 'import dtrain; print(dtrain.library_path)')
    case "$lib" in
        $venv/*/dtrain_native/libdtrain.so) ;;
        *) echo "python checks: the installed module loads '$lib', not the one pip installed"; exit 1 ;;
    esac
    acc=$($BUILD/fashion_mnist --epochs 1 --limit-batches 50 --seed 4 | sed -n 's/^test accuracy: //p')
    p=$(cd / && env -u DTRAIN_LIB $venv/bin/python $root/bindings/python/examples/fashion_mnist.py \
        --epochs 1 --limit-batches 50 --seed 4 | sed -n 's/^test accuracy: //p')
    [ -n "$acc" ] && [ "$acc" = "$p" ] ||
        { echo "python checks: installed: the Fashion-MNIST example reached '$p', C '$acc'"; exit 1; }
    c=$(OPENBLAS_NUM_THREADS=1 $BUILD/gpt --steps 10 --eval-every 10 --eval-batches 1 --sample 0 |
        sed -n 's/^step \([0-9]*\): train loss \([0-9.]*\),.*/\1 \2/p')
    p=$(cd / && env -u DTRAIN_LIB OPENBLAS_NUM_THREADS=1 $venv/bin/python \
        $root/bindings/python/examples/gpt.py --steps 10 --eval-every 10 --eval-batches 1 |
        sed -n 's/^step \([0-9]*\): train loss \([0-9.]*\),.*/\1 \2/p')
    [ -n "$c" ] && [ "$c" = "$p" ] ||
        { echo "python checks: installed: the GPT example's losses '$p', C '$c'"; exit 1; }
    echo "python checks: pip install into a fresh venv; from it (${lib#$root/}) the Fashion-MNIST" \
        "example reaches C's $acc and the GPT example C's losses ($(echo $c))"
}

# The binding README's install lines, verbatim, as a new user runs them:
# HOME a new directory with the clone at ~/dtrain (a link to this tree), a
# bare environment, and PyPI unreachable (no network namespace's routes
# where unshare works, as root; a refusing proxy in any case).
python_readme_install_check() {
    local home lines out lib net=""
    home=$(mktemp -d)
    ln -s "$PWD" "$home/dtrain"
    lines=$(awk '/^## Installing with pip/ { s = 1 } s && /^```sh$/ { f = 1; next }
                 f && /^```$/ { exit } f' bindings/python/README.md)
    [ -n "$lines" ] || { echo "python checks: no install lines in bindings/python/README.md"; exit 1; }
    if unshare -n true 2>/dev/null; then net="unshare -n"; lines="ip link set lo up; $lines"; fi
    out=$(cd "$home" && env -i HOME="$home" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
          http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 \
          PIP_INDEX_URL=http://127.0.0.1:9/simple $net bash -euo pipefail -c "$lines" 2>&1) ||
        { echo "$out" | tail -20; echo "python checks: the binding README's install lines failed"; exit 1; }
    lib=$(echo "$home"/venvs/dtrain/lib/python3*/site-packages/dtrain_native/libdtrain.so)
    case "$out" in
        *"dtrain $(dt_version) $lib"*"[0] test accuracy: "*) ;;
        *) echo "$out" | tail -10
           echo "python checks: the README's install lines did not load $lib and train"; exit 1 ;;
    esac
    # the wheel's library is the portable one (tests/install_check.sh checks its ISA)
    cmp -s "$lib" "$(realpath $BUILD/portable/libdtrain.so)" && [ -x "$home/venvs/dtrain/bin/dtrun" ] ||
        { echo "python checks: the venv lacks build/portable's libdtrain.so or dtrun"; exit 1; }
    rm -rf "$home"
    echo "python checks: the binding README's install lines run as printed (no PyPI, a new HOME): $(echo "$out" | grep -m1 '^dtrain ')"
}
