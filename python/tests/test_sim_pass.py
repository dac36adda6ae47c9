"""test_sim_pass.py — scripts/sim_pass.py: the simulator on small hand-made lists (a dependency
chain, independent tasks, a wait nothing satisfies, claim-ahead, comm feeding compute, per-task
durations), and on the library's own task lists for the benchmark layers' passes, which must run
to the end with no task stuck, also with the experts' rows of a random routing. Needs cc and
build/libmok.a for the second part (skipped without them).
"""
import os
import shutil
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import sim_pass as S  # noqa: E402

COMM, COMPUTE = 0, 1


def task(kind, role, wait=(-1, 0), wait1=(-1, 0), done=-1, done1=-1):
    return (kind, role, wait[0], wait[1], wait1[0], wait1[1], done, done1)


def test_chain_runs_in_order():
    tasks = [task(S.GATEUP, COMPUTE, done=0), task(S.DOWN, COMPUTE, wait=(0, 1))]
    span, busy, left = S.simulate(tasks, {COMPUTE: 2}, {S.GATEUP: 10.0, S.DOWN: 4.0}, gap=1.0)
    assert left == 0 and span == pytest.approx(10.0 + 1.0 + 4.0 + 1.0)
    assert busy[COMPUTE] == pytest.approx(14.0)


def test_independent_tasks_overlap():
    tasks = [task(S.GATEUP, COMPUTE), task(S.GATEUP, COMPUTE), task(S.GATEUP, COMPUTE)]
    span, _, left = S.simulate(tasks, {COMPUTE: 2}, {S.GATEUP: 10.0}, gap=0.0)
    assert left == 0 and span == pytest.approx(20.0)  # two at once, then the third


def test_unmet_wait_is_reported():
    tasks = [task(S.GATEUP, COMPUTE, wait=(5, 1)), task(S.DOWN, COMPUTE)]
    _, _, left = S.simulate(tasks, {COMPUTE: 1}, {S.GATEUP: 1.0, S.DOWN: 1.0})
    assert left == 2  # the waiting task, and the one its worker never reaches


def test_claim_ahead_ties_the_next_task_to_its_worker():
    # compute: a long task, one that waits for the comm task (done at 5), a short one
    tasks = [task(S.GATEUP, COMPUTE), task(S.DOWN, COMPUTE, wait=(0, 1)), task(S.DOWN, COMPUTE),
             task(S.DISPATCH, COMM, done=0)]
    dur = {S.GATEUP: 10.0, S.DOWN: 1.0, S.DISPATCH: 5.0}
    span, _, left = S.simulate(tasks, {COMM: 1, COMPUTE: 2}, dur, gap=0.0)
    assert left == 0 and span == pytest.approx(10.0)  # the waiting task runs 5-6 on the second CTA
    span, busy, left = S.simulate(tasks, {COMM: 1, COMPUTE: 2}, dur, gap=0.0, ahead_role=COMPUTE)
    assert left == 0 and span == pytest.approx(11.0)  # claimed by the first CTA when it began its long task
    assert busy[COMPUTE] == pytest.approx(12.0)


def test_comm_feeds_compute():
    tasks = [task(S.DISPATCH, COMM, done=0), task(S.GATEUP, COMPUTE, wait=(0, 1)), task(S.DISPATCH, COMM, done=0),
             task(S.GATEUP, COMPUTE, wait=(0, 2))]
    span, busy, left = S.simulate(tasks, {COMM: 1, COMPUTE: 4}, {S.DISPATCH: 5.0, S.GATEUP: 3.0}, gap=0.0)
    assert left == 0 and span == pytest.approx(5.0 + 5.0 + 3.0)  # the second dispatch gates the last task
    assert busy[COMM] == pytest.approx(10.0) and busy[COMPUTE] == pytest.approx(6.0)


@pytest.mark.parametrize("layer", sorted(S.LAYERS))
@pytest.mark.parametrize("backward", [False, True])
def test_library_lists_run_to_the_end(layer, backward):
    if not shutil.which("cc") or not os.path.exists(os.path.join(ROOT, "build", "libmok.a")):
        pytest.skip("needs cc and build/libmok.a (make)")
    tasks = S.task_list(layer, backward, ring=32768, minibatch=2048)
    dur = S.LAYERS[layer]["bwd" if backward else "fwd"]
    assert {t[0] for t in tasks} <= set(dur)
    compute = next(t[1] for t in tasks if t[0] in S.COMPUTE_KINDS)
    span, busy, left = S.simulate(tasks, {1 - compute: 12, compute: 120}, dur)
    assert left == 0 and span > 0
    work = sum(dur[t[0]] for t in tasks if t[1] == compute)
    assert busy[compute] == pytest.approx(work)
    assert span >= work / 120  # no faster than every compute CTA busy all the time


def test_task_durations_override_kinds():
    tasks = [task(S.GATEUP, COMPUTE, done=0), task(S.DOWN, COMPUTE, wait=(0, 1))]
    span, busy, left = S.simulate(tasks, {COMPUTE: 1}, {S.GATEUP: 10.0, S.DOWN: 4.0}, gap=0.0, task_dur=[5.0, 2.0])
    assert left == 0 and span == pytest.approx(7.0) and busy[COMPUTE] == pytest.approx(7.0)


def test_random_routing_and_tail_tiles():
    """--routing random: every token's k experts counted once; the list built from those rows gives
    each routed GEMM task its row tile's real rows (1..128, the experts' rows in total), and the
    simulation takes the tail tiles' own durations."""
    if not shutil.which("cc") or not os.path.exists(os.path.join(ROOT, "build", "libmok.a")):
        pytest.skip("needs cc and build/libmok.a (make)")
    L = S.LAYERS["qwen3-30b-a3b"]
    small = dict(L, T=512, rows=512 * L["topk"] // L["E"])
    saved = S.LAYERS["qwen3-30b-a3b"]
    S.LAYERS["qwen3-30b-a3b"] = small
    try:
        rows = S.random_rows("qwen3-30b-a3b", seed=3)
        assert sum(rows) == 512 * L["topk"] and len(rows) == L["E"] and max(rows) > min(rows)
        tasks = S.task_list("qwen3-30b-a3b", False, ring=32768, minibatch=2048, rows=rows)
    finally:
        S.LAYERS["qwen3-30b-a3b"] = saved
    gateup = [t for t in tasks if t[0] == S.GATEUP]
    per_tile = L["I"] // L["n_tile"][0]  # gate/up tasks per row tile
    assert all(1 <= t[8] <= 128 for t in gateup)
    assert sum(t[8] for t in gateup) == sum(rows) * per_tile
    assert any(t[8] <= 64 for t in gateup)
    dur = L["fwd"]
    compute = next(t[1] for t in tasks if t[0] in S.COMPUTE_KINDS)
    workers = {1 - compute: 12, compute: 120}
    faster = [dur[t[0]] * (0.5 if 0 < t[8] <= 64 else 1.0) for t in tasks]
    span, busy, left = S.simulate(tasks, workers, dur, task_dur=faster)
    assert left == 0 and span > 0
    assert busy[compute] == pytest.approx(sum(d for t, d in zip(tasks, faster) if t[1] == compute))
    assert busy[compute] < sum(dur[t[0]] for t in tasks if t[1] == compute)
