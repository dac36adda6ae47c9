"""test_readme_examples.py — every ```python block of python/README.md runs as written, each in a
fresh interpreter (the binding's environment: MOK_LIBRARY, PYTHONPATH), so the README cannot rot.
A block that uses torch is skipped, with the reason, where torch is not importable. Sketches that
need what a test cannot have (a model's weights, a Megatron setup) are fenced ```py instead.
"""
import os
import re
import subprocess
import sys

import pytest

import mok

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def python_blocks():
    with open(README) as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


BLOCKS = python_blocks()


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 2, f"python/README.md has {len(BLOCKS)} python blocks"
    assert any("torch" not in block for block in BLOCKS), "no example without torch"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    block = BLOCKS[index]
    if re.search(r"^\s*(import|from) torch\b|mok\.torch", block, re.M):
        pytest.importorskip("torch")
    # the binding this test imports, and its library, for the fresh interpreter too
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok.__file__)))
    env = dict(os.environ, MOK_LIBRARY=mok.library_path,
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"python/README.md block {index + 1} failed:\n{block}\n{out.stdout}\n{out.stderr}"
