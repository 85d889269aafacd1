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
  owners    every struct type of src/internal.h and src/dist.h is owned by
            one module (an "owns" line of src/modules.txt), or is a hook
            table ("hooks": set by a higher layer, called by a lower one);
            a type used by one module alone lives in that module's .c
  fields    a module touches the fields of a type another module owns only
            if the owner is of its cycle, or it reads (never writes) a type
            declared "open" of its own layer or a lower one, or src/modules.txt declares
            the reach ("reach MODULE TYPE... -- WHY", the debt, each to be
            replaced by a call); a declared reach that no longer happens is
            stale.  Field accesses are found in clang's syntax tree, with
            their types, also where a macro of a header expands
  foreign   a field of an owned type that its owner (with its cycle) never
            touches, but another module does, belongs to that module

Where a lower layer must let a higher one act it offers a hook the higher
one registers (dt_grad_hooks, loader_source, comm_ext_ops in
src/internal.h), as PyTorch's autograd offers hooks to its DDP reducer.
Prints "layer check: ..." lines; exits 1 when a rule is broken.
"""
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

RULES = ("listed", "down", "cycles", "prefix", "dist.h", "owners", "fields", "foreign")
# The context's error helpers (set_error, warn) are the whole core's vocabulary.
EXEMPT = {"set_error", "warn"}
OFFERED = re.compile(r"^DT_PRIVATE [A-Za-z_][\w \*]*?\b(\w+)\s*\(", re.M)
# a definition at column 0: [DT_PRIVATE|static] [type...] name(args) {
DEFINITION = re.compile(r"^(?:DT_PRIVATE |static )?[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{",
                        re.M)
MACRO = re.compile(r"^#define (\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)


def read_modules(path, types=None):
    """src/modules.txt -> (layer of each module in order, prefixes, cycles, errors).
    types, when given, receives the ownership lines: {"owns": {type: (module, line)},
    "open": {type: line}, "hooks": {type: line}, "reach": {(module, type): line}}."""
    layer_of, prefixes, cycles, errors = {}, {}, [], []
    if types is not None:
        types.update(owns={}, open={}, hooks={}, reach={})
    for n, line in enumerate(open(path), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        word = line.split()[0]
        if word in ("owns", "open", "hooks", "reach"):
            if types is not None:
                read_type_line(word, line, n, types, errors)
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


def read_type_line(word, line, n, types, errors):
    """One owns/open/hooks/reach line of src/modules.txt into types."""
    head, _, why = line.partition("--")
    f = head.split()[1:]
    if word in ("open", "hooks", "reach") and not why.strip():
        errors.append(f"src/modules.txt:{n}: {word} without its reason (-- WHY)")
    if word in ("owns", "reach") and len(f) < 2 or not f:
        errors.append(f"src/modules.txt:{n}: expected {word} {'MODULE ' if word in ('owns', 'reach') else ''}TYPE...")
        return
    if word in ("owns", "reach"):
        for t in f[1:]:
            if word == "owns" and t in types["owns"]:
                errors.append(f"src/modules.txt:{n}: {t} is owned twice")
            key = t if word == "owns" else (f[0], t)
            types[word][key] = (f[0], n) if word == "owns" else n
    else:
        types[word].update({t: n for t in f})


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


# ---------------------------------------------------------------------------
# Field access, from clang's syntax tree (-ast-dump=json): each member access
# of a module's own lines with the type of the struct it reads from, and
# whether it writes (assigns, increments or takes the address of) the field.

SHARED_HEADERS = ("src/internal.h", "src/dist.h")
_TREES = {}   # (module, hash of its sources) -> its analysis; the self-test reuses it
# ... and so do later runs: build/layers-ast.cache beside this repository's build
_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "layers-ast.cache")


def clang():
    return shutil.which("clang") or shutil.which("clang-14")


def record_of(qual, typedefs):
    """'const dt_loader *' -> 'dt_loader' (the struct's tag), None for a non-struct."""
    t = re.sub(r"\b(const|volatile|_Atomic|restrict)\b|\[[^]]*\]", " ", qual)
    base = t.replace("*", " ").strip()
    t = typedefs.get(base, t)
    m = re.search(r"\b(?:struct|union)\s+(\w+)", t)
    return m.group(1) if m else None


def _writes(node, written):
    """Which children of node a write of node (or node itself) writes."""
    k, inner = node.get("kind"), node.get("inner", [])
    out = [False] * len(inner)
    if not inner:
        return out
    op = node.get("opcode")
    if k == "BinaryOperator" and op == "=" or k == "CompoundAssignOperator" or \
            k == "UnaryOperator" and op in ("++", "--", "&"):
        out[0] = True
    elif written and (k == "MemberExpr" and not node.get("isArrow") or
                      k in ("ArraySubscriptExpr", "ParenExpr") or
                      k == "ImplicitCastExpr" and node.get("castKind") == "ArrayToPointerDecay"):
        out[0] = True
    return out


def analyse_tree(tree, module, root):
    """-> (accesses [(struct tag, field, written, line)], structs {tag: (file, [fields])},
    typedefs {name: type}).  The dump names a node's file only when it changes, so
    the walk keeps the last one seen, in the order the dump was written."""
    cur = {"file": "", "line": 0}
    acc, structs, typedefs = [], {}, {}
    mine = os.path.join(root, f"src/{module}.c")

    def see(loc):
        if not loc:
            return
        if "spellingLoc" in loc:
            see(loc["spellingLoc"])
            see(loc["expansionLoc"])
            return
        cur["file"] = loc.get("file", cur["file"])
        cur["line"] = loc.get("line", cur["line"])

    def walk(node, written):
        see(node.get("loc"))
        rng = node.get("range") or {}
        see(rng.get("begin"))
        line = cur["line"]
        see(rng.get("end"))
        k, here, inner = node.get("kind"), cur["file"], node.get("inner", [])
        if here.startswith(root + os.sep):
            if k == "RecordDecl" and node.get("completeDefinition") and node.get("name"):
                structs[node["name"]] = (os.path.relpath(here, root),
                                         [(c["name"], c["type"]["qualType"]) for c in inner
                                          if c.get("kind") == "FieldDecl" and c.get("name")])
            elif k == "TypedefDecl":
                typedefs[node["name"]] = node["type"]["qualType"]
        if k == "MemberExpr" and here == mine and inner:
            t = inner[0]["type"]
            acc.append((t.get("desugaredQualType", t["qualType"]), node["name"], written, line))
        for child, w in zip(inner, _writes(node, written)):
            walk(child, w)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100000))
    walk(tree, False)
    structs = {t: (f, [(n, record_of(q, typedefs) if "*" not in q else None) for n, q in fl])
               for t, (f, fl) in structs.items()}
    return [(record_of(q, typedefs), f, w, ln) for q, f, w, ln in acc], structs, typedefs


