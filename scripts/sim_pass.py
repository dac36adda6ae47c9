#!/usr/bin/env python3
"""sim_pass.py — what-if simulation of one pass on one GPU, from the task list the library builds
and task durations measured in a trace. Each comm or compute CTA takes the next task of its role
in list order, waits until the task's counters reach their targets, runs for the task kind's
duration (compute tasks plus a gap), then bumps its counters. It answers questions of order and
count ("does this task order, or this many comm CTAs, shorten the pass?") before a GPU run.

    python3 scripts/sim_pass.py --layer deepseek-v3 --pass bwd --comm 8,12,16
    python3 scripts/sim_pass.py --layer qwen3-30b-a3b --pass fwd --tasks-c /tmp/branch_tasks.inc
    python3 scripts/sim_pass.py --layer qwen3-30b-a3b --pass fwd --free combine --comm 8,16
    python3 scripts/sim_pass.py --layer qwen3-30b-a3b --pass fwd --scale gateup=0.87
    python3 scripts/sim_pass.py --layer deepseek-v3 --pass bwd --durations build/traces/trace_deepseek-v3_ep1_skew0.0_bwd.json
    python3 scripts/sim_pass.py --layer qwen3-30b-a3b --pass fwd --routing random --tail 0.5,0.83

The task kinds (values, names, roles) come from the library's one table, MOK_TASK_KINDS in
src/core/tasks.h, read when this module loads. It builds scripts/tasks_dump.c against
build/libmok.a (run `make` first) for the task list; --tasks-c compiles another core/tasks.inc in
its place (`git show BRANCH:src/core/tasks.inc > F`, for a branch whose tasks.h is this tree's),
to simulate a branch's order beside main's. --routing random gives the experts the rows of a
random top-k routing (each token's k largest of E random logits, as the benchmark's softmax top-k
of random logits picks them) instead of equal rows, so that experts end in partial row tiles;
--tail F makes the routed GEMM tasks (gate/up, down, dh, dx) of a row tile with 64 real rows or
fewer take F times their kind's duration. The durations (µs per task) were traced
on one H200 (docs/log.md, which also compares the simulation with traced passes); --durations
takes them from a trace instead (`bench.py --trace` writes one per layer and pass: each kind's
mean over the pass, the table's value for a kind the trace lacks). A comm task's
duration does not change with the number of comm CTAs here, which the GPU does not promise: more
CTAs moving rows at once share the memory system. Its compute CTAs claim a task when they are
free, or with --claim-ahead when they start the one before (as the producer does); it has no
per-task "before" beyond the gap, and one duration per kind whatever a tile's real rows (but
--tail).
"""
import argparse
import collections
import heapq
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def read_kinds(path=os.path.join(ROOT, "src", "core", "tasks.h")):
    """[(NAME, name, role)] of MOK_TASK_KINDS in table order (the enum's values)."""
    with open(path) as f:
        text = f.read()
    table = text[text.index("#define MOK_TASK_KINDS(X)"):text.index("enum mok_task_kind")]
    return re.findall(r'\bX\((\w+), "(\w+)", (COMM|COMPUTE),', table)


# task kinds: a module constant per kind (DISPATCH, GATEUP, ...), their trace names, and the
# kinds a compute worker runs
KINDS = read_kinds()
for _value, (_name, _text, _role) in enumerate(KINDS):
    globals()[_name] = _value
KIND_NAMES = {value: text for value, (_, text, _) in enumerate(KINDS)}
KIND_VALUES = {text: value for value, text in KIND_NAMES.items()}
COMPUTE_KINDS = {value for value, (_, _, role) in enumerate(KINDS) if role == "COMPUTE"}

