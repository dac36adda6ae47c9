"""setup.py — the one build step pyproject.toml cannot say: copy libmok.so into the package.

Where the library comes from, in order: MOK_LIBRARY (a path to a built libmok.so), else the
repository's build/libmok.so (this folder's parent), built with `make -C <repo> build/libmok.so`
when it is missing. With neither (a copy of python/ outside the repository and no MOK_LIBRARY),
the package is built without the library and needs MOK_LIBRARY set when it is imported.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def library():
    env = os.environ.get("MOK_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise SystemExit(f"mok: MOK_LIBRARY={env} is not a file")
        return Path(env)
    built = REPO / "build" / "libmok.so"
    if not built.exists() and (REPO / "Makefile").exists() and (REPO / "include" / "mok.h").exists():
        subprocess.check_call(["make", "-C", str(REPO), "build/libmok.so"])
    return built if built.exists() else None


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = library()
        if lib is None:
            print("mok: libmok.so not found (no MOK_LIBRARY, no repository around python/): the package is built "
                  "without it; set MOK_LIBRARY to a built libmok.so before importing mok")
            return
        target = Path(self.build_lib) / "mok" / "libmok.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, target)
        with open(target, "rb") as f:
            if f.read(4) != b"\x7fELF":  # e.g. copied while make was relinking it
                raise SystemExit(f"mok: {lib} is not a complete shared library; rebuild it and install again")


class BinaryDistribution(Distribution):
    """The wheel holds a native library, so it is tagged for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
