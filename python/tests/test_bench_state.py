"""test_bench_state.py — bench/baselines.py's ready(), the GPU's state before each of the benchmark's
measurements: preheating runs the measured work back to back for the given seconds after the
warm-up calls, waiting for each call; without preheating it idles --settle seconds and makes only
the warm-up calls. A measurement's clock window (bench.py --clocks) starts halfway through its
preheat, or at its timed reps without one. And bench.py, liger_peer.py and torch_baseline.py take
--preheat / --settle.
No GPU needed (a stand-in call and sync)."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

B = pytest.importorskip("baselines", reason="bench/baselines.py needs torch")


class Calls:
    def __init__(self, seconds):
        self.seconds, self.calls, self.syncs, self.log = seconds, 0, 0, []

    def fn(self):
        time.sleep(self.seconds)
        self.calls += 1
        self.log.append("call")

    def sync(self):
        self.syncs += 1
        self.log.append("sync")


def state(monkeypatch, preheat, settle):
    monkeypatch.setattr(B, "PREHEAT_S", preheat)
    monkeypatch.setattr(B, "SETTLE_S", settle)


def test_preheat_runs_the_work_back_to_back_for_its_seconds(monkeypatch):
    state(monkeypatch, 0.2, 5.0)  # preheating never idles, whatever --settle says
    c = Calls(0.01)
    t0 = time.perf_counter()
    B.ready(c.fn, c.sync, 2)
    took = time.perf_counter() - t0
    assert 0.2 <= took < 1.0, took
    assert c.calls >= 15, c.calls  # ~20 calls of 10 ms in 0.2 s
    # a wait before the first call and after every call: the host is never ahead by more than one
    assert c.log == ["sync"] + ["call", "sync"] * c.calls


def test_the_preheat_starts_after_the_warmup_calls(monkeypatch):
    # a first call slower than the whole preheat (one-time host work, the GPU idle) must not use
    # up the preheat: its seconds of back-to-back work come after the warm-up calls
    state(monkeypatch, 0.2, 0.0)
    c = Calls(0.01)
    first = [True]

    def fn():
        if first[0]:
            first[0] = False
            time.sleep(0.3)
        c.fn()

    t0 = time.perf_counter()
    B.ready(fn, c.sync, 1)
    assert time.perf_counter() - t0 >= 0.5
    assert c.calls >= 16, c.calls  # the slow warm-up call, then ~20 calls of 10 ms


def test_without_preheat_it_settles_then_warms_up(monkeypatch):
    state(monkeypatch, 0.0, 0.15)
    c = Calls(0.0)
    t0 = time.perf_counter()
    B.ready(c.fn, c.sync, 2)
    assert time.perf_counter() - t0 >= 0.15
    assert c.calls == 2


def test_the_clock_window_starts_halfway_through_the_preheat(monkeypatch):
    state(monkeypatch, 0.4, 0.0)
    c = Calls(0.01)
    t0 = time.time()
    B.ready(c.fn, c.sync, 1)
    t1 = time.time()
    B.window_start()  # the timed reps begin: the preheat's second half stays in the window
    time.sleep(0.05)
    start, end = B.window_end()
    assert abs(start - (t0 + t1) / 2) < 0.05, (start, t0, t1)
    assert end >= t1 + 0.05 and B.LAST_WINDOW[0] == (start, end)


def test_without_preheat_the_clock_window_is_the_timed_reps(monkeypatch):
    state(monkeypatch, 0.0, 0.1)
    c = Calls(0.0)
    B.ready(c.fn, c.sync, 1)
    t0 = time.time()
    B.window_start()
    start, end = B.window_end()
    assert start >= t0 and end >= start


@pytest.mark.parametrize("script", ["bench.py", "liger_peer.py", "torch_baseline.py"])
def test_every_timing_script_takes_the_state_flags(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert out.returncode == 0, out.stderr[-500:]
    assert "--preheat" in out.stdout and "--settle" in out.stdout