# E_local, top-k, rows per expert, H, I, I_s, T, n_tile (forward, backward) on one GPU (bench/layers.py's
# EP1 cases: tokens x top-k rows over the local experts), the comm CTAs the library chose
# (forward, backward), and the traced durations in µs (one H200, `bench.py --ranks 1 --no-sweep
# --only qwen3-30b-a3b,deepseek-v3 --trace`; the one-rank combine and push store in place, so
# they take a fraction of a µs).
LAYERS = {
    "deepseek-v3": dict(E=32, topk=8, rows=2048, H=7168, I=2048, Is=2048, T=8192, n_tile=(128, 256), comm=(4, 8),
                        fwd={SHARED_UP: 84.6, SHARED_DOWN: 26.6, DISPATCH: 63.9, GATEUP: 84.2, DOWN: 29.4,
                             COMBINE: 0.3},
                        bwd={SHARED_DH: 104.4, SHARED_DX: 49.6, PULL: 147.0, DH: 105.5, DX: 51.7, PUSH: 0.2,
                             WGRAD: 22.9, SHARED_WGRAD: 88.0}),
    "qwen3-30b-a3b": dict(E=128, topk=8, rows=1024, H=2048, I=768, Is=0, T=16384, n_tile=(128, 128), comm=(12, 16),
                          fwd={DISPATCH: 21.0, GATEUP: 24.9, DOWN: 15.1, COMBINE: 0.3},
                          bwd={PULL: 43.3, DH: 33.8, DX: 21.4, PUSH: 0.2, WGRAD: 13.1}),
}


def simulate(tasks, workers, dur, gap=0.9, task_dur=None, ahead_role=None):
    """tasks: (kind, role, wait0, target0, wait1, target1, done0, done1[, real rows]) in list order;
    workers: {role: count}; dur: {kind: µs}, or task_dur: µs per task. ahead_role: the role whose
    workers claim their next task as soon as they start one (as the compute CTAs' producers do,
    compute_walk.cuh): it waits on its counters while the current task runs and starts when both
    are through. Returns (span µs, {role: busy µs}, tasks left unstarted or waiting when nothing
    more can happen)."""
    by_role = collections.defaultdict(list)
    for i, t in enumerate(tasks):
        by_role[t[1]].append(i)
    cursor = collections.defaultdict(int)
    counters = collections.defaultdict(int)
    waiting = collections.defaultdict(list)  # counter -> [(target, worker, task)]
    events, seq = [], [0]
    busy = collections.defaultdict(float)
    running, queued = set(), {}  # workers in a task; worker -> [claimed task, its counters met]

    def post(time, what, worker, task):
        heapq.heappush(events, (time, seq[0], what, worker, task))
        seq[0] += 1

    def met(worker, task):
        """Whether the task's counters are through; if not, it waits on the first that is not."""
        _, _, w0, t0, w1, t1 = tasks[task][:6]
        for c, target in ((w0, t0), (w1, t1)):
            if c >= 0 and counters[c] < target:
                waiting[c].append((target, worker, task))
                return False
        return True

    def run(worker, task, now):
        kind = tasks[task][0]
        d = task_dur[task] if task_dur else dur[kind]
        busy[worker[0]] += d
        running.add(worker)
        post(now + d + (gap if kind in COMPUTE_KINDS else 0.0), "done", worker, task)
        if worker[0] == ahead_role and cursor[worker[0]] < len(by_role[worker[0]]):
            nxt = by_role[worker[0]][cursor[worker[0]]]
            cursor[worker[0]] += 1
            queued[worker] = [nxt, met(worker, nxt)]

    def through(worker, task, now):
        """The task's counters are through: a claimed-ahead task runs once its worker is free."""
        q = queued.get(worker)
        if q is not None and q[0] == task:
            q[1] = True
            if worker not in running:
                del queued[worker]
                run(worker, task, now)
        else:
            run(worker, task, now)

    for role, n in workers.items():
        for i in range(n):
            post(0.0, "free", (role, i), -1)
    span = 0.0
    while events:
        now, _, what, worker, task = heapq.heappop(events)
        span = max(span, now)
        if what == "done":
            running.discard(worker)
            for c in tasks[task][6:8]:
                if c < 0:
                    continue
                counters[c] += 1
                ready = [x for x in waiting[c] if counters[c] >= x[0]]
                waiting[c] = [x for x in waiting[c] if counters[c] < x[0]]
                for _, w, t in ready:
                    if met(w, t):
                        through(w, t, now)
            if worker not in running:
                q = queued.get(worker)
                if q is None:
                    post(now, "free", worker, -1)
                elif q[1]:
                    del queued[worker]
                    run(worker, q[0], now)
        elif cursor[worker[0]] < len(by_role[worker[0]]):
            t = by_role[worker[0]][cursor[worker[0]]]
            cursor[worker[0]] += 1
            if met(worker, t):
                run(worker, t, now)
    left = sum(len(v) for v in waiting.values()) + sum(len(by_role[r]) - cursor[r] for r in by_role)
    return span, busy, left


