#!/usr/bin/env python3
"""sass_loops.py OBJ KERNEL FILE FIRST LAST — the machine-code loops of a kernel that hold code of
source lines FIRST..LAST of FILE: for each backward branch of the kernel whose body (branch target
to branch) has instructions from those lines, the body's instruction count, how many come from
those lines, and its MUFU, shared-memory and global-store instructions, innermost loops first.

A static count: a body's branches that are rarely taken (a row past the tile, a zero-pad path) are
counted whole. KERNEL is a substring of the kernel's mangled name (backward_kernelILb0E is the bf16
backward, ILb1E the FP8 one); FILE a source file's base name (swiglu.cuh). The object must be built
with line info (the Makefile's -lineinfo). Needs cuobjdump and nvdisasm (CUDA toolkit; where it
lacks them, the PyPI packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm hold both).

    python3 scripts/sass_loops.py build/obj/src/cuda/megakernel/backward.o backward_kernelILb0E swiglu.cuh 240 290
"""
import os
import re
import signal
import subprocess
import sys
import tempfile


def disassemble(obj):
    """nvdisasm -g -c of every cubin inside obj, as one text."""
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(["cuobjdump", "-xelf", "all", os.path.abspath(obj)], cwd=work, check=True,
                       stdout=subprocess.DEVNULL)
        texts = []
        for name in sorted(os.listdir(work)):
            if name.endswith(".cubin"):
                texts.append(subprocess.run(["nvdisasm", "-g", "-c", os.path.join(work, name)], check=True,
                                            capture_output=True, text=True).stdout)
        return "\n".join(texts)


def instructions(text, kernel):
    """(source (file, line) or None, instruction text) of the kernel's code, and its labels' positions."""
    out, labels, cur, inside = [], {}, None, False
    for line in text.split("\n"):
        m = re.search(r"\.text\.(\S+):", line)
        if m:
            inside = kernel in m.group(1)
            cur = None
            continue
        if not inside:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(out)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            out.append((cur, m.group(1).strip()))
    return out, labels


def main():
    if len(sys.argv) != 6:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    obj, kernel, source, first, last = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    code, labels = instructions(disassemble(obj), kernel)
    if not code:
        print(f"sass_loops: no kernel matching '{kernel}' in {obj}", file=sys.stderr)
        return 1
    loops = []
    for end, (_, text) in enumerate(code):
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", text)
        if not m or labels.get(m.group(1), end + 1) > end:
            continue
        start = labels[m.group(1)]
        body = code[start:end + 1]
        mine = sum(1 for where, _ in body if where and where[0] == source and first <= where[1] <= last)
        if mine:
            count = lambda op: sum(1 for _, t in body if re.match(r"(@!?U?P\w+\s+)?" + op, t))
            where = body[0][0]
            loops.append((len(body), mine, count("MUFU"), count("LDS"), count("STS"), count("STG"),
                          f"{where[0]}:{where[1]}" if where else "?"))
    print(f"{kernel}: {len(code)} instructions; loops holding {source}:{first}-{last}")
    print(f"{'instructions':>12} {'from lines':>10} {'MUFU':>5} {'LDS':>4} {'STS':>4} {'STG':>4}  first line")
    for n, mine, mufu, lds, sts, stg, start in sorted(loops):
        print(f"{n:>12} {mine:>10} {mufu:>5} {lds:>4} {sts:>4} {stg:>4}  {start}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
