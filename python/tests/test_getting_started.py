"""test_getting_started.py — what a new user meets first, beyond the README's examples: the Python
suite on a machine without PyTorch (every test passes or skips with its reason; run here with torch
made unimportable), `make` building in parallel by default, and `pip install ./python` saying that
it builds the library before the long make.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

import mok

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def _env():
    """The environment of this run, with this binding and its library for a child interpreter."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok.__file__)))
    return dict(os.environ, MOK_LIBRARY=mok.library_path,
                PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))


def test_suite_passes_without_torch(tmp_path):
    """The whole Python suite (but this test) with `import torch` failing as on a machine without it:
    nothing fails, and the torch tests are skipped with a reason that names torch."""
    code = ("import sys\n"
            "sys.modules['torch'] = None  # import torch raises ImportError, as without PyTorch\n"
            "import pytest\n"
            "sys.exit(pytest.main(sys.argv[1:]))\n")
    args = [sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider", HERE,
            "-k", "not test_suite_passes_without_torch"]
    out = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1800)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    failures = out.stdout[-4000:] + out.stderr
    assert out.returncode == 0 and " failed" not in summary and " error" not in summary, failures
    assert re.search(r"\d+ passed", summary) and re.search(r"\d+ skipped", summary), summary
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("torch" in line for line in skips), skips
    assert all(line.split(":", 2)[-1].strip() for line in skips), skips  # every skip says why


def _makeflags(*args):
    """The MAKEFLAGS make settles on for the repository's Makefile (its database, -p, nothing built),
    run as a user runs it: not under another make (make test), whose jobs it would share."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "-pq", "-C", REPO, "CUDA=0", *args], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("MAKEFLAGS = ")]
    assert lines, out.stdout[-2000:] + out.stderr
    return lines[-1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_builds_in_parallel_by_default():
    jobs = os.cpu_count() or 1
    if shutil.which("nproc"):
        jobs = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout)
    assert f" -j{jobs} " in _makeflags() + " ", "plain `make` is not parallel"
    assert " -j1 " in _makeflags("-j1") + " ", "make -j1 does not win over the default"


def test_pip_install_says_it_builds_before_make(tmp_path):
    """setup.py, where build/libmok.so is missing, says that it builds the library (on stderr, and on
    the terminal past pip) before make starts. A stand-in make on the PATH records when it ran and
    makes the library file."""
    pytest.importorskip("setuptools", reason="setup.py needs setuptools")
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "python"), repo / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "libmok.so"))
    (repo / "include").mkdir()
    shutil.copy(os.path.join(REPO, "include", "mok.h"), repo / "include" / "mok.h")
    (repo / "Makefile").write_text("# stands in for the repository's Makefile\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "make"
    fake.write_text("#!/bin/sh\necho 'stand-in make ran' >&2\nmkdir -p \"$2/build\"\n"
                    "printf '\\177ELF' > \"$2/build/libmok.so\"\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("MOK_LIBRARY", None)
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "out")],
                         cwd=repo / "python", env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stderr.find("mok: building libmok.so with make")
    ran = out.stderr.find("stand-in make ran")
    assert 0 <= said < ran, out.stderr[-3000:]
    assert (tmp_path / "out" / "mok" / "libmok.so").exists()
