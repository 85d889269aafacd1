# tests/checks/layers.sh - the layer check and its self-test.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# Every module of src/ calls down only (tests/layers.py, docs/DESIGN.md), and
# each of the check's rules fails on a deliberate violation.
layer_checks() {
    /usr/bin/python3 tests/layers.py && /usr/bin/python3 tests/layers_selftest.py
}
