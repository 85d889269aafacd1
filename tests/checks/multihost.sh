# tests/checks/multihost.sh - several hosts in network namespaces.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# tests/multihost.sh, whose skip (no namespaces here, no ../shared) counts
# as one (skipped).
multihost_check() {
    local out
    out=$(bash tests/multihost.sh "$PWD/$BUILD/test") || { echo "$out"; exit 1; }
    if [[ $out == *"multi-host: skipped ("* ]]; then
        local why=${out##*multi-host: skipped (}
        skipped "multi-host" "${why%)*}"
    else
        echo "$out"
    fi
}
