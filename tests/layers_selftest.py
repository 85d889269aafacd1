#!/usr/bin/env python3
"""tests/layers_selftest.py - every rule of tests/layers.py fails on a
deliberate violation.

    /usr/bin/python3 tests/layers_selftest.py      (from the repository root)

Each case copies src/ into a scratch directory, breaks one rule there and
checks that tests/layers.py names that rule (and that the untouched copy
passes).  Prints one line "layer check self-test: ..."; exits 1 when a
violation goes unnoticed.
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers  # noqa: E402


def append(path, text):
    with open(path, "a") as f:
        f.write(text)


def edit(path, old, new):
    text = open(path).read()
    assert old in text, f"{path}: {old!r} not found"
    open(path, "w").write(text.replace(old, new, 1))


def function_of(root, module):
    """A function the module defines."""
    return layers.DEFINITION.findall(layers.code_of(os.path.join(root, f"src/{module}.c")))[0]


def top_function(root):
    """A function of the monitor, the top layer."""
    return function_of(root, "monitor")


# (name, the rule it must break, how: a function of the scratch root[, words
# the rule's message must hold])
CASES = [
    ("a src/*.c not listed", "listed",
     lambda r: open(os.path.join(r, "src/extra.c"), "w").write("int extra(void) { return 0; }\n")),
    ("a listed module without its file", "listed",
     lambda r: append(os.path.join(r, "src/modules.txt"), "22 ghost ghost_\n")),
    ("an upward call", "down",
     lambda r: append(os.path.join(r, "src/tensor.c"),
                      f"\nstatic void up(void) {{ {top_function(r)}(0); }}\n")),
    ("an upward call hidden in a header macro", "down",
     lambda r: (append(os.path.join(r, "src/internal.h"),
                       f"\n#define HIDDEN_UP(x) {top_function(r)}(x)\n"),
                append(os.path.join(r, "src/tensor.c"), "\nstatic void up(void) { HIDDEN_UP(0); }\n")),
     "through a macro"),
    ("a cycle inside a layer, undeclared", "cycles",
     lambda r: append(os.path.join(r, "src/ops.c"),
                      f"\nstatic void back(void) {{ {function_of(r, 'ops_nn')}(0); }}\n")),
    ("a declared cycle that no longer happens", "cycles",
     lambda r: append(os.path.join(r, "src/modules.txt"), "cycle optim ckpt -- none\n")),
    ("an offered name without its module's prefix", "prefix",
     lambda r: append(os.path.join(r, "src/tensor.c"), "\nDT_PRIVATE int unprefixed(void) { return 0; }\n")),
    ("dist.h below the store", "dist.h",
     lambda r: edit(os.path.join(r, "src/tensor.c"), '#include "internal.h"', '#include "dist.h"')),
    ("a struct of a shared header without an owner", "owners",
     lambda r: edit(os.path.join(r, "src/modules.txt"), "owns store dt_store\n", "")),
    ("a field of a higher layer's struct read", "fields",
     lambda r: append(os.path.join(r, "src/tensor.c"),
                      "\nint64_t up_field(const dt_loader *ld);\n"
                      "int64_t up_field(const dt_loader *ld) { return ld->n_local; }\n"),
     "a higher layer"),
    ("a field of a lower layer's struct written", "fields",
     lambda r: append(os.path.join(r, "src/store.c"),
                      "\nvoid poke_field(dt_tensor *t);\nvoid poke_field(dt_tensor *t) { t->ndim = 0; }\n"),
     "writes dt_tensor.ndim"),
    ("a field of a struct that is not open read", "fields",
     lambda r: append(os.path.join(r, "src/store.c"),
                      "\nint peek_field(const dt_optim *o);\nint peek_field(const dt_optim *o) { return o->n; }\n"),
     "dt_optim is not open"),
    ("a declared reach that no longer happens", "fields",
     lambda r: append(os.path.join(r, "src/modules.txt"), "reach store dt_tensor -- none\n"),
     "no longer happens"),
    ("a field its owner never touches", "foreign",
     lambda r: (edit(os.path.join(r, "src/internal.h"), "struct dt_tensor {\n",
                     "struct dt_tensor {\n    int only_store;\n"),
                append(os.path.join(r, "src/store.c"),
                       "\nint peek_field(const dt_tensor *t);\n"
                       "int peek_field(const dt_tensor *t) { return t->only_store; }\n")),
     "dt_tensor.only_store"),
]


def scratch(src):
    """A copy of src/ beside the headers and tests it is checked with."""
    d = tempfile.mkdtemp(prefix="layers-selftest-")
    shutil.copytree(os.path.join(src, "src"), os.path.join(d, "src"))
    for name in ("dtrain.h", "backends", "tests"):
        os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(d, name))
    return d


def main():
    root = "."
    failures = []
    d = scratch(root)
    broken = layers.check(d)[0]
    if any(broken.values()):
        failures.append(f"the untouched copy breaks {[r for r in broken if broken[r]]}")
    shutil.rmtree(d)
    for name, rule, breaks, *words in CASES:
        d = scratch(root)
        breaks(d)
        broken = layers.check(d)[0]
        if not broken[rule]:
            failures.append(f"{name}: the {rule} rule did not fail")
        elif words and not any(words[0] in line for line in broken[rule]):
            failures.append(f"{name}: the {rule} rule failed without saying '{words[0]}'")
        shutil.rmtree(d)
    for f in failures:
        print(f"layer check self-test: {f}")
    if failures:
        return 1
    print(f"layer check self-test: {len(CASES)} deliberate violations, each failed its rule "
          f"({', '.join(sorted({c[1] for c in CASES}))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
