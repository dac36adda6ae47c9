"""The source lines with the most warp-stall samples in an Nsight Compute source-page CSV
(`ncu -i R --page source --csv --print-source cuda`), with each line's largest stall columns.

    python3 scripts/ncu_lines.py build/ncu/ncu-backward-source.csv [N]

Column names differ between ncu versions, so the sample column is found by name: the first whose
header has "Sampling" and "All" in it, else the first with "Samples". If none is found the CSV's
first lines are printed instead, to adapt this script.
"""
import csv
import sys


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
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
    line_col = next((i for i, c in enumerate(head) if c.strip("# ").lower() in ("line", "address")), None)
    stall_cols = [i for i, c in enumerate(head) if "stall" in c.lower() and i != col]
    data = [r for r in rows[head_i + 1:] if len(r) == len(head) and number(r[col])]
    total = sum(number(r[col]) for r in data) or 1.0
    print(f"{path}: {len(data)} lines with samples, {total:.0f} samples ({head[col]})")
    for r in sorted(data, key=lambda r: -number(r[col]))[:top]:
        reasons = sorted(((number(r[i]) or 0.0, head[i]) for i in stall_cols), reverse=True)[:3]
        why = ", ".join(f"{name} {v:.0f}" for v, name in reasons if v > 0)
        where = r[line_col] if line_col is not None else ""
        print(f"{100 * number(r[col]) / total:6.2f}%  {where:>6}  {r[src].strip()[:90]}  [{why}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