def sources_hash(root, module):
    """What a module's analysis depends on: its file, every header, and this
    check itself (a changed analysis invalidates the cache)."""
    h = hashlib.sha256(open(os.path.abspath(__file__), "rb").read())
    for p in [f"src/{module}.c"] + sorted(glob.glob(os.path.join(root, "src/*.h"))) + \
            sorted(glob.glob(os.path.join(root, "backends/*.h"))) + ["dtrain.h"]:
        h.update(open(os.path.join(root, p), "rb").read())
    return h.hexdigest()


def field_accesses(root, modules):
    """{module: analysis, or the compiler's complaint (a str)} through clang, a
    module's analysis reused while its sources are unchanged; None when there
    is no clang."""
    cc = clang()
    if not cc:
        return None
    root = os.path.abspath(root)
    if not _TREES and os.path.exists(_CACHE):
        try:
            _TREES.update(pickle.load(open(_CACHE, "rb")))
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
    known = len(_TREES)
    used = set()

    def one(m):
        key = (m, sources_hash(root, m))
        used.add(key)
        if key not in _TREES:
            out = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-fsyntax-only", "-Xclang", "-ast-dump=json",
                                  "-I", os.path.join(root, "src"), "-I", os.path.join(root, "backends"),
                                  "-I", root, os.path.join(root, f"src/{m}.c")],
                                 capture_output=True, text=True)
            if out.returncode != 0:   # a tree of code that does not compile proves nothing
                return m, f"clang could not read src/{m}.c: {out.stderr.strip().splitlines()[0:1]}"
            _TREES[key] = analyse_tree(json.loads(out.stdout), m, root)
        return m, _TREES[key]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        found = dict(pool.map(one, modules))
    if len(_TREES) != known and os.path.isdir(os.path.dirname(_CACHE)):
        try:
            keep = _TREES if len(_TREES) <= 400 else {k: _TREES[k] for k in used}
            with open(_CACHE + ".tmp", "wb") as f:
                pickle.dump(keep, f)
            os.replace(_CACHE + ".tmp", _CACHE)
        except OSError:
            pass
    return found


