"""timeline.py — a Gantt chart (PNG) of a trace written by mok_trace_write (Workspace.trace_write).

    python3 bench/timeline.py TRACE.json OUT.png [--title TEXT]
    python3 bench/timeline.py TRACE.json --report   # per pass: idle CTAs, per kind task / main-loop / epilogue times
    python3 bench/timeline.py --demo [--out DIR]      # trace a small layer on the cpu backend, draw it

The trace is Chrome trace JSON, {"traceEvents": [{"name", "cat": "comm"|"compute", "ph": "X",
"pid": rank (forward) or 72 + rank (backward), "tid": worker, "ts": us, "dur": us, "args": {"rank": r,
"pass": "forward"|"backward", "minibatch": m}}]} plus the processes' and threads' names ("M"
events), and holds the tasks of the workspace's last forward and last backward on one time axis.
A GPU trace adds one "resident" event per CTA, whose args' sm_cycles give the SM clock (--report).
One row per (rank, pass, worker), comm rows labelled and shaded; bars coloured by task kind; time
in ms from the first task. It also opens in chrome://tracing or https://ui.perfetto.dev.

From another script:

    import timeline
    events = timeline.load(path)            # list of dicts, "X" events only
    forward = timeline.load(path, pass_name="forward")  # one pass, "pid" = rank
    print(timeline.summary(events))         # counts per kind, busy time per row, overlaps
    timeline.draw(events, "out.png", title="forward")   # or draw(path, ...)

--demo: a 2-rank layer (one process drives both ranks, cpu backend, Config(trace=1)) through the
functional API: schedule, forward, backward, trace_write; draws each pass and prints how the task
intervals compare with the wall time of each pass.
"""
import argparse
import json
import os
import sys
from collections import Counter, defaultdict

# Task kinds of mok's passes (src/core/tasks.h), in the order a pass meets them, with fixed colours:
# comm kinds in warm colours, the routed GEMMs in blues/greens, the shared expert in purples.
KIND_COLORS = {
    # forward
    "dispatch": "#e6550d", "gateup": "#3182bd", "down": "#31a354", "combine": "#fd8d3c",
    "shared_up": "#756bb1", "shared_down": "#9e9ac8",
    # backward
    "pull": "#e6550d", "dh": "#3182bd", "dx": "#31a354", "push": "#fd8d3c", "wgrad": "#de2d26",
    "shared_dh": "#756bb1", "shared_dx": "#9e9ac8", "shared_wgrad": "#dd3497", "wgrad_zero": "#969696",
}
KIND_ORDER = list(KIND_COLORS)
_FALLBACK = ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#ff7f0e", "#2ca02c"]


def load(path, resident=False, pass_name=None):
    """The complete ("X") task events of a trace file, as dicts, sorted by (pid, tid, ts).
    resident=True: instead the GPU CTAs' residency events (category "resident", one per CTA, from
    the kernel's start on that CTA to its end). pass_name ("forward" or "backward"): only that
    pass's events, each with "pid" set to its rank."""
    with open(path) as f:
        data = json.load(f)
    raw = data["traceEvents"] if isinstance(data, dict) else data  # the bare-array form is valid too
    events = [e for e in raw if e.get("ph", "X") == "X" and "ts" in e and "dur" in e
              and (e.get("cat") == "resident") == resident]
    if pass_name is not None:
        events = [dict(e, pid=e["args"]["rank"]) for e in events if e.get("args", {}).get("pass") == pass_name]
    events.sort(key=lambda e: (e.get("pid", 0), e.get("tid", 0), e["ts"]))
    return events


def _events(events_or_path):
    return load(events_or_path) if isinstance(events_or_path, (str, os.PathLike)) else list(events_or_path)


def rows_of(events):
    """{(rank, worker): {"cat": "comm"|"compute"|"mixed", "events": [...]}} in row order."""
    rows = defaultdict(list)
    for e in events:
        rows[(e.get("pid", 0), e.get("tid", 0))].append(e)
    out = {}
    for key in sorted(rows):
        cats = {e.get("cat", "?") for e in rows[key]}
        out[key] = {"cat": cats.pop() if len(cats) == 1 else "mixed", "events": rows[key]}
    return out


