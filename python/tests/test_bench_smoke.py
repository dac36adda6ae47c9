"""test_bench_smoke.py — the benchmark harness end to end on the cpu backend (MOK_BENCH_SMOKE=1:
tiny layers, no GPU): bench.py for 1 and 2 ranks with a small sweep, the traces and the host timing, checking that
it writes its JSON, its table and a trace per pass, that the case table of bench/layers.py
divides every layer's experts evenly for 1, 2, 4 and 8 ranks, and how bench/peers.py launches
LigerCute on one GPU and across GPUs. Skipped without torch.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_case_table():
    import layers

    for ranks in (1, 2, 4, 8):
        for name, experts, tokens, skew in layers.cases(ranks):
            assert name in layers.LAYERS
            assert experts % ranks == 0 and experts > 0, (ranks, name, experts)
            assert tokens > 0 and skew >= 0


@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_smoke(tmp_path, ranks):
    pytest.importorskip("torch")
    env = dict(os.environ, MOK_BENCH_SMOKE="1")
    out, traces = tmp_path / "out", tmp_path / "traces"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--ranks", str(ranks), "--out", str(out),
           "--reps", "2", "--sweep-comm", "8", "--sweep-mb", "128", "--trace", "--trace-dir", str(traces), "--host"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "mok fwd ms" in r.stdout
    # the trace summary: idle time split by what ended each gap, and by tenth of the pass
    assert "compute gaps by the task that ends them" in r.stdout
    tenths = [l for l in r.stdout.splitlines() if "idle % per tenth of the pass:" in l]
    assert tenths and all(len(l.split(":")[1].split()) == 10 for l in tenths)
    assert all(0 <= int(v) <= 100 for l in tenths for v in l.split(":")[1].split())
    data = json.loads((out / f"bench_ep{ranks}.json").read_text())
    assert len(data["cases"]) == 2 and len(data["sweeps"]) == 2
    for row in data["cases"]:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["forward_in_step_ms"] > 0
    assert all("forward_in_step_ms" not in row for row in data["sweeps"])  # the sweeps time from idle only
    # --host: a line per case with mok's host time per call (and PyTorch's on one rank)
    assert len(data["host"]) == 2
    for h in data["host"]:
        assert h["forward_host_ms"] > 0 and h["backward_host_ms"] > 0
        assert (ranks == 1) == ("baseline_forward_host_ms" in h)
    names = sorted(p.name for p in traces.iterdir())
    assert sum(n.endswith("_fwd.json") for n in names) == 2 and sum(n.endswith("_bwd.json") for n in names) == 2


@pytest.mark.parametrize("ranks", [1, 2])
def test_liger_peer_launch(tmp_path, monkeypatch, ranks):
    """bench/peers.py's LigerCute launch: one process on one GPU, torch.distributed.run with a
    process per GPU across GPUs, the peer's --ranks; its JSON line back, or a skip with the reason
    (no site, no package in it, a failed run). The launched command is captured, not run."""
    import peers

    assert "not set up" in peers.run_liger("", "qwen3-30b-a3b", 128, 8192, 0.0, 3, ranks)["skipped"]
    assert "no liger_cute_kernels" in peers.run_liger(str(tmp_path), "qwen3-30b-a3b", 128, 8192, 0.0, 3,
                                                      ranks)["skipped"]
    (tmp_path / "liger_cute_kernels").mkdir()
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='banner\n{"forward_ms": 1.5}\n', stderr="")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    row = peers.run_liger(str(tmp_path), "deepseek-v3", 256, 8192, 1.5, 3, ranks)
    assert row == {"forward_ms": 1.5}
    cmd = seen[0]
    assert cmd[0].endswith("liger-env.sh") and cmd[1] == str(tmp_path)
    assert ("torch.distributed.run" in cmd) == (ranks > 1)
    if ranks > 1:
        assert cmd[cmd.index("--nproc_per_node") + 1] == str(ranks)
    assert cmd[cmd.index("--ranks") + 1] == str(ranks) and cmd[cmd.index("--skew") + 1] == "1.5"

    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="trace\nRuntimeError: no NVSHMEM\n")

    monkeypatch.setattr(peers.subprocess, "run", failing)
    assert "no NVSHMEM" in peers.run_liger(str(tmp_path), "deepseek-v3", 256, 8192, 0.0, 3, ranks)["skipped"]

    def failing_then_warning(cmd, **kwargs):  # torch.distributed warns after the error on its way out
        err = ("Traceback (most recent call last):\n  File \"liger_peer.py\", line 9\n"
               "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
               "[rank0]:[W1207 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called\n")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(peers.subprocess, "run", failing_then_warning)
    reason = peers.run_liger(str(tmp_path), "deepseek-v3", 256, 8192, 0.0, 3, ranks)["skipped"]
    assert "out of memory" in reason and "destroy_process_group" not in reason
    assert peers.failure_line("") == "no output"
    assert peers.failure_line("a\nUserWarning: b\n") == "a"


@pytest.mark.parametrize("first", [False, True])
def test_variant_order(tmp_path, first):
    """--compare-env rows run after the defaults' row, or with --variants-first before it; either
    way every row of a case carries the baseline times its first row took."""
    pytest.importorskip("torch")
    env = dict(os.environ, MOK_BENCH_SMOKE="1")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--ranks", "1", "--out", str(out), "--reps", "2",
           "--no-sweep", "--only", "deepseek-v3", "--compare-env", "MOK_BENCH_PROBE_VAR=1"]
    if first:
        cmd.append("--variants-first")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cases = json.load(open(out / "bench_ep1.json"))["cases"]
    labels = [c["env"] for c in cases]
    assert labels == (["MOK_BENCH_PROBE_VAR=1", ""] if first else ["", "MOK_BENCH_PROBE_VAR=1"]), labels
    assert cases[0]["baseline_forward_ms"] == cases[1]["baseline_forward_ms"]


def test_peer_ratios(monkeypatch, capsys):
    """peer_rows's ratios against LigerCute compare times taken the same way (the training-step
    forwards, both queued behind the previous backward; mok's forward alone with LigerCute's
    no_grad one, also alone), and print_peers prints them: a peer's result stood in for (no GPU)."""
    pytest.importorskip("torch")
    import bench

    lc = dict(forward_ms=2.0, forward_nograd_ms=2.5, forward_backward_ms=8.0, memory_bytes=3 * 2**30,
              max_rel_err_vs_torch=1e-3)
    monkeypatch.setattr(bench.PEERS, "run_liger", lambda *args: dict(lc))
    row = dict(layer="qwen3-30b-a3b", experts=128, tokens=8192, forward_ms=2.2, forward_in_step_ms=1.8,
               backward_ms=4.2, memory_bytes=2**30)
    assert bench.LAYERS["qwen3-30b-a3b"]["shared"] == 0  # the case's own row is mok's routed-only row
    bench.peer_rows(None, 1, "qwen3-30b-a3b", 128, 8192, 0.0, None, 3, row, "site")
    p = row["ligercute"]
    assert p["mok_forward_vs_peer"] == pytest.approx(1.8 / 2.0)
    assert p["mok_forward_alone_vs_peer_nograd"] == pytest.approx(2.2 / 2.5)
    assert p["mok_forward_backward_vs_peer"] == pytest.approx((2.2 + 4.2) / 8.0)
    bench.print_peers([row])
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("qwen3-30b-a3b")][0]
    cells = [c.split() for c in line.split("|")]
    assert cells[1] == ["1.800", "2.000", "0.90"] and cells[2] == ["2.200", "2.500", "0.88"]
    assert cells[3] == ["6.400", "8.000", "0.80"] and cells[4] == ["1.00", "3.00"]
