"""Where a kernel's warps stall, by instruction and by source line, from an Nsight Compute
source-page CSV of the SASS view (`ncu -i R --page source --csv --print-source sass`).

    python3 scripts/ncu_lines.py SASS.csv [N] [--lines LISTING --kernel NAME [--only TEXT]]

LISTING is `nvdisasm -gi -c` (or `-g -c`) of the cubin that ran (scripts/ncu-pass.sh makes it from
build/libmok.so): its `//## File "...", line L` comments give each instruction's source line, so
the samples can be summed per line. With -gi each instruction carries its inline chain (the
function it was written in, then each line it was inlined at, out to the kernel); a line is the
innermost frame of its chain. The executed local-memory instructions (LDL, STL: spills)
are summed per line too. The CSV's rows are matched to the listing's instructions of
function NAME by their offset from the function's first instruction; the opcodes of the first
rows are compared, and a mismatch drops the per-line table rather than print a wrong one.

With --only TEXT the tables keep the instructions with a frame whose "file:line" contains TEXT (a
file name, say swiglu.cuh), each counted at the innermost such frame, and give each line's three
largest stall reasons, summed over its instructions: where one part of a kernel waits, apart from
the warps that idle elsewhere. From a -gi listing the helpers that part inlines (a conversion in
portable.h, a store in row_stores.cuh) count at the line of that part which called them.

Column names differ between ncu versions, so the sample column is found by name: the first
whose header has "Sampling" and "All" in it, else the first with "Samples". If none is found the
CSV's first lines are printed instead, to adapt this script.
"""
import csv
import re
import sys
from collections import defaultdict


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def listing_functions(path, kernel):
    """{function: ({offset: chain}, {offset: opcode})} for every function whose name contains
    `kernel` in an `nvdisasm -gi -c` or `-g -c` listing (a template's instantiations are functions
    of their own, each with offsets from 0). A chain is a tuple of "file:line", innermost first:
    -gi writes an instruction's frames as consecutive `//## File` lines, each inlined at the next;
    -g writes the innermost alone."""
    funcs, cur_fn, cur, chain_open = {}, None, ("?",), False
    for line in open(path, errors="replace"):
        s = line.strip()
        if s.endswith(":") and not s.startswith("/*") and not s.startswith("."):
            if s.startswith("_Z") or re.match(r"^[A-Za-z_]\w*:$", s):  # a function; $ labels stay in it
                cur_fn = s[:-1] if kernel in s else None
                if cur_fn:
                    funcs[cur_fn] = ({}, {})
                cur, chain_open = ("?",), False
            continue
        if cur_fn is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', s)
        if m:
            frame = f"{m.group(1).split('/')[-1]}:{m.group(2)}"
            cur = cur + (frame,) if chain_open else (frame,)
            chain_open = True
            continue
        chain_open = False
        m = re.match(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", s)
        if m:
            off = int(m.group(1), 16)
            funcs[cur_fn][0][off] = cur
            funcs[cur_fn][1][off] = m.group(2).split(".")[0]
    return funcs


def main():
    args = [a for a in sys.argv[1:]]
    lines_path = kernel = None
    if "--lines" in args:
        i = args.index("--lines")
        lines_path = args[i + 1]
        del args[i:i + 2]
    if "--kernel" in args:
        i = args.index("--kernel")
        kernel = args[i + 1]
        del args[i:i + 2]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1]
        del args[i:i + 2]
    path = args[0]
    top = int(args[1]) if len(args) > 1 else 40
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    head_i = next((i for i, r in enumerate(rows) if len(r) > 3 and any("Source" in c for c in r)), None)
    if head_i is None:
        print("ncu_lines: no header row found; first lines:")
        for r in rows[:8]:
            print("  ", r[:8])
        return 1
    head = rows[head_i]
    col = next((i for i, c in enumerate(head) if "Sampling" in c and "All" in c), None)
    if col is None:
        col = next((i for i, c in enumerate(head) if "Samples" in c), None)
    if col is None:
        print("ncu_lines: no sampling column in", head)
        return 1
    src = next(i for i, c in enumerate(head) if "Source" in c)
    addr = next((i for i, c in enumerate(head) if c.strip("# ").lower() == "address"), None)
    # the reasons: one column each (stall_*), not their "(Not Issued)" halves or the totals
    stall_cols = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    data = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    sampled = [r for r in data if number(r[col])]
    total = sum(number(r[col]) for r in sampled) or 1.0
    print(f"{path}: {len(data)} instructions, {len(sampled)} with samples, {total:.0f} samples ({head[col]})")
    print("columns:", ", ".join(head))

    def why(rs):
        sums = defaultdict(float)
        for r in rs:
            for i in stall_cols:
                sums[head[i]] += number(r[i]) or 0.0
        reasons = sorted(((v, name) for name, v in sums.items()), reverse=True)[:3]
        return ", ".join(f"{name[len('stall_'):]} {v:.0f}" for v, name in reasons if v > 0)

    chain_of = {}  # id(row): the instruction's chain of "file:line", innermost first
    if lines_path and kernel and addr is not None:
        offs = [int(r[addr], 16) for r in data]
        base = min(offs) if offs else 0
        checked = [(o - base, r[src].split()) for o, r in zip(offs[:200], data[:200])]

        def mismatches(ops):
            bad = 0
            for o, words in checked:
                words = [w for w in words if not w.startswith("@")]
                if words and words[0].split(".")[0] != ops.get(o):
                    bad += 1
            return bad

        # the profiled function: of those named like `kernel`, the one whose opcodes match the CSV's
        funcs = listing_functions(lines_path, kernel)
        scored = sorted((mismatches(ops), name) for name, (_, ops) in funcs.items())
        bad, name = scored[0] if scored else (len(checked), None)
        if name is None or bad > len(checked) // 10:
            print(f"ncu_lines: no function named like {kernel} in the listing matches the CSV "
                  f"(best: {bad} of {len(checked)} opcodes differ); no per-line table")
        else:
            print(f"ncu_lines: the CSV is {name} ({bad} of {len(checked)} opcodes differ)")
            where = funcs[name][0]
            chain_of = {id(r): where.get(o - base, ("?",)) for o, r in zip(offs, data)}
    # an instruction's line: its innermost frame, or with --only the innermost frame containing TEXT
    line_of = {k: next((f for f in c if only in f), c[0]) if only is not None else c[0] for k, c in chain_of.items()}
    if only is not None and not line_of:
        print(f"ncu_lines: --only needs the per-line table (--lines and --kernel matching the CSV)")
        return 1
    if only is not None:
        sampled = [r for r in sampled if only in line_of[id(r)]]  # some frame of its chain
        part = sum(number(r[col]) for r in sampled)
        print(f"\nlines with '{only}': {part:.0f} samples, {100 * part / total:.2f}% of all")
    if line_of:
        per = defaultdict(lambda: [0.0, 0, []])
        for r in sampled:
            e = per[line_of[id(r)]]
            e[0] += number(r[col])
            e[1] += 1
            e[2].append(r)
        print(f"\nby source line (top {top}):")
        for ln, (s, n, rs) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{100 * s / total:6.2f}%  {ln:<28} {n:5d} instructions  [{why(rs)}]")
    executed = next((i for i, c in enumerate(head) if c.strip() == "Instructions Executed"), None)
    local = [r for r in data if r[src].split() and r[src].split()[-1] and
             any(w.split(".")[0] in ("LDL", "STL") for w in r[src].split()[:2])]
    if executed is not None and local:
        per = defaultdict(lambda: [0.0, 0])
        for r in local:
            e = per[line_of.get(id(r), r[src].strip()[:40])]
            e[0] += number(r[executed]) or 0.0
            e[1] += 1
        spilled = sum(v[0] for v in per.values()) or 1.0
        print(f"\nlocal memory (spills): {spilled:.0f} executed LDL/STL warp instructions, by source line (top {top}):")
        for ln, (n_exec, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{100 * n_exec / spilled:6.2f}%  {n_exec:12.0f}  {ln:<28} {n:5d} instructions")
    print(f"\nby instruction (top {top}):")
    for r in sorted(sampled, key=lambda r: -number(r[col]))[:top]:
        where = r[addr] if addr is not None else ""
        ln = line_of.get(id(r), "")
        print(f"{100 * number(r[col]) / total:6.2f}%  {where:>10} {ln:<24} {r[src].strip()[:70]}  [{why([r])}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
