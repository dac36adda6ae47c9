"""test_timeline.py — bench/timeline.py's report of a trace, on a synthetic trace with known
numbers (no library, no GPU): the idle compute and comm time before, between and after tasks,
the gaps by the kind that ends them, the idle share per tenth of the pass, and per kind the
tasks' busy time, main loops and epilogues; and the command line's --report on a written file."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))


def event(name, cat, tid, ts, dur, gemm=0.0, epi=0.0, pass_name="forward"):
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": {"rank": 0, "pass": pass_name, "minibatch": 0, "gemm_us": gemm, "epilogue_us": epi}}


# Two compute CTAs over 0 .. 100 us: CTA 1 runs gateup 0-40 and down 50-100 (a 10 us gap before the
# down); CTA 2 runs gateup 20-60 (20 us before it) and down 60-80 (20 us after it). One comm CTA.
EVENTS = [event("dispatch", "comm", 0, 0.0, 20.0),
          event("gateup", "compute", 1, 0.0, 40.0, gemm=30.0, epi=8.0),
          event("down", "compute", 1, 50.0, 50.0, gemm=40.0, epi=6.0),
          event("gateup", "compute", 2, 20.0, 40.0, gemm=32.0, epi=6.0),
          event("down", "compute", 2, 60.0, 20.0, gemm=12.0, epi=4.0)]


def test_report_numbers():
    import timeline

    lines = timeline.report(EVENTS, [], "t", flops={"gateup": 1e9})
    assert lines[0] == "t rank 0: span 0.100 ms"
    # 20 before + 10 between + 20 after = 50 us of 200 CTA-us
    assert "compute idle:      0.05 SM-ms of 0.20 (25.0%): before the first task 0.02, between tasks 0.01" in lines[1]
    assert "after the last 0.02" in lines[1]
    assert lines[2].endswith("(SM-ms): down 0.01")
    # tenths of 10 us: CTA 2 idles in tenths 0-1 and 8-9, CTA 1 in tenth 4
    assert lines[3].endswith("idle % per tenth of the pass: 50 50 0 0 50 0 0 0 50 50")
    # the comm CTA: dispatch 0-20, then idle to the end
    assert "comm idle:      0.08 SM-ms of 0.10 (80.0%): before the first task 0.00, between tasks 0.00" in lines[4]
    assert lines[5].endswith("(SM-ms): none")
    assert lines[6].endswith("idle % per tenth of the pass: 0 0 100 100 100 100 100 100 100 100")
    kinds = {l.split()[3]: l for l in lines[7:]}
    assert set(kinds) == {"gateup", "down", "dispatch"}
    assert "2 tasks  busy      0.08 SM-ms  avg     40.0 us" in kinds["gateup"]
    assert "main loops   31.0, epilogue    7.0, before    2.0 us/task" in kinds["gateup"]
    assert "main loops   26.0, epilogue    5.0, before    4.0 us/task" in kinds["down"]
    assert "12.50 TFLOP/s per busy SM" in kinds["gateup"]  # 1e9 FLOPs over 80 busy us
    assert "main loops" not in kinds["dispatch"]  # no GEMM: no loop figures


def test_report_sm_clock():
    """The residency events' SM cycles give each rank's clock: cycles over microseconds, the
    median and the range over its CTAs; a trace without cycles (cpu, older files) says nothing."""
    import timeline

    def resident(tid, ts, dur, cycles=None):
        e = event("resident", "resident", tid, ts, dur)
        if cycles is not None:
            e["args"]["sm_cycles"] = cycles
        return e

    residents = [resident(0, -5.0, 110.0, 110.0 * 1980), resident(1, -5.0, 110.0, 110.0 * 1500),
                 resident(2, -5.0, 110.0, 110.0 * 1755)]
    line = timeline.report(EVENTS, residents, "t")[0]
    assert line.startswith("t rank 0: span 0.100 ms; kernel 0.110 ms on the GPU")
    assert line.endswith("; SM clock 1755 MHz (CTAs 1500-1980)")
    assert "SM clock" not in timeline.report(EVENTS, [resident(0, -5.0, 110.0)], "t")[0]
    assert timeline.sm_clock([]) is None


def test_report_command(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": EVENTS + [event("dh", "compute", 1, 200.0, 30.0, 20.0, 9.0,
                                                               pass_name="backward")]}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "timeline.py"), str(path), "--report"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "forward rank 0: span 0.100 ms"
    assert any(l.startswith("backward rank 0: span 0.030 ms") for l in out)
    assert any("dh" in l and "main loops   20.0, epilogue    9.0" in l for l in out)
