"""setup.py — what pyproject.toml cannot say: the package's version, and copying libmok.so into it.

The version has one home, include/mok.h (MOK_VERSION_MAJOR / _MINOR / _PATCH): read from there in
a repository, else from the library's mok_version() (MOK_LIBRARY).

Where the library comes from, in order: MOK_LIBRARY (a path to a built libmok.so), else the
repository's build/libmok.so (this folder's parent), built with `make -C <repo> build/libmok.so`
when it is missing. With neither (a copy of python/ outside the repository and no MOK_LIBRARY),
the package is built without the library and needs MOK_LIBRARY set when it is imported.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HEADER = REPO / "include" / "mok.h"


def say(message):
    """A line for the person running pip: pip shows a build's output only with -v, so the line also
    goes to the terminal, when there is one (on a line of its own, past pip's spinner)."""
    print(message, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + message + "\n")
    except OSError:
        pass


def header_version(text):
    """'MAJOR.MINOR.PATCH' from mok.h's three defines."""
    parts = [re.search(rf"^#define MOK_VERSION_{part} (\d+)$", text, re.M) for part in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise SystemExit(f"mok: {HEADER} does not define MOK_VERSION_MAJOR, _MINOR and _PATCH")
    return ".".join(p.group(1) for p in parts)


def version():
    if HEADER.exists():
        return header_version(HEADER.read_text())
    env = os.environ.get("MOK_LIBRARY")
    if env and Path(env).is_file():
        number = ctypes.CDLL(env).mok_version()
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    raise SystemExit("mok: no include/mok.h beside python/ and no MOK_LIBRARY: the package's version is unknown")


def library():
    env = os.environ.get("MOK_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise SystemExit(f"mok: MOK_LIBRARY={env} is not a file")
        return Path(env)
    built = REPO / "build" / "libmok.so"
    if not built.exists() and (REPO / "Makefile").exists() and HEADER.exists():
        say(f"mok: building libmok.so with make in {REPO} (a minute or two; the CUDA backend too when nvcc is "
            "on the PATH) ...")
        subprocess.check_call(["make", "-C", str(REPO), "build/libmok.so"])
        say("mok: libmok.so built")
    return built if built.exists() else None


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = library()
        if lib is None:
            say("mok: libmok.so not found (no MOK_LIBRARY, no repository around python/): the package is built "
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


setup(version=version(), cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
