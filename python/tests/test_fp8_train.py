"""test_fp8_train.py — examples/train_moe.py --precision fp8 on the cpu backend, small and short: it
trains mok's layer in FP8 beside the bf16 run (a curve of its own, not the bf16 one's bits; its
weights quantized once per optimizer step), reports the FP8 curve's mean relative gap to mok's bf16
curve over the last quarter, and leaves the bf16 curves bitwise what a run without it gives; its
refusals (dimensions not multiples of 128, a backend without FP8 workspaces, as the cuda backend is
until its FP8 tiles exist). The 0.5% bar is the full run's; a run of a dozen steps in the loss's
sharp drop is judged by a looser one here, which only a broken FP8 layer would miss. Skipped
without torch.
"""
import csv
import importlib.util
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import mok  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "train_moe.py")
SMALL = ["--steps", "12", "--blocks", "1", "--batch", "2", "--seq", "16", "--experts", "4", "--topk", "2",
         "--hidden", "128", "--intermediate", "128", "--shared", "128", "--no-noise-ref", "--check-every", "6",
         "--log-every", "4", "--cpu-threads", "2"]
SHORT_RUN_BAR = "0.05"  # a few steps into the sharp drop: FP8's gap is ~0.1-1% there; a broken layer's is not


def _train(out, *extra):
    r = subprocess.run([sys.executable, EXAMPLE, *SMALL, "--out", str(out), *extra], capture_output=True, text=True,
                       timeout=900, env=dict(os.environ))
    rows = []
    if (out / "losses.csv").exists():
        with open(out / "losses.csv") as f:
            rows = list(csv.DictReader(f))
    return r, rows


def test_fp8_run_beside_bf16(tmp_path):
    fp8, fp8_rows = _train(tmp_path / "fp8", "--precision", "fp8", "--fp8-bar", SHORT_RUN_BAR)
    assert fp8.returncode == 0, fp8.stdout[-3000:] + fp8.stderr[-2000:]
    bf16, bf16_rows = _train(tmp_path / "bf16")
    assert bf16.returncode == 0, bf16.stdout[-3000:] + bf16.stderr[-2000:]
    assert len(fp8_rows) == len(bf16_rows) == 12
    # the bf16 models do not see the FP8 one: the same curves, digit for digit
    for key in ("loss_mok", "loss_torch", "gnorm_mok", "gnorm_torch"):
        assert [r[key] for r in fp8_rows] == [r[key] for r in bf16_rows], key
    assert "loss_mok_fp8" not in bf16_rows[0] and "FP8" not in bf16.stdout
    # the FP8 curve is its own (another function from the first step on), and close to bf16's
    assert fp8_rows[0]["loss_mok_fp8"] != fp8_rows[0]["loss_mok"]
    gaps = [abs(float(r["loss_mok_fp8"]) - float(r["loss_mok"])) / float(r["loss_mok"]) for r in fp8_rows]
    assert max(gaps) < float(SHORT_RUN_BAR)
    out = fp8.stdout
    assert "FP8: weights quantized [12] times per layer over 12 steps (once per optimizer step)" in out
    # the same-weights checks (steps 0, 6 and the last): the FP8 layer on mok's bf16 weights, its own error
    checks = re.findall(r"same weights \(mok's\), FP8 against bf16: loss ([0-9.e+-]+)", out)
    assert len(checks) == 3 and all(0 < float(c) < 2e-2 for c in checks), checks
    assert "FP8 on mok's bf16 weights, 3 checks: loss relative difference mean" in out
    q = len(gaps) // 4
    reported = re.search(r"\|loss_fp8 - loss_mok\| / loss_mok: .* last quarter ([0-9.]+)% \(for scale", out)
    assert reported, out[-2000:]
    assert float(reported.group(1)) == pytest.approx(100 * sum(gaps[-q:]) / q, abs=2e-3)  # the curves' gap
    assert f"FP8 within {float(SHORT_RUN_BAR):.1%} of bf16 (mean relative gap over the last quarter): yes" in out


def test_fp8_needs_multiples_of_128(tmp_path):
    r, _ = _train(tmp_path, "--precision", "fp8", "--intermediate", "64")
    assert r.returncode != 0 and "--intermediate 64: --precision fp8 needs a multiple of 128" in r.stderr


def test_a_backend_without_fp8_is_named(monkeypatch):
    """--device cuda --precision fp8 where the backend refuses FP8 workspaces (as the cuda backend did
    before its FP8 forward): the run stops before any model is made, saying so in the library's
    words. The machine here has no GPU, so the GPU, the CUDA build and the refusal are stood in for."""
    spec = importlib.util.spec_from_file_location("train_moe_fp8", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    class Group:
        def close(self):
            pass

    def refuse(*args, precision="bf16", **kw):
        raise mok.UnsupportedError(mok.Status.ERR_UNSUPPORTED, "shape.precision: the cuda backend has no FP8 GEMM "
                                   "tiles yet; FP8 workspaces run on the cpu backend", "mok_workspace_create")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mok, "backend_available", lambda backend: True)
    monkeypatch.setattr(mok.Group, "create_local", classmethod(lambda cls, *a, **kw: Group()))
    monkeypatch.setattr(mok, "Workspace", refuse)
    monkeypatch.setattr(sys, "argv", ["train_moe.py", "--device", "cuda", "--precision", "fp8"])
    with pytest.raises(SystemExit) as stop:
        ex.main()
    assert str(stop.value) == ("--device cuda --precision fp8: mok's cuda backend does not run FP8 layers: the cuda "
                               "backend has no FP8 GEMM tiles yet; FP8 workspaces run on the cpu backend; --device cpu "
                               "trains the FP8 layer")