def summary(events_or_path):
    """Counts and coverage of a trace: events per kind (and per rank), the span, each row's busy
    time, overlaps within a row (a worker runs one task at a time, so there should be none), and
    per rank the fraction of the span in which at least one of its workers ran a task."""
    events = _events(events_or_path)
    if not events:
        return {"events": 0}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    span = t1 - t0
    s = {"events": len(events), "span_us": span, "kinds": dict(Counter(e["name"] for e in events)),
         "kinds_per_rank": {}, "rows": {}, "rank_coverage": {}, "overlaps": 0, "minibatches": {}}
    for rank in sorted({e.get("pid", 0) for e in events}):
        s["kinds_per_rank"][rank] = dict(Counter(e["name"] for e in events if e.get("pid", 0) == rank))
    for (rank, worker), row in rows_of(events).items():
        evs = row["events"]
        busy = sum(e["dur"] for e in evs)
        overlaps = sum(1 for a, b in zip(evs, evs[1:]) if b["ts"] < a["ts"] + a["dur"] - 1e-3)
        s["overlaps"] += overlaps
        s["rows"][f"r{rank}/w{worker}"] = {"cat": row["cat"], "tasks": len(evs), "busy_us": busy,
                                           "busy_frac": busy / span if span else 0.0,
                                           "first_us": evs[0]["ts"] - t0,
                                           "last_end_us": max(e["ts"] + e["dur"] for e in evs) - t0}
    for rank in sorted({e.get("pid", 0) for e in events}):
        iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("pid", 0) == rank)
        covered, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
        for a, b in iv[1:]:
            if a > cur_e:
                covered += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        covered += cur_e - cur_s
        s["rank_coverage"][rank] = covered / span if span else 0.0
    for kind in s["kinds"]:
        mbs = sorted({e.get("args", {}).get("minibatch", -1) for e in events if e["name"] == kind})
        s["minibatches"][kind] = (mbs[0], mbs[-1], len(mbs))
    return s


def kernel_bounds(residents, tasks):
    """From the residency events of one pass: the kernel's span on the GPU (first CTA start to last
    CTA end) and the time before the first task and after the last one, in us; None without them."""
    if not residents or not tasks:
        return None
    k0 = min(e["ts"] for e in residents)
    k1 = max(e["ts"] + e["dur"] for e in residents)
    t0 = min(e["ts"] for e in tasks)
    t1 = max(e["ts"] + e["dur"] for e in tasks)
    return {"kernel_us": k1 - k0, "lead_us": t0 - k0, "tail_us": k1 - t1}