def check_fields(root, modules, layer_of, cycles, types, broken):
    """The owners, fields and foreign rules."""
    found = field_accesses(root, modules)
    if found is None:   # a skip is a failure only where CI installed clang (DT_CI=1)
        if os.environ.get("DT_CI") == "1":
            broken["fields"].append("not checked: no clang (apt-get install clang)")
        else:
            print("layer check: owners, fields, foreign: skipped (no clang; apt-get install clang)")
        return 0
    for m in sorted(m for m in found if isinstance(found[m], str)):
        broken["fields"].append(found.pop(m))
    modules = [m for m in modules if m in found]
    structs = {}
    for _, st, _ in found.values():
        structs.update(st)
    owns, opened, hooks, reach = types["owns"], types["open"], types["hooks"], types["reach"]
    shared = {t for t, (f, _) in structs.items() if f in SHARED_HEADERS}
    users = {}   # type -> the modules that touch its fields or write its name
    for m, (acc, _, _) in found.items():
        for t, _, _, _ in acc:
            users.setdefault(t, set()).add(m)
    for m in modules:
        for t in shared & names_used(code_of(os.path.join(root, f"src/{m}.c"))):
            users.setdefault(t, set()).add(m)
    for path in glob.glob(os.path.join(root, "tests/*.c")):   # white-box tests need it too
        for t in shared & names_used(code_of(path)):
            users.setdefault(t, set()).add("tests")
    # a type held by value in another shared struct cannot leave the header
    embedded = {v for t in shared for _, v in structs[t][1] if v and v != t}
    for t in sorted(shared - set(owns) - set(hooks)):
        broken["owners"].append(f"struct {t} of {structs[t][0]} has no owner: add it to an owns line of "
                                "src/modules.txt (or move it into the .c of the one module that uses it)")
    for t, (m, n) in sorted(owns.items()):
        if t not in shared:
            broken["owners"].append(f"src/modules.txt:{n}: {t} is not a struct of src/internal.h or src/dist.h")
        elif m not in layer_of:
            broken["owners"].append(f"src/modules.txt:{n}: {t} is owned by {m}, which is no module")
        elif users.get(t, set()) <= {m} and t not in hooks and t not in embedded:
            broken["owners"].append(f"src/modules.txt:{n}: {t} is used by {m} alone: define it in src/{m}.c")
    for t, n in sorted(list(opened.items()) + list(hooks.items())):
        if t not in owns and t not in hooks or t not in shared:
            broken["owners"].append(f"src/modules.txt:{n}: {t} is declared open or hooks but owned by no module")
    group = {m: {m} for m in layer_of}
    for c, _ in cycles:
        for m in c:
            group[m] = group.get(m, {m}) | set(c)
    touched, reached, foreign = {}, set(), {}
    for m in modules:
        for t, field, written, line in found[m][0]:
            if t not in owns or t in hooks:
                continue
            o = owns[t][0]
            if m in group.get(o, {o}):
                touched.setdefault(t, set()).add(field)
                continue
            foreign.setdefault((t, field), set()).add(m)
            if not written and t in opened and layer_of.get(o, 0) <= layer_of[m]:
                continue   # (a reach is stale when only such reads are left)
            if (m, t) in reach:
                reached.add((m, t))
                continue
            how = "writes" if written else "reads"
            why = "" if written or t in opened else f" ({t} is not open)"
            if layer_of.get(o, 0) > layer_of[m]:
                why = ", a higher layer"
            broken["fields"].append(f"src/{m}.c:{line} {how} {t}.{field}, owned by src/{o}.c{why}: "
                                    f"call a function of {o}, or declare the reach")
    broken["fields"] += [f"src/modules.txt:{n}: the reach of {m} into {t} no longer happens: remove it"
                         for (m, t), n in sorted(reach.items()) if (m, t) not in reached]
    for (t, field), ms in sorted(foreign.items()):
        if field not in touched.get(t, set()) and not any((m, t) in reach for m in ms):
            broken["foreign"].append(f"{t}.{field} (owned by src/{owns[t][0]}.c) is touched only by "
                                     f"{', '.join(f'src/{m}.c' for m in sorted(ms))}: it belongs there")
    return len(set(reach.values()))


def check(root):
    """{rule: [what broke it]} and the module count."""
    broken = {r: [] for r in RULES}
    types = {}
    layer_of, prefixes, cycles, errors = read_modules(os.path.join(root, "src/modules.txt"), types)
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
    nreach = check_fields(root, modules, layer_of, cycles, types, broken)
    return broken, len(modules), len(set(layer_of.values())), len(declared), nreach


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    broken, n, layers, ncycles, nreach = check(root)
    for rule in RULES:
        for line in broken[rule]:
            print(f"layer check: {rule}: {line}")
    bad = [r for r in RULES if broken[r]]
    if bad:
        print(f"layer check: failed: {', '.join(f'{r} ({len(broken[r])})' for r in bad)}")
        return 1
    print(f"layer check: {n} modules in {layers} layers; rules kept: {', '.join(RULES)} "
          f"({ncycles} declared cycles; {nreach} module{'s' if nreach != 1 else ''} "
          f"declare{'' if nreach != 1 else 's'} reaches into another module's fields)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
