"""test_clocks.py — bench/clocks.py, the GPUs' clock and power beside the benchmark's times: its
parsing of nvidia-smi's lines, a window's median clock, power and power-capped share, the sampler
against a stand-in nvidia-smi (a script printing lines as the real one does) and without one, and
bench.py --clocks end to end on the cpu backend with the stand-in on PATH. No GPU needed."""
import json
import os
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

# Two GPUs every 20 ms, as `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits -lms N`
# prints them: GPU 0 at 1500 MHz and 450 W held by the power cap, GPU 1 at 1980 MHz and 100 W.
FAKE = """import datetime, sys, time
print("timestamp, index, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active", flush=True)
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{now}, 0, 1500, 450.00, 0x0000000000000004", flush=True)
    print(f"{now}, 1, 1980, 100.00, 0x0000000000000000", flush=True)
    time.sleep(0.02)
"""


def fake_smi(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n" + FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_parse():
    import clocks

    t, gpu, mhz, watts, reasons = clocks.parse("2026/12/06 05:30:01.250, 1, 1515, 455.12, 0x0000000000000004")
    assert (gpu, mhz, watts, reasons) == (1, 1515.0, 455.12, 4)
    assert t == pytest.approx(clocks.parse("2026/12/06 05:30:00.250, 0, 1, 1, 0x0")[0] + 1.0)
    assert clocks.parse("timestamp, index, clocks.current.sm [MHz], power.draw [W], reasons") is None
    assert clocks.parse("2026/12/06 05:30:01.250, 0, 1515, [N/A], 0x0") is None
    assert clocks.parse("") is None


def test_summarize():
    import clocks

    samples = [(1.0, 0, 1500.0, 400.0, 4), (2.0, 0, 1600.0, 420.0, 0), (3.0, 0, 1700.0, 440.0, 4),
               (2.5, 1, 1980.0, 90.0, 0), (9.0, 0, 1980.0, 60.0, 0)]
    s = clocks.summarize(samples, [(1.0, 3.0)], {0})
    assert s == {"mhz": 1600.0, "watts": 420.0, "capped": 2 / 3, "samples": 3}
    assert clocks.summarize(samples, [(1.0, 3.0)])["samples"] == 4  # every GPU
    assert clocks.summarize(samples, [(4.0, 8.0)]) is None  # no sample in the window
    pooled = clocks.summarize(samples, [(0.5, 1.5), (8.5, 9.5)], {0})  # two windows' samples together
    assert pooled["samples"] == 2 and pooled["mhz"] == (1500.0 + 1980.0) / 2


def test_sampler(tmp_path):
    import clocks

    sampler = clocks.Sampler(command=str(fake_smi(tmp_path))).start()
    deadline = time.time() + 30
    while not sampler.samples and time.time() < deadline:  # the stand-in's start
        time.sleep(0.05)
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    sampler.stop()
    assert sampler.reason is None
    s0, s1 = sampler.window([(t0, t1)], {0}), sampler.window([(t0, t1)], {1})
    assert s0["mhz"] == 1500.0 and s0["watts"] == 450.0 and s0["capped"] == 1.0 and s0["samples"] >= 5
    assert s1["mhz"] == 1980.0 and s1["capped"] == 0.0
    assert sampler.window([(t1 + 60, t1 + 61)]) is None


def test_sampler_without_nvidia_smi(tmp_path):
    import clocks

    sampler = clocks.Sampler(command=str(tmp_path / "no-such-nvidia-smi")).start()
    sampler.stop()
    assert "could not run" in sampler.reason and sampler.window([(0, time.time())]) is None


def test_bench_clocks(tmp_path):
    pytest.importorskip("torch")
    fake_smi(tmp_path)
    env = dict(os.environ, MOK_BENCH_SMOKE="1", PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--ranks", "1", "--out", str(out), "--reps", "3",
           "--no-sweep", "--only", "deepseek-v3", "--clocks"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "clocks during each time" in r.stdout
    (row,) = json.loads((out / "bench_ep1.json").read_text())["cases"]
    assert "clock_windows" not in row
    # rank 0 is nvidia-smi's GPU 0: its clock, not GPU 1's; a window with no sample says so (None)
    times = ("forward_ms", "backward_ms", "forward_in_step_ms", "baseline_forward_ms",
             "baseline_forward_backward_ms")
    assert set(row["clocks"]) == set(times) | {"mok"}
    sampled = [row["clocks"][k] for k in row["clocks"] if row["clocks"][k]]
    assert sampled and all(c["mhz"] == 1500.0 and c["capped"] == 1.0 for c in sampled)
    # mok's passes pooled: at least the samples of each of its windows
    mok_samples = row["clocks"]["mok"]["samples"] if row["clocks"]["mok"] else 0
    assert mok_samples >= max((row["clocks"][k] or {}).get("samples", 0)
                              for k in ("forward_ms", "backward_ms", "forward_in_step_ms"))