def sm_clock(residents):
    """The clock the SMs held through a pass, from its residency events' SM cycles (args
    sm_cycles over the event's microseconds): (median, lowest, highest) MHz over the CTAs, or None
    when the trace has no cycles."""
    mhz = sorted(e["args"]["sm_cycles"] / e["dur"] for e in residents
                 if e.get("args", {}).get("sm_cycles") and e["dur"] > 0)
    return (mhz[len(mhz) // 2], mhz[0], mhz[-1]) if mhz else None


def idle_lines(ev, rank, window, windows=10, cat="compute"):
    """Where a rank's compute (or comm) CTAs are not in a task: before their first, between tasks
    (the gaps a CTA waits for its next task to be posted or its inputs to be ready: a task's time
    starts after its counter waits), after their last; the gaps by the kind of the task that ends
    them (what the CTA was waiting to start); and the idle share of each of `windows` equal slices
    of the pass (where in the pass the waiting is).
    window: the rank's own (start, end) in the trace's time: its kernel's bounds when known, else its
    tasks' span. Each rank is measured against its own window: the trace puts every rank on one
    time axis, and two GPUs' global timers need not agree."""
    t0, t1 = window
    by_cta = {}
    for e in ev:
        if e["pid"] == rank and e["cat"] == cat:
            by_cta.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not by_cta:
        return []
    lead = tail = between = 0.0
    gaps, before_kind = [], {}
    width = (t1 - t0) / windows if t1 > t0 else 1.0
    busy = [0.0] * windows
    for spans in by_cta.values():
        spans.sort()
        lead += spans[0][0] - t0
        tail += t1 - spans[-1][1]
        for (_, end, _), (start, _, kind) in zip(spans, spans[1:]):
            gap = max(0.0, start - end)
            gaps.append(gap)
            before_kind[kind] = before_kind.get(kind, 0.0) + gap
        for start, end, _ in spans:  # each task's time into the slices it overlaps
            w = max(0, min(windows - 1, int((start - t0) / width)))
            while w < windows and t0 + w * width < end:
                lo, hi = max(start, t0 + w * width), min(end, t0 + (w + 1) * width)
                busy[w] += max(0.0, hi - lo)
                w += 1
    between = sum(gaps)
    gaps.sort()
    total = (t1 - t0) * len(by_cta)
    q = lambda f: gaps[min(len(gaps) - 1, int(f * len(gaps)))] if gaps else 0.0
    waits = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(before_kind.items(), key=lambda kv: -kv[1]) if v > 0)
    idle = " ".join(f"{max(0.0, 100 * (1 - b / (width * len(by_cta)))):.0f}" for b in busy)
    return [f"  rank {rank} {cat} idle: {(lead + between + tail) / 1e3:9.2f} SM-ms of {total / 1e3:.2f} "
            f"({100 * (lead + between + tail) / total:.1f}%): before the first task {lead / 1e3:.2f}, between tasks "
            f"{between / 1e3:.2f} (gap p50/p90/p99 {q(0.5):.1f}/{q(0.9):.1f}/{q(0.99):.1f} us), after the last "
            f"{tail / 1e3:.2f}",
            f"  rank {rank} {cat} gaps by the task that ends them (SM-ms): {waits or 'none'}",
            f"  rank {rank} {cat} idle % per tenth of the pass: {idle}"]


def report(ev, residents, label, flops=None):
    """The text summary of one pass's events (load(..., pass_name=...)) and its residency events:
    per rank its span, the kernel's bounds on the GPU and the SMs' clock when the residency events
    give them, and
    where its compute and its comm CTAs idle (idle_lines); then per task kind of rank 0 the
    tasks, their busy SM-ms, the spread of a task's time, and where the backend measured them its time in GEMM main
    loops (args gemm_us) and after the last one (args epilogue_us); with flops ({kind: FLOPs of
    the pass}), each kind's TFLOP/s per busy SM. label starts each rank's line."""
    lines = []
    first0 = None
    for r in sorted({e["pid"] for e in ev}):
        mine = [e for e in ev if e["pid"] == r]
        t0, t1 = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        kb = kernel_bounds([e for e in residents if e["pid"] == r], mine)
        extra = (f"; kernel {kb['kernel_us'] / 1e3:.3f} ms on the GPU, {kb['lead_us'] / 1e3:.3f} ms before "
                 f"the first task, {kb['tail_us'] / 1e3:.3f} ms after the last" if kb else "")
        clock = sm_clock([e for e in residents if e["pid"] == r])
        if clock:
            extra += f"; SM clock {clock[0]:.0f} MHz (CTAs {clock[1]:.0f}-{clock[2]:.0f})"
        first0 = t0 if first0 is None else first0
        skew_note = (f"; first task {(t0 - first0) / 1e3:+.3f} ms from rank 0's on the trace's axis (the "
                     f"GPUs' timers)" if r else "")
        lines.append(f"{label} rank {r}: span {(t1 - t0) / 1e3:.3f} ms{extra}{skew_note}")
        window = (t0 - kb["lead_us"], t1 + kb["tail_us"]) if kb else (t0, t1)
        lines += idle_lines(ev, r, window) + idle_lines(ev, r, window, cat="comm")
    per = {}
    for e in ev:
        if e["pid"] != 0:
            continue
        c = per.setdefault(e["name"], [0, 0.0, e["cat"], [], 0.0, 0.0])
        c[0] += 1
        c[1] += e["dur"] / 1e3
        c[3].append(e["dur"])
        c[4] += e.get("args", {}).get("gemm_us", 0.0)
        c[5] += e.get("args", {}).get("epilogue_us", 0.0)
    for kind, (n, busy, cat, durs, gemm, epi) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        tf = f"{flops[kind] / (busy * 1e-3) / 1e12:6.2f} TFLOP/s per busy SM" if flops and kind in flops else ""
        durs.sort()
        pct = "/".join(f"{durs[min(len(durs) - 1, int(q * len(durs)))]:.1f}" for q in (0.0, 0.1, 0.5, 0.9))
        loop = (f"  main loops {gemm / n:6.1f}, epilogue {epi / n:6.1f}, before {(busy * 1e3 - gemm - epi) / n:6.1f} "
                f"us/task" if gemm else "")
        lines.append(f"  rank 0 {cat:<7} {kind:<13} {n:6d} tasks  busy {busy:9.2f} SM-ms  avg {busy / n * 1e3:8.1f} us  "
                     f"min/p10/p50/p90 {pct} us{loop}  {tf}")
    return lines


def format_summary(s, wall_us=None):
    if not s.get("events"):
        return "empty trace (no events: was the workspace made with Config(trace=True), and did a pass run?)"
    lines = [f"{s['events']} events, span {s['span_us'] / 1e3:.3f} ms"
             + (f", pass wall time {wall_us / 1e3:.3f} ms (span / wall {s['span_us'] / wall_us:.1%})" if wall_us else "")]
    kinds = sorted(s["kinds"], key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER))
    lines.append("per kind: " + ", ".join(f"{k} {s['kinds'][k]}" for k in kinds))
    for rank, counts in s["kinds_per_rank"].items():
        lines.append(f"  rank {rank}: " + ", ".join(f"{k} {counts[k]}" for k in kinds if k in counts))
    lines.append("minibatch field per kind (min, max, distinct): " +
                 ", ".join(f"{k} {s['minibatches'][k]}" for k in kinds))
    for name, r in s["rows"].items():
        lines.append(f"  {name:<8} {r['cat']:<7} {r['tasks']:5d} tasks, busy {r['busy_us'] / 1e3:8.3f} ms "
                     f"({r['busy_frac']:.0%} of the span), first task at {r['first_us'] / 1e3:.3f} ms, "
                     f"last ends at {r['last_end_us'] / 1e3:.3f} ms")
    lines.append("per rank, fraction of the span with a task running: " +
                 ", ".join(f"rank {r} {c:.1%}" for r, c in s["rank_coverage"].items()))
    lines.append(f"overlapping tasks within a row: {s['overlaps']}")
    return "\n".join(lines)


