"""Puts libdtrain.so into the wheel beside the module (package dtrain_native).

The library comes from DTRAIN_LIB when set, else the source tree's build/libdtrain.so;
when neither exists and the source tree is here, `./build.sh build` makes it (gcc and
Debian's libopenblas-dev, libfabric-dev, libmicrohttpd-dev and zlib1g-dev; build.sh
installs them).  The metadata is in pyproject.toml.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def library():
    """The libdtrain.so to ship: DTRAIN_LIB, the tree's build, or one built now."""
    env = os.environ.get("DTRAIN_LIB")
    if env:
        return env
    built = os.path.join(ROOT, "build", "libdtrain.so")
    if not os.path.exists(built) and os.path.exists(os.path.join(ROOT, "build.sh")):
        subprocess.run([os.path.join(ROOT, "build.sh"), "build"], cwd=ROOT, check=True)
    if not os.path.exists(built):
        raise SystemExit("dtrain: no libdtrain.so: set DTRAIN_LIB, or install from the "
                         "source tree (bindings/python inside it)")
    return built


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "dtrain_native")
        os.makedirs(dest, exist_ok=True)
        shutil.copy(os.path.realpath(library()), os.path.join(dest, "libdtrain.so"))
        with open(os.path.join(dest, "__init__.py"), "w") as f:
            f.write('"""libdtrain.so, shipped with the dtrain module."""\n')


setup(cmdclass={"build_py": BuildWithLibrary})
