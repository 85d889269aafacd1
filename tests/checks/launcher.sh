# tests/checks/launcher.sh - launchers (dtrun, torchrun-style variables).
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# dtrun end to end: 3 ranks join through the environment, the store and
# the token it sets, pick shm (one host), and agree on the sums.
launcher_checks() {
    local out
    out=$(ASAN_OPTIONS=detect_leaks=1 timeout -k 5 60 $BUILD/test/dtrun -n 3 $BUILD/test/allreduce)
    for r in 0 1 2; do
        case "$out" in
            *"[$r] rank $r of 3 over shm: sums 3 3 5 6"*) ;;
            *) echo "launcher check: rank $r's line missing in:"; echo "$out"; exit 1 ;;
        esac
    done
    out=$(DTRAIN_TRANSPORT=tcp DTRAIN_HOST=127.0.0.1 timeout -k 5 60 $BUILD/test/dtrun -n 2 $BUILD/test/allreduce)
    case "$out" in *"[1] rank 1 of 2 over tcp;ofi_rxm: sums 1 2 1 4"*) ;;
        *) echo "launcher check (tcp) failed:"; echo "$out"; exit 1 ;; esac
    echo "launcher checks: ok"
}
