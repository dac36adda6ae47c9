"""test_ncu_lines.py — scripts/ncu_lines.py on a hand-made SASS listing and Nsight Compute CSV: the
per-line table takes each instruction's innermost frame, and --only keeps the instructions with a
frame in the named file, counted at that frame, so that a helper inlined into it (a conversion in
portable.h) counts at the line that called it; a -g listing (innermost frames alone) loses them.
"""
import csv
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "ncu_lines.py")

# nvdisasm -gi -c: a block of `//## File` lines per instruction group, innermost first
LISTING_GI = """
        .text._Z6kernelv:
_Z6kernelv:
\t//## File "/r/src/core/portable.h", line 34 inlined at "/r/src/cuda/megakernel/swiglu.cuh", line 236
\t//## File "/r/src/cuda/megakernel/swiglu.cuh", line 236 inlined at "/r/src/cuda/megakernel/backward.cu", line 90
\t//## File "/r/src/cuda/megakernel/backward.cu", line 90
        /*0000*/                   IMAD.U32 R4, R2, 0x10000, RZ ;
\t//## File "/r/src/cuda/megakernel/swiglu.cuh", line 244 inlined at "/r/src/cuda/megakernel/backward.cu", line 90
\t//## File "/r/src/cuda/megakernel/backward.cu", line 90
        /*0010*/                   FMUL R5, R4, R4 ;
\t//## File "/r/src/core/portable.h", line 34 inlined at "/r/src/cuda/megakernel/comm_walk.cuh", line 85
\t//## File "/r/src/cuda/megakernel/comm_walk.cuh", line 85
        /*0020*/                   IMAD.U32 R6, R3, 0x10000, RZ ;
\t//## File "/r/src/cuda/megakernel/backward.cu", line 95
        /*0030*/              @!P0 STL [R1], R6 ;
"""


def listing_g(gi):
    """The same listing as `nvdisasm -g` writes it: the innermost frame alone."""
    out, in_block = [], False
    for line in gi.splitlines():
        if "//## File" in line:
            if not in_block:
                out.append(line.split(" inlined at ")[0])
            in_block = True
        else:
            in_block = False
            out.append(line)
    return "\n".join(out) + "\n"


def write_csv(path):
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait"]
    rows = [["0x7f0000000000", "IMAD.U32 R4, R2, 0x10000, RZ", "30", "8", "25", "5"],
            ["0x7f0000000010", "FMUL R5, R4, R4", "10", "8", "0", "10"],
            ["0x7f0000000020", "IMAD.U32 R6, R3, 0x10000, RZ", "50", "8", "50", "0"],
            ["0x7f0000000030", "@!P0 STL [R1], R6", "10", "4", "0", "10"]]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([head] + rows)


def run(tmp_path, listing, *extra):
    lst = tmp_path / "listing.sass"
    lst.write_text(listing)
    write_csv(tmp_path / "sass.csv")
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "sass.csv"), "10", "--lines", str(lst),
                           "--kernel", "kernel", *extra], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def table(out, title):
    """{line: percent} of the table after the heading that starts with `title`."""
    got, on = {}, False
    for line in out.splitlines():
        if line.startswith(title):
            on = True
            continue
        if on:
            words = line.split()
            if not words:
                if got:
                    break
                continue
            got[words[1]] = float(words[0].rstrip("%"))
    return got


def test_innermost_frame_by_default(tmp_path):
    out = run(tmp_path, LISTING_GI)
    assert "0 of 4 opcodes differ" in out
    lines = table(out, "by source line")
    assert lines == {"portable.h:34": 80.0, "swiglu.cuh:244": 10.0, "backward.cu:95": 10.0}
    assert "backward.cu:95" in out.split("local memory (spills)")[1]


def test_only_counts_inlined_helpers_at_their_caller(tmp_path):
    out = run(tmp_path, LISTING_GI, "--only", "swiglu.cuh")
    assert "lines with 'swiglu.cuh': 40 samples, 40.00% of all" in out
    lines = table(out, "by source line")
    assert lines == {"swiglu.cuh:236": 30.0, "swiglu.cuh:244": 10.0}
    assert "long_sb 25" in out.split("swiglu.cuh:236")[1].splitlines()[0]


def test_only_from_a_g_listing_sees_innermost_frames_alone(tmp_path):
    out = run(tmp_path, listing_g(LISTING_GI), "--only", "swiglu.cuh")
    assert "lines with 'swiglu.cuh': 10 samples, 10.00% of all" in out
    assert table(out, "by source line") == {"swiglu.cuh:244": 10.0}
