"""Every public C function has a Python binding: a check that fails otherwise.

    /usr/bin/python3 bindings/python/tests/coverage.py

A function counts as bound when dtrain.py declares it (its name in a
declaration list, or bound with _fn) and uses it (_C.<name without dt_>,
called or handed on, or the variable _fn gave it, beyond its binding).  Prints the functions that are not, and one
line "python coverage: N of N C functions bound"; exits 1 when any is not.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))


def c_functions(header):
    """The DT_API functions of dtrain.h."""
    with open(header) as f:
        text = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
    return sorted(set(re.findall(r"DT_API[^;(]*?\b(dt_\w+)\s*\(", text)))


def unbound(functions, module):
    """Those of functions that module's text does not both declare and call."""
    direct = dict(re.findall(r"(\w+)\s*=\s*_fn\(\"(dt_\w+)\"", module))   # var -> name
    direct = {name: var for var, name in direct.items()}
    missing = []
    for f in functions:
        if f in direct:
            ok = len(re.findall(r"\b%s\b" % re.escape(direct[f]), module)) >= 2
        else:
            ok = ('"%s"' % f in module and
                  re.search(r"_C\.%s\b" % re.escape(f[3:]), module) is not None)
        if not ok:
            missing.append(f)
    return missing


def main():
    functions = c_functions(os.path.join(ROOT, "dtrain.h"))
    with open(os.path.join(HERE, "..", "dtrain.py")) as f:
        module = f.read()
    missing = unbound(functions, module)
    for f in missing:
        print("python coverage: %s has no binding in bindings/python/dtrain.py" % f)
    print("python coverage: %d of %d C functions bound" % (len(functions) - len(missing),
                                                         len(functions)))
    return 1 if missing or len(functions) < 200 else 0


if __name__ == "__main__":
    sys.exit(main())
