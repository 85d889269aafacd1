#!/usr/bin/env python3
"""tests/layers.py - the core's modules call down only.

    /usr/bin/python3 tests/layers.py [ROOT]     (ROOT: the repository, default .)

The modules and their layers are src/modules.txt, the one list the build
and the amalgamation read too.  Every function a module of src/ defines
belongs to it: its DT_PRIVATE functions, its statics and the public dt_
functions defined there.  The rules, each printed with what broke it:

  listed    every src/*.c is a module of src/modules.txt, and every module
            listed is a file
  down      a module names no function of a higher layer, also not through
            a macro of src/internal.h or src/dist.h (a macro's body counts
            as written where the macro is used)
  cycles    modules of one layer that call each other (a cycle of the call
            graph inside the layer) are declared as a cycle of
            src/modules.txt, with the reason; a declared cycle that no
            longer happens is stale
  prefix    every DT_PRIVATE function (what a module offers the others)
            starts with one of its module's prefixes, so a call says where
            it goes; statics are the file's own and need none
  dist.h    modules below the rendezvous store (the first distributed
            module) include src/internal.h alone, never src/dist.h

Where a lower layer must let a higher one act it offers a hook the higher
one registers (dt_grad_hooks, loader_source, comm_ext_ops in
src/internal.h), as PyTorch's autograd offers hooks to its DDP reducer.
Prints "layer check: ..." lines; exits 1 when a rule is broken.
"""
import glob
import os
import re
import sys

RULES = ("listed", "down", "cycles", "prefix", "dist.h")
# The context's error helpers (set_error, warn) are the whole core's vocabulary.
EXEMPT = {"set_error", "warn"}
OFFERED = re.compile(r"^DT_PRIVATE [A-Za-z_][\w \*]*?\b(\w+)\s*\(", re.M)
# a definition at column 0: [DT_PRIVATE|static] [type...] name(args) {
DEFINITION = re.compile(r"^(?:DT_PRIVATE |static )?[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{",
                        re.M)
MACRO = re.compile(r"^#define (\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)


def read_modules(path):
    """src/modules.txt -> (layer of each module in order, prefixes, cycles, errors)."""
    layer_of, prefixes, cycles, errors = {}, {}, [], []
    for n, line in enumerate(open(path), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("cycle "):
            mods, _, why = line[len("cycle "):].partition("--")
            if not why.strip():
                errors.append(f"src/modules.txt:{n}: a cycle without its reason (-- WHY)")
            cycles.append((frozenset(mods.split()), n))
            continue
        f = line.split()
        if len(f) < 3 or not f[0].isdigit():
            errors.append(f"src/modules.txt:{n}: expected LAYER MODULE PREFIX...: {line}")
            continue
        layer_of[f[1]] = int(f[0])
        prefixes[f[1]] = tuple(f[2:])
    return layer_of, prefixes, cycles, errors


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


def header_macros(root):
    """Function-like macros of the shared headers -> the names their bodies use,
    through other macros too."""
    body = {}
    for h in ("src/internal.h", "src/dist.h"):
        for name, args, text in MACRO.findall(code_of(os.path.join(root, h))):
            body[name] = names_used(text) - {a.strip() for a in args.split(",")}
    expanded = {}

    def expand(name, seen):
        if name in expanded:
            return expanded[name]
        out = set()
        for n in body[name]:
            out.add(n)
            if n in body and n not in seen:
                out |= expand(n, seen | {n})
        expanded[name] = out
        return out
    for name in body:
        expand(name, {name})
    return expanded


def uses_of(code, macros):
    """The names a module uses, a macro's body counted where it is used."""
    used = names_used(code)
    for name in list(used):
        used |= macros.get(name, set())
    return used


def sccs(nodes, edges):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def check(root):
    """{rule: [what broke it]} and the module count."""
    broken = {r: [] for r in RULES}
    layer_of, prefixes, cycles, errors = read_modules(os.path.join(root, "src/modules.txt"))
    broken["listed"] += errors
    files = {os.path.basename(p)[:-2] for p in glob.glob(os.path.join(root, "src/*.c"))}
    broken["listed"] += [f"src/{m}.c is not in src/modules.txt" for m in sorted(files - set(layer_of))]
    broken["listed"] += [f"src/modules.txt lists {m}, but there is no src/{m}.c"
                         for m in sorted(set(layer_of) - files)]
    modules = [m for m in layer_of if m in files]
    code = {m: code_of(os.path.join(root, f"src/{m}.c")) for m in modules}
    macros = header_macros(root)
    owner = {}
    for m in modules:
        for name in DEFINITION.findall(code[m]):
            owner.setdefault(name, m)
    calls = {}   # module -> modules of its own layer it calls
    for m in modules:
        for name in sorted(uses_of(code[m], macros)):
            o = owner.get(name)
            if not o or o == m:
                continue
            if layer_of[o] > layer_of[m]:
                via = "" if name in names_used(code[m]) else " (through a macro of a shared header)"
                broken["down"].append(f"src/{m}.c calls {name}() of src/{o}.c, a higher layer{via}")
            elif layer_of[o] == layer_of[m]:
                calls.setdefault(m, set()).add(o)
    found = sccs(modules, calls)
    declared = {c for c, _ in cycles}
    broken["cycles"] += [f"{' <-> '.join(sorted(c))} call each other (layer {layer_of[min(c)]}): "
                         "declare the cycle in src/modules.txt with its reason, or break it"
                         for c in found if c not in declared]
    broken["cycles"] += [f"src/modules.txt:{n}: the cycle {' '.join(sorted(c))} no longer happens: remove it"
                         for c, n in cycles if c not in found]
    broken["prefix"] += [f"src/{m}.c offers {name}(), which lacks the module's prefix "
                         f"({', '.join(prefixes[m])})"
                         for m in modules for name in OFFERED.findall(code[m])
                         if name not in EXEMPT and not name.startswith(prefixes[m])]
    if "store" in layer_of:
        broken["dist.h"] += [f"src/{m}.c includes dist.h, the distributed modules' header, from below store"
                             for m in modules if layer_of[m] < layer_of["store"]
                             and re.search(r'^#include "dist\.h"', open(os.path.join(root, f"src/{m}.c")).read(), re.M)]
    return broken, len(modules), len(set(layer_of.values())), len(declared)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    broken, n, layers, ncycles = check(root)
    for rule in RULES:
        for line in broken[rule]:
            print(f"layer check: {rule}: {line}")
    bad = [r for r in RULES if broken[r]]
    if bad:
        print(f"layer check: failed: {', '.join(f'{r} ({len(broken[r])})' for r in bad)}")
        return 1
    print(f"layer check: {n} modules in {layers} layers; rules kept: {', '.join(RULES)} "
          f"({ncycles} declared cycles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
