#!/usr/bin/env python3
"""tests/layers.py - the core's modules call down only.

    /usr/bin/python3 tests/layers.py          (from the repository root)

Every function a module of src/ defines belongs to it: its DT_PRIVATE
functions, its statics and the public dt_ functions defined there.  LAYERS
orders the modules, bottom first; a module that names a function of a
module in a higher layer calls upward, which must be one of ALLOWED (empty
today; docs/DESIGN.md).  Exits 1, naming the calls, on any other upward
call, and on an ALLOWED call that no longer happens.

Modules below the rendezvous store (the first distributed module) include
src/internal.h alone, never src/dist.h (the distributed modules' types and
offers).

It also checks names: every DT_PRIVATE function (what a module offers the
others) starts with one of its module's PREFIXES, so a call says where it
goes.  Statics are the file's own and need none.
Prints one line "layer check: ..." either way.
"""
import re
import sys

# Bottom first.  Modules in one tuple are one layer and call each other freely.
LAYERS = [
    ("context", "arena", "tensor", "param", "util", "record"),
    ("autograd",), ("ops", "ops_nn"), ("recompute",), ("optim",), ("ckpt",), ("dataset", "dataset_io"), ("data",), ("store",),
    ("comm", "seg"), ("join", "preempt"), ("eval",), ("launch",), ("profile",), ("codec",), ("ps", "ps_server"), ("zero", "ddp"), ("replicas",),
    ("hogwild",), ("steal",), ("parallel",), ("monitor",),
]

# Upward calls allowed, caller -> the functions it may call above it: none
# now.  Where a lower layer must let a higher one act it offers a hook the
# higher one registers (dt_grad_hooks, loader_source, comm_ext_ops in
# src/internal.h), as PyTorch's autograd offers hooks to its DDP reducer.
ALLOWED = {}

# The prefixes of each module's DT_PRIVATE functions.  The context's error
# helpers (set_error, warn) are the whole core's vocabulary and exempt.
PREFIXES = {
    "context": ("ctx_", "host_", "be_"), "arena": ("arena_",), "tensor": ("tensor_",),
    "param": ("param_",), "util": ("util_", "strbuf_"), "record": ("prof_",),
    "autograd": ("tape_", "grad_"), "ops": ("op_",), "ops_nn": ("op_",), "eval": ("eval_",), "recompute": ("recompute_",),
    "optim": ("optim_",), "ckpt": ("ckpt_",), "store": ("store_",), "data": ("loader_", "data_"), "dataset": ("dataset_",), "dataset_io": ("dataset_",),
    "comm": ("comm_",), "seg": ("seg_",), "preempt": ("preempt_",), "join": ("join_",), "launch": ("launch_",), "profile": ("prof_",), "codec": ("codec_",), "zero": ("zero_",),
    "ps": ("ps_",), "ps_server": ("ps_",), "ddp": ("ddp_",), "replicas": ("replicas_",), "hogwild": ("hogwild_",),
    "steal": ("steal_",), "parallel": ("parallel_", "pipe_"), "monitor": ("mon_",),
}
EXEMPT = {"set_error", "warn"}
OFFERED = re.compile(r"^DT_PRIVATE [A-Za-z_][\w \*]*?\b(\w+)\s*\(", re.M)


def misnamed(modules, code):
    """DT_PRIVATE functions whose names lack their module's prefix."""
    return [f"src/{m}.c offers {name}(), which lacks the module's prefix "
            f"({', '.join(PREFIXES[m])})"
            for m in modules for name in OFFERED.findall(code[m])
            if name not in EXEMPT and not name.startswith(PREFIXES[m])]


def code_of(path):
    """The file without comments, strings and character constants."""
    text = open(path).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"'(\\.|[^'\\\n])*'", "''", text)


def names_used(code):
    """Identifiers in code, but not members (after '.' or '->')."""
    return {m.group(1) for m in re.finditer(r"(?<![.>\w])([A-Za-z_]\w*)", code)
            if not code[:m.start()].rstrip().endswith(("->", "."))}


# a definition at column 0: [DT_PRIVATE|static] [type...] name(args) {
DEFINITION = re.compile(r"^(?:DT_PRIVATE |static )?[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{",
                        re.M)


def dist_below_store(modules, layer_of):
    """Modules below the first distributed one (the store) that include src/dist.h."""
    return [f"src/{m}.c includes dist.h, the distributed modules' header, from below store"
            for m in modules if layer_of[m] < layer_of["store"]
            and re.search(r'^#include "dist\.h"', open(f"src/{m}.c").read(), re.M)]


def main():
    modules = [m for layer in LAYERS for m in layer]
    layer_of = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    code = {m: code_of(f"src/{m}.c") for m in modules}
    owner = {}
    for m in modules:
        for name in DEFINITION.findall(code[m]):
            owner.setdefault(name, m)
    bad, used = [], set()
    for m in modules:
        for name in sorted(names_used(code[m])):
            o = owner.get(name)
            if not o or layer_of[o] <= layer_of[m]:
                continue
            if name in ALLOWED.get(m, ()):
                used.add((m, name))
            else:
                bad.append(f"src/{m}.c calls {name}() of src/{o}.c, a higher layer")
    gone = [f"ALLOWED lists {m} -> {n}(), which no longer happens: remove it"
            for m, names in sorted(ALLOWED.items()) for n in sorted(names) if (m, n) not in used]
    names = misnamed(modules, code) + dist_below_store(modules, layer_of)
    for line in bad + gone + names:
        print(f"layer check: {line}")
    if bad or gone or names:
        print(f"layer check: failed ({len(bad)} upward calls, {len(gone)} stale entries, "
              f"{len(names)} names without their module's prefix or headers out of place)")
        return 1
    print(f"layer check: {len(modules)} modules in {len(LAYERS)} layers call down only, "
          "each offering names with its prefix"
          + (f", but for {len(used)} listed calls" if used else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