def random_rows(layer, seed):
    """Rows per expert of a random top-k routing of the layer's tokens: each token's k largest of E
    random logits (softmax keeps their order, so the benchmark's routing picks the same way)."""
    import random
    L = LAYERS[layer]
    rng = random.Random(seed)
    rows = [0] * L["E"]
    for _ in range(L["T"]):
        logits = [rng.random() for _ in range(L["E"])]
        for e in sorted(range(L["E"]), key=logits.__getitem__)[-L["topk"]:]:
            rows[e] += 1
    return rows


def task_list(layer, backward, ring, minibatch, tasks_c=None, rows=None):
    """The library's task list of a one-rank pass (scripts/tasks_dump.c against build/libmok.a, or
    with another tasks.inc); rows: each expert's routed rows (default: the layer's equal rows)."""
    L = LAYERS[layer]
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "tasks_dump")
        srcs = [os.path.join(ROOT, "scripts", "tasks_dump.c")]
        if tasks_c:
            wrapper = os.path.join(tmp, "tasks_alt.c")
            with open(wrapper, "w") as f:
                f.write('#include "core/tasks.h"\n#include "%s"\n' % os.path.abspath(tasks_c))
            srcs.append(wrapper)
        subprocess.run(["cc", "-std=c11", "-O2", "-I" + os.path.join(ROOT, "src"), "-I" + os.path.join(ROOT, "src", "core"),
                        "-I" + os.path.join(ROOT, "include")] + srcs + [os.path.join(ROOT, "build", "libmok.a"), "-lm",
                        "-lpthread", "-o", exe], check=True)
        per = ",".join(map(str, rows)) if rows else str(L["rows"])
        out = subprocess.run([exe, str(L["E"]), per, str(L["H"]), str(L["I"]), str(L["Is"]), str(L["T"]),
                              str(ring), str(minibatch), str(int(backward)), str(L["n_tile"][int(backward)])],
                             check=True, capture_output=True, text=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


def traced_durations(path, backward):
    """{kind: mean µs} of the pass's tasks in a trace written by mok_trace_write."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import timeline
    sums = collections.defaultdict(lambda: [0.0, 0])
    for e in timeline.load(path, pass_name="backward" if backward else "forward"):
        c = sums[e["name"]]
        c[0] += e["dur"]
        c[1] += 1
    return {KIND_VALUES[k]: total / n for k, (total, n) in sums.items() if k in KIND_VALUES and n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", choices=sorted(LAYERS), default="deepseek-v3")
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--comm", default="", help="comm CTA counts to try (comma-separated; default: the layer's, "
                                               "as the library chose them in the traced pass)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--ring", type=int, default=32768)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--gap", type=float, default=0.9, help="µs between a compute CTA's tasks")
    ap.add_argument("--tasks-c", help="another core/tasks.inc to build the list with (a branch's order)")
    ap.add_argument("--durations", metavar="TRACE", help="task durations from this trace (JSON) instead of the table")
    ap.add_argument("--free", default="",
                    help="task kinds that move nothing (comma-separated names: combine, push, dispatch, pull): "
                         "they keep their place and counters and take no time")
    ap.add_argument("--tokens", type=int, default=0,
                    help="tokens in place of the layer's (the traced durations stay the layer's)")
    ap.add_argument("--routing", choices=("equal", "random"), default="equal",
                    help="the experts' rows: the layer's, equal (default), or a random top-k routing's")
    ap.add_argument("--seed", type=int, default=1, help="--routing random's seed")
    ap.add_argument("--tail", default="",
                    help="duration factors (comma-separated: one simulation each) for the routed GEMM tasks of "
                         "row tiles with 64 real rows or fewer")
    ap.add_argument("--dh-cols", type=int, default=0,
                    help="columns of I per dh task (the library's MOK_CUDA_COLS_DH) in place of the layer's; "
                         "pair it with --scale dh=F for the wider task's duration")
    ap.add_argument("--scale", default="",
                    help="task kinds made faster or slower (comma-separated NAME=FACTOR, e.g. gateup=0.87): their "
                         "duration times FACTOR, to predict a change to one kind's tiles before building it")
    ap.add_argument("--claim-ahead", action="store_true",
                    help="each compute CTA claims its next task when it starts one, as the producer does")
    a = ap.parse_args()
    backward = a.which == "bwd"
    if a.dh_cols > 0:
        L = LAYERS[a.layer]
        LAYERS[a.layer] = dict(L, n_tile=(L["n_tile"][0], a.dh_cols))
    if a.tokens > 0:
        L = LAYERS[a.layer]
        LAYERS[a.layer] = dict(L, T=a.tokens, rows=a.tokens * L["topk"] // L["E"])
    rows = random_rows(a.layer, a.seed) if a.routing == "random" else None
    tasks = task_list(a.layer, backward, a.ring, a.minibatch, a.tasks_c, rows)
    dur = dict(LAYERS[a.layer]["bwd" if backward else "fwd"])
    if a.durations:
        traced = traced_durations(a.durations, backward)
        if not traced:
            sys.exit(f"sim_pass: no {'backward' if backward else 'forward'} tasks in {a.durations}")
        dur.update(traced)
        print("durations (µs): " + ", ".join(f"{KIND_NAMES[k]} {v:.1f}" for k, v in sorted(dur.items())))
    movers = {"combine", "push", "dispatch", "pull"}
    for name in filter(None, a.free.split(",")):
        if name not in movers:
            sys.exit(f"sim_pass: --free takes {sorted(movers)}, not {name!r}")
        dur[KIND_VALUES[name]] = 0.0
    for item in filter(None, a.scale.split(",")):
        name, _, factor = item.partition("=")
        if name not in KIND_VALUES or KIND_VALUES[name] not in dur:
            sys.exit(f"sim_pass: --scale names a task kind of this pass, not {name!r}")
        dur[KIND_VALUES[name]] *= float(factor)
    missing = sorted({KIND_NAMES[t[0]] for t in tasks if t[0] not in dur})
    if missing:
        sys.exit(f"sim_pass: no duration for task kinds {missing}")
    compute_role = next(t[1] for t in tasks if t[0] in COMPUTE_KINDS)
    routed = [t for t in tasks if t[8] > 0]
    tails = sum(1 for t in routed if t[8] <= 64)
    print(f"{a.layer} {a.which}: {len(tasks)} tasks" + (f" ({a.tasks_c})" if a.tasks_c else "") +
          (f"; {a.routing} routing: {tails} of {len(routed)} routed GEMM tasks on row tiles of 64 rows or fewer"
           if routed else ""))
    comms = a.comm or str(LAYERS[a.layer]["comm"][int(backward)])
    for factor in [None] + [float(f) for f in filter(None, a.tail.split(","))]:
        task_dur = None if factor is None else [dur[t[0]] * (factor if 0 < t[8] <= 64 else 1.0) for t in tasks]
        for comm in (int(c) for c in comms.split(",")):
            comp = a.sms - comm
            span, busy, left = simulate(tasks, {1 - compute_role: comm, compute_role: comp}, dur, a.gap, task_dur,
                                        compute_role if a.claim_ahead else None)
            print(f"  {'' if factor is None else f'tail x{factor}: '}comm {comm:3d}: span {span / 1e3:7.3f} ms, "
                  f"compute idle {100 * (1 - busy[compute_role] / (span * comp)):5.1f}%"
                  f", comm busy {100 * busy[1 - compute_role] / (span * comm):5.1f}%" + (f", {left} tasks stuck" if left else ""))


if __name__ == "__main__":
    main()
