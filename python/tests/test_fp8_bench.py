"""test_fp8_bench.py — bench.py --precision fp8 on the cpu backend (MOK_BENCH_SMOKE=1: tiny layers,
no GPU): an FP8 row beside each case's bf16 row, with its times, its quantization timed apart, the
ratios to the bf16 row and its error against PyTorch; and where the backend refuses FP8 workspaces
(as the cuda backend did before its FP8 forward, stood in for here by a Workspace that refuses as
the library did), a row that says "skipped:" and the library's reason. Skipped without torch.
"""
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_fp8_rows(tmp_path, ranks):
    pytest.importorskip("torch")
    env = dict(os.environ, MOK_BENCH_SMOKE="1")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--ranks", str(ranks), "--out", str(out),
           "--reps", "2", "--no-sweep", "--precision", "fp8"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((out / f"bench_ep{ranks}.json").read_text())["cases"]
    assert [row["precision"] for row in rows] == ["bf16", "fp8", "bf16", "fp8"]
    for bf16, fp8 in zip(rows[::2], rows[1::2]):
        assert (bf16["layer"], bf16["tokens"], bf16["skew"]) == (fp8["layer"], fp8["tokens"], fp8["skew"])
        assert "skipped" not in fp8
        assert fp8["forward_ms"] > 0 and fp8["backward_ms"] > 0 and fp8["quantize_ms"] > 0
        assert fp8["fp8_weight_bytes"] > 0 and "fp8_weight_bytes" not in bf16
        assert fp8["fp8_vs_bf16_forward"] == pytest.approx(bf16["forward_ms"] / fp8["forward_ms"])
        assert fp8["fp8_vs_bf16_forward_backward"] > 0
        if ranks == 1:  # checked against PyTorch's bf16 layer: FP8's error, well above bf16's
            assert bf16["max_rel_err_vs_torch"] < 2e-2 < fp8["max_rel_err_vs_torch"] < 0.2
            assert fp8["baseline_forward_ms"] == bf16["baseline_forward_ms"]  # the same run's baseline
    lines = [re.match(r"^\S+ +\d+ +\d+ +[\d.]+ +(bf16|fp8) \| +[\d.]+ ", line) for line in r.stdout.splitlines()]
    assert [m.group(1) for m in lines if m] == ["bf16", "fp8", "bf16", "fp8"]  # the table, a row each
    assert "FP8 beside bf16" in r.stdout and "quantize" in r.stdout


def test_bench_fp8_rows_per_variant(tmp_path):
    """--compare-config: every variant gets its FP8 row beside its own bf16 row, with its settings."""
    pytest.importorskip("torch")
    env = dict(os.environ, MOK_BENCH_SMOKE="1")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--ranks", "1", "--out", str(out), "--reps", "2",
           "--no-sweep", "--only", "deepseek-v3", "--precision", "fp8", "--compare-config", "minibatch_rows=128"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((out / "bench_ep1.json").read_text())["cases"]
    assert [(row["precision"], row["env"]) for row in rows] == [
        ("bf16", ""), ("fp8", "fp8"), ("bf16", "minibatch_rows=128"), ("fp8", "fp8 minibatch_rows=128")]
    assert rows[1]["minibatch"] != 128 and rows[3]["minibatch"] == 128  # the variant's settings
    assert rows[3]["fp8_vs_bf16_forward"] == pytest.approx(rows[2]["forward_ms"] / rows[3]["forward_ms"])
    assert "(minibatch_rows=128)" in r.stdout  # its line of the FP8 summary says which variant


def test_bench_fp8_skipped_where_the_backend_refuses(monkeypatch, tmp_path, capsys):
    pytest.importorskip("torch")
    monkeypatch.setenv("MOK_BENCH_SMOKE", "1")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    bench = importlib.import_module("bench")
    bench = importlib.reload(bench)  # SMOKE is read at import
    import mok

    real = bench.F.Workspace

    def workspace(*args, precision="bf16", **kw):
        if precision == "fp8":  # a backend's refusal of FP8 workspaces, as the binding raises it
            raise mok.UnsupportedError(
                mok.Status.ERR_UNSUPPORTED, "shape.precision: the cuda backend has no FP8 GEMM tiles yet; FP8 "
                "workspaces run on the cpu backend", "mok_workspace_create", "not supported by this build or backend")
        return real(*args, precision=precision, **kw)

    monkeypatch.setattr(bench.F, "Workspace", workspace)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--ranks", "1", "--out", str(tmp_path), "--reps", "2", "--no-sweep",
                                      "--only", "deepseek-v3", "--precision", "fp8"])
    bench.main()
    printed = capsys.readouterr().out
    reason = "skipped: the cuda backend has no FP8 GEMM tiles yet; FP8 workspaces run on the cpu backend"
    assert f"deepseek-v3 E 8 T 200 EP1 fp8: {reason}" in printed
    assert f"fp8 | {reason}" in printed  # its row of the table
    rows = json.loads((tmp_path / "bench_ep1.json").read_text())["cases"]
    assert [row["precision"] for row in rows] == ["bf16", "fp8"]
    assert rows[0]["forward_ms"] > 0 and rows[1]["skipped"] == reason[len("skipped: "):]
    assert "forward_ms" not in rows[1]