def draw(events_or_path, out_png, title=None, width=14.0, row_height=0.42, min_width=0.0015):
    """Draws the Gantt chart to out_png. Returns the summary dict (None when matplotlib is missing).
    min_width: bars shorter than this fraction of the span are drawn that wide so that short tasks
    (the cpu backend's copies take microseconds) stay visible; the subtitle says when that happened."""
    events = _events(events_or_path)
    residents = load(events_or_path, resident=True) if isinstance(events_or_path, (str, os.PathLike)) else []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("timeline: matplotlib is not importable (pip install matplotlib): no chart", file=sys.stderr)
        return None
    s = summary(events)
    rows = rows_of(events)
    keys = list(rows)
    fig_h = max(2.5, 1.4 + row_height * len(keys))
    fig, ax = plt.subplots(figsize=(width, fig_h))
    if not events:
        ax.text(0.5, 0.5, "empty trace", ha="center", va="center", transform=ax.transAxes)
        fig.savefig(out_png, dpi=120)
        plt.close(fig)
        return s
    t0 = min(e["ts"] for e in events + residents)
    min_ms = s["span_us"] / 1e3 * min_width
    resident_of = {(e.get("pid", 0), e.get("tid", 0)): e for e in residents}
    widened = sum(1 for e in events if e["dur"] / 1e3 < min_ms)
    colors = dict(KIND_COLORS)
    extra = iter(_FALLBACK * 8)
    seen = []
    for i, key in enumerate(keys):
        y = len(keys) - 1 - i  # first row on top
        if rows[key]["cat"] == "comm":
            ax.axhspan(y - 0.5, y + 0.5, color="#fff1e0", zorder=0)
        if key in resident_of:  # the CTA's life in the kernel, behind its tasks
            r = resident_of[key]
            ax.broken_barh([((r["ts"] - t0) / 1e3, r["dur"] / 1e3)], (y - 0.45, 0.9), facecolors="#d9d9d9",
                           edgecolors="none", zorder=1)
        by_kind = defaultdict(list)
        for e in rows[key]["events"]:
            by_kind[e["name"]].append(((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, min_ms)))
        for kind, spans in by_kind.items():
            if kind not in colors:
                colors[kind] = next(extra)
            if kind not in seen:
                seen.append(kind)
            ax.broken_barh(spans, (y - 0.36, 0.72), facecolors=colors[kind], edgecolors="black", linewidth=0.15,
                           zorder=2)
    ranks = sorted({k[0] for k in keys})
    for i, key in enumerate(keys[1:], 1):
        if key[0] != keys[i - 1][0]:  # a line between ranks
            ax.axhline(len(keys) - i - 0.5, color="black", lw=0.8, zorder=1)
    ax.set_yticks(range(len(keys)))
    def label(key):  # a two-pass trace's pid is per (rank, pass): its events' args say which
        args = rows[key]["events"][0].get("args", {})
        return f"rank {args.get('rank', key[0])} {args.get('pass', '')} · w{key[1]} · {rows[key]['cat']}"
    ax.set_yticklabels([label(k) for k in reversed(keys)], fontsize=8)
    for label, key in zip(ax.get_yticklabels(), reversed(keys)):
        if rows[key]["cat"] == "comm":
            label.set_color("#a63603")
            label.set_fontweight("bold")
    ax.set_ylim(-0.6, len(keys) - 0.4)
    span_ms = s["span_us"] / 1e3
    end_ms = max([span_ms] + [(e["ts"] + e["dur"] - t0) / 1e3 for e in events + residents])
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("time (ms) from the kernel's start" if residents else "time (ms) from the first task")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    order = sorted(seen, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER))
    handles = [Patch(facecolor=colors[k], edgecolor="black", linewidth=0.3, label=f"{k} ({s['kinds'][k]})")
               for k in order]
    handles.append(Patch(facecolor="#fff1e0", edgecolor="none", label="comm worker row"))
    if residents:
        handles.append(Patch(facecolor="#d9d9d9", edgecolor="none", label="CTA resident, no task"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
              title="task kind (count)", title_fontsize=8)
    head = title or (os.path.basename(str(events_or_path)) if isinstance(events_or_path, (str, os.PathLike)) else None)
    sub = (f"{s['events']} tasks on {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {len(keys)} workers, "
           f"span {span_ms:.2f} ms" + (f"; {widened} tasks shorter than {min_ms * 1e3:.0f} us drawn that wide"
                                         if widened else ""))
    ax.set_title(f"{head}\n{sub}" if head else sub, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return s


# ---- demo: a real trace from the cpu backend ---------------------------------------------------------

def demo(out_dir, ranks=2, tokens=512, hidden=128, intermediate=128, experts=8, topk=2, shared=128,
         minibatch_rows=128, ring_rows=256, cpu_threads=2, seed=0):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    import time

    import numpy as np

    import mok
    from mok.bf16 import from_float32 as bf

    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = mok.Config(trace=1, cpu_threads=cpu_threads, minibatch_rows=minibatch_rows, ring_rows=ring_rows)
    E_local = experts // ranks

    def w(shape, fan_in):
        return bf(rng.uniform(-1, 1, shape) * np.sqrt(3.0 / fan_in))

    xs = [bf(rng.uniform(-1, 1, (tokens, hidden))) for _ in range(ranks)]
    dys = [bf(rng.uniform(-1, 1, (tokens, hidden))) for _ in range(ranks)]
    ids, rws = [], []
    for _ in range(ranks):
        logits = rng.normal(size=(tokens, experts))
        top = np.argsort(-logits, axis=1)[:, :topk]
        p = np.exp(np.take_along_axis(logits, top, 1))
        ids.append(np.ascontiguousarray(top.astype(np.int32)))
        rws.append(np.ascontiguousarray((p / p.sum(1, keepdims=True)).astype(np.float32)))
    wg = [w((E_local, intermediate, hidden), hidden) for _ in range(ranks)]
    wu = [w((E_local, intermediate, hidden), hidden) for _ in range(ranks)]
    wd = [w((E_local, hidden, intermediate), intermediate) for _ in range(ranks)]
    sg = su = sd = None
    if shared:
        sg, su, sd = w((shared, hidden), hidden), w((shared, hidden), hidden), w((hidden, shared), shared)

    group = mok.Group.create_local(ranks, backend="cpu", config=cfg)
    results = {}
    try:
        ws = mok.Workspace(group, hidden, intermediate, experts, topk, shared, max_tokens=tokens)
        scheds = mok.build_schedule(ws, ids)
        infos = [s.info() for s in scheds]
        print(f"layer: {ranks} ranks, T={tokens} per rank, H={hidden}, I={intermediate}, E={experts}, k={topk}, "
              f"I_s={shared}; minibatch_rows={minibatch_rows}, ring_rows={ring_rows}, cpu_threads={cpu_threads}")
        for r, i in enumerate(infos):
            print(f"  rank {r}: routed rows {i.routed_rows}, padded {i.padded_rows}, minibatches {i.num_minibatches}, "
                  f"macrobatches {i.num_macrobatches}")
        t = time.perf_counter()
        y, ctxs = mok.forward(ws, scheds, xs, rws, wg, wu, wd, sg, su, sd)
        wall_fwd = (time.perf_counter() - t) * 1e6
        t = time.perf_counter()
        mok.backward(ws, scheds, ctxs, dys, xs, rws, wg, wu, wd, sg, su, sd)
        wall_bwd = (time.perf_counter() - t) * 1e6
        path = os.path.join(out_dir, "trace.json")
        ws.trace_write(path)  # the forward and the backward
        ws.close()
    finally:
        group.close()
    for name, wall in (("forward", wall_fwd), ("backward", wall_bwd)):
        events = load(path, pass_name=name)
        png = os.path.join(out_dir, f"trace_{name}.png")
        s = draw(events, png, title=f"mok cpu backend, {name} pass ({ranks} ranks, T={tokens}/rank, E={experts}, "
                                    f"k={topk}, I_s={shared})")
        s = s or summary(events)
        print(f"\n{name}: {path}" + (f" -> {png}" if os.path.exists(png) else ""))
        print(format_summary(s, wall_us=wall))
        results[name] = s
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", help="trace JSON from mok_trace_write")
    ap.add_argument("png", nargs="?", help="output PNG")
    ap.add_argument("--title", default=None)
    ap.add_argument("--report", action="store_true", help="print each pass's report (per rank the idle compute "
                    "CTAs, per kind the tasks' times: report()); no PNG needed")
    ap.add_argument("--demo", action="store_true", help="trace a small layer on the cpu backend and draw it")
    ap.add_argument("--out", default="build/timeline", help="--demo: where the traces and PNGs go")
    ap.add_argument("--ranks", type=int, default=2, help="--demo: ranks (one process drives them all)")
    ap.add_argument("--tokens", type=int, default=512, help="--demo: tokens per rank")
    ap.add_argument("--cpu-threads", type=int, default=2, help="--demo: worker threads per rank (one moves data)")
    a = ap.parse_args()
    if a.demo:
        demo(a.out, ranks=a.ranks, tokens=a.tokens, cpu_threads=a.cpu_threads)
        return 0
    if a.report and a.trace:
        for name in ("forward", "backward"):
            ev = load(a.trace, pass_name=name)
            if ev:
                print("\n".join(report(ev, load(a.trace, resident=True, pass_name=name), name)))
        if not a.png:
            return 0
    if not a.trace or not a.png:
        ap.error("TRACE.json and OUT.png are required (or --demo, or TRACE.json --report)")
    s = draw(a.trace, a.png, title=a.title)
    print(format_summary(s if s is not None else summary(a.trace)))
    if s is not None:
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
