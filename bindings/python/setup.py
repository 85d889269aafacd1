"""Puts libdtrain.so and the dtrun launcher into the wheel beside the module
(package dtrain_native); pyproject.toml makes dtrun a command (dtrain.dtrun_main).

Both come from DTRAIN_LIB (and the dtrun beside it) when set; else from the source
tree's build/portable, which `./build.sh python` makes for any x86-64 (run here, it
is quick when they are current).  build.sh needs gcc and Debian's libopenblas-dev,
libfabric-dev, libmicrohttpd-dev and zlib1g-dev (it installs them as root, and
prints the apt-get line otherwise).  The metadata is in pyproject.toml.
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def need_wheel():
    """pip builds through setuptools' bdist_wheel, which Debian's python3-wheel has;
    without it pip's error is "invalid command 'bdist_wheel'": say the fix instead."""
    if not {"bdist_wheel", "dist_info"} & set(sys.argv):   # (pip's metadata step: dist_info)
        return
    try:
        import wheel  # noqa: F401
    except ImportError:
        raise SystemExit("dtrain: building the package needs the 'wheel' module, which is not "
                         "installed: apt-get install python3-wheel and use a venv made with "
                         "--system-site-packages (or run ./build.sh python, "
                         "which installs what pip needs), then pip install again")


def shipped():
    """(libdtrain.so, dtrun or None) to ship: DTRAIN_LIB's, or the tree's portable build."""
    env = os.environ.get("DTRAIN_LIB")
    if env:
        dtrun = os.path.join(os.path.dirname(env), "dtrun")
        return env, dtrun if os.access(dtrun, os.X_OK) else None
    if os.path.exists(os.path.join(ROOT, "build.sh")):
        print("dtrain: ./build.sh python (the portable libdtrain.so and dtrun)", file=sys.stderr)
        subprocess.run([os.path.join(ROOT, "build.sh"), "python"], cwd=ROOT, check=True,
                       stdout=sys.stderr)
    lib, dtrun = (os.path.join(ROOT, "build", "portable", n) for n in ("libdtrain.so", "dtrun"))
    if not os.path.exists(lib):
        raise SystemExit("dtrain: no libdtrain.so: set DTRAIN_LIB, or install from the "
                         "source tree (bindings/python inside it)")
    return lib, dtrun


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "dtrain_native")
        os.makedirs(dest, exist_ok=True)
        lib, dtrun = shipped()
        shutil.copy(os.path.realpath(lib), os.path.join(dest, "libdtrain.so"))
        if dtrun:
            shutil.copy(dtrun, os.path.join(dest, "dtrun"))   # (its mode too: executable)
        cuda = os.path.join(os.path.dirname(os.path.realpath(lib)), "..", "libdtrain_cuda.so")
        for c in (os.path.join(os.path.dirname(lib), "libdtrain_cuda.so"), cuda):
            if os.path.exists(c):   # the CUDA backend, which libdtrain.so loads from beside it
                shutil.copy(c, os.path.join(dest, "libdtrain_cuda.so"))
                break
        with open(os.path.join(dest, "__init__.py"), "w") as f:
            f.write('"""libdtrain.so and dtrun, shipped with the dtrain module."""\n')


need_wheel()
setup(cmdclass={"build_py": BuildWithLibrary})
