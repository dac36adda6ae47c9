"""test_binding.py — the Python binding against the library's own reference: the ctypes layer
(version, struct sizes, status strings), the cpu backend's forward and backward for 1, 2 and 3
ranks (local mode and one thread per rank), bad inputs, the bf16 helpers, determinism, accumulate
mode, the recomputed context, and mok.torch.MoE against a float32 PyTorch MoE (skipped without
torch); on GPUs also CUDA-graph capture and replay of MoE, the trace, and EP2 over torch.distributed.
Random inputs are fresh per run; the seed is printed (MOK_PY_SEED=N replays a run).
"""
import ctypes
import json
import os
import subprocess
import sys
import threading
import types
import zlib

import numpy as np
import pytest

import mok
from mok import _lib, functional
from mok.bf16 import from_float32 as bf, to_float32 as f32

import random_layer
from random_layer import weights

SEED = int(os.environ.get("MOK_PY_SEED", np.random.SeedSequence().entropy % (1 << 32)))


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"MOK_PY_SEED={SEED}")  # shown with a failing test's output

# Tolerances: max |got - ref| / max |ref| per array, ref being mok_ref_* (fp64 inside).
TOL = {
    "y": 2e-2,          # one bf16 rounding of y, after bf16-rounded gate/up/h/expert outputs
    "dx": 2e-2,         # the same for dx (each part rounded to bf16, the sum rounded once)
    "d_router_w": 3e-2,  # an fp32 dot of dy with the bf16 expert output; bf16 h inside
    "grads": 3e-2,      # weight gradients: fp32 accumulation over rows, written as bf16 here
}

# Small buffers and a small ring, so that a few hundred routed rows already span several
# macrobatches (ring reuse and replay are exercised, not only the first pass through the ring).
CONFIG = mok.Config(cpu_threads=2, minibatch_rows=128, ring_rows=256)


def make_layer(P, tokens, H=128, I=64, E=6, k=2, Is=64, seed=0, holes=False, signed=False, even_only=False):
    """A random layer of random_layer.make_layer (the softmax router) from this run's seed."""
    return random_layer.make_layer(SEED, P, tokens, H, I, E, k, Is, seed, holes=holes, signed=signed,
                                   even_only=even_only)


def workspace(L, group=None, config=CONFIG, max_tokens=None):
    group = group or mok.Group.create_local(L["P"], backend="cpu", config=config)
    ws = mok.Workspace(group, L["H"], L["I"], L["E"], L["k"], L["Is"],
                       max_tokens=max_tokens or max(max(L["tokens"]), 1), config=config)
    return group, ws


def run(ws, L, accumulate=False, grads=None):
    schedules = mok.build_schedule(ws, L["topk_ids"])
    y, contexts = mok.forward(ws, schedules, L["x"], L["router_w"], *weights(L))
    g = mok.backward(ws, schedules, contexts, L["dy"], L["x"], L["router_w"], *weights(L), accumulate=accumulate,
                     grads=grads)
    return schedules, y, contexts, g


def reference(L):
    args = (L["x"], L["topk_ids"], L["router_w"], *weights(L))
    return mok.reference_forward(*args), mok.reference_backward(L["dy"], *args)


def as_f32(a):
    return f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)


def rel_err(got, ref):
    got, ref = as_f32(got), as_f32(ref)
    assert got.shape == ref.shape
    if ref.size == 0:
        return 0.0
    assert np.isfinite(got).all(), "non-finite values in the result"
    scale = max(float(np.abs(ref).max()), 1e-30)
    return float(np.abs(got - ref).max()) / scale


def check_against_reference(L, y, g, y_ref, g_ref, start=None):
    """start: accumulate mode's starting values of the weight gradients (subtracted again)."""
    for p in range(L["P"]):
        assert rel_err(y[p], y_ref[p]) <= TOL["y"], f"y rank {p}"
        assert rel_err(g["dx"][p], g_ref["dx"][p]) <= TOL["dx"], f"dx rank {p}"
        assert rel_err(g["d_router_w"][p], g_ref["d_router_w"][p]) <= TOL["d_router_w"], f"d_router_w rank {p}"
        for key in ("dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down"):
            if g_ref[key][p] is None:
                assert g[key][p] is None
                continue
            got = as_f32(g[key][p]) - (start[key][p] if start else 0)
            assert rel_err(got, g_ref[key][p]) <= TOL["grads"], f"{key} rank {p}"


# ---- the ctypes layer ---------------------------------------------------------------------------------


REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_version_agrees_everywhere():
    """One version, include/mok.h's: the library's, mok.__version__, mok.version(), version_info, and
    `mok --version` of the build beside the library (as "MAJOR.MINOR.PATCH", never the encoded 100)."""
    with open(os.path.join(REPO, "include", "mok.h")) as f:
        defines = dict(line.split()[1:3] for line in f if line.startswith("#define MOK_VERSION_"))
    want = tuple(int(defines[f"MOK_VERSION_{part}"]) for part in ("MAJOR", "MINOR", "PATCH"))
    assert mok.version_info == want and all(isinstance(part, int) for part in mok.version_info)
    assert mok.version() == mok.__version__ == ".".join(map(str, want))
    assert _lib.lib.mok_version() == want[0] * 10000 + want[1] * 100 + want[2]
    tool = os.path.join(os.path.dirname(mok.library_path), "mok")
    if not os.path.exists(tool):
        pytest.skip(f"no mok command beside {mok.library_path}")
    out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == f"mok {mok.__version__}", out.stdout


def test_setup_reads_the_version_from_the_header():
    """python/setup.py's version is include/mok.h's (the package metadata says what the library says)."""
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=os.path.join(REPO, "python"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == mok.__version__


def test_struct_sizes():
    assert _lib.lib.mok_config_struct_size() == ctypes.sizeof(_lib.Config)
    assert ctypes.sizeof(_lib.UniqueId) == 128
    assert ctypes.sizeof(_lib.ScheduleInfo) == 8 * (mok.MAX_RANKS + 5)
    assert ctypes.sizeof(_lib.Shape) == 7 * 8  # six int64 and an int, padded
    assert ctypes.sizeof(_lib.Sizes) == 5 * 8
    assert set(_lib.FUNCTIONS) >= {"mok_forward", "mok_backward", "mok_ref_backward", "mok_recompute_context"}


def test_config_defaults_aliases_and_validation():
    assert mok.Config() == mok.Config.default()
    c = mok.Config(fwd_num_comm_sms=8, minibatch_size=256, macrobatch_size=512, fwd_dispatch=1)
    assert (c.fwd_comm_sms, c.minibatch_rows, c.ring_rows, c.fwd_dispatch) == (8, 256, 512, "push")
    assert c.minibatch_size == 256 and c.fwd_num_comm_sms == 8
    assert c.replace(ring_rows=1024).macrobatch_size == 1024
    assert mok.Config.from_struct(c.to_struct()) == c
    upper = mok.Config(fwd_dispatch="PUSH", fwd_combine="Pull", bwd_combine="pUsH", bwd_dispatch="PULL")
    assert (upper.fwd_dispatch, upper.fwd_combine, upper.bwd_combine, upper.bwd_dispatch) == ("push", "pull", "push",
                                                                                              "pull")
    with pytest.raises(ValueError, match="fwd_dispatch"):
        mok.Config(fwd_dispatch="sideways")
    with pytest.raises(TypeError):
        mok.Config(no_such_field=1)
    with pytest.raises(mok.InvalidArgumentError, match="minibatch_rows"):
        mok.Config(minibatch_rows=100).validate()
    with pytest.raises(mok.MokError, match="ring_rows"):
        mok.Group.create_local(1, backend="cpu", config=mok.Config(ring_rows=1000, minibatch_rows=128))


def test_status_strings_and_backends():
    assert _lib.status_string(_lib.Status.OK) == "ok"
    assert _lib.status_string(_lib.Status.ERR_TIMEOUT) == "timed out waiting for a peer rank"
    assert mok.backend_available("cpu") is True and mok.backend_available("auto") is True
    assert mok.device_count("cpu") == 1
    assert isinstance(mok.backend_available("cuda"), bool)
    assert mok.backend_available("cuda") == (mok.device_count("cuda") > 0)
    assert _lib.lib.mok_backend_name(_lib.Backend.CUDA) == b"cuda"
    uid = mok.Group.unique_id("cpu")
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != mok.Group.unique_id("cpu")


# ---- forward and backward against the reference -------------------------------------------------------

CASES = {
    # name: (P, tokens per rank, layer options)
    "P1": (1, [70], dict(E=4, k=2, Is=64)),
    "P1-no-shared-k1": (1, [45], dict(E=4, k=1, Is=0)),
    "P2": (2, [50, 37], dict(E=6, k=2, Is=64, signed=True)),
    "P3-holes": (3, [41, 0, 60], dict(E=6, k=3, Is=64, holes=True)),
    "P3-no-shared": (3, [33, 20, 28], dict(E=9, k=2, Is=0, I=128)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_matches_reference(name):
    P, tokens, opts = CASES[name]
    L = make_layer(P, tokens, seed=zlib.crc32(name.encode()) % 1000, **opts)
    group, ws = workspace(L)
    with group:
        schedules, y, contexts, g = run(ws, L)
        for p, s in enumerate(schedules):
            info = s.info()
            assert info.num_tokens == tuple(tokens)
            owned = range(p * ws.num_local_experts, (p + 1) * ws.num_local_experts)
            assert info.routed_rows == sum(int(np.isin(ids, owned).sum()) for ids in L["topk_ids"])
        y_ref, g_ref = reference(L)
        check_against_reference(L, y, g, y_ref, g_ref)
        for p in range(P):  # empty slots get d_router_w = 0
            assert (g["d_router_w"][p][L["topk_ids"][p] < 0] == 0).all()


def test_bare_arrays_for_one_rank_and_replay():
    """One local rank takes bare arrays and returns bare results; a context that keeps fewer rows
    than are routed makes the backward replay the rest."""
    L = make_layer(1, [90], E=4, k=2, Is=64, seed=7)
    config = CONFIG.replace(context_rows=128)
    group = mok.Group.create_local(1, backend="cpu", config=config)
    with group:
        ws = mok.Workspace(group, 128, 64, 4, 2, 64, max_tokens=90)
        s = mok.build_schedule(ws, L["topk_ids"][0])
        assert isinstance(s, mok.Schedule) and s.info().padded_rows > 128
        one = lambda key: L[key][0] if isinstance(L[key], list) else L[key]  # noqa: E731
        w = [one(k) for k in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")]
        y, ctx = mok.forward(ws, s, one("x"), one("router_w"), *w)
        assert isinstance(y, np.ndarray) and y.shape == (90, 128) and y.dtype == np.uint16
        g = mok.backward(ws, s, ctx, one("dy"), one("x"), one("router_w"), *w)
        assert isinstance(g["dx"], np.ndarray) and g["dw_gate"].dtype == np.uint16
        y_ref, g_ref = reference(L)
        check_against_reference(L, [y], {k: [v] for k, v in g.items()}, y_ref, g_ref)


def test_one_thread_per_rank_matches_local_mode():
    """Group.create: each rank its own thread with a shared unique id; the results equal local mode's."""
    L = make_layer(2, [40, 52], E=4, k=2, Is=64, seed=11)
    group, ws = workspace(L)
    with group:
        _, y_local, _, g_local = run(ws, L)
    uid = mok.Group.unique_id("cpu")
    results, errors = [None, None], []

    def rank_main(rank):
        try:
            g = mok.Group.create(2, rank, uid, backend="cpu", config=CONFIG)
            assert (g.nranks, g.num_local_ranks, g.first_rank) == (2, 1, rank)
            ws = mok.Workspace(g, 128, 64, 4, 2, 64, max_tokens=52)
            mine = {key: L[key][rank] for key in ("x", "dy", "topk_ids", "router_w", "w_gate", "w_up", "w_down")}
            s = mok.build_schedule(ws, mine["topk_ids"])
            y, ctx = mok.forward(ws, s, mine["x"], mine["router_w"], mine["w_gate"], mine["w_up"], mine["w_down"],
                                 L["s_gate"], L["s_up"], L["s_down"])
            gr = mok.backward(ws, s, ctx, mine["dy"], mine["x"], mine["router_w"], mine["w_gate"], mine["w_up"],
                              mine["w_down"], L["s_gate"], L["s_up"], L["s_down"])
            results[rank] = (y, gr)
            ws.close()  # a barrier with the peer
            g.close()
        except Exception as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for p in range(2):
        y, gr = results[p]
        assert np.array_equal(y, y_local[p])
        for key, value in gr.items():
            assert np.array_equal(value, g_local[key][p]), key


def test_zero_tokens_everywhere():
    L = make_layer(2, [0, 0], E=4, k=2, Is=64, seed=3)
    group, ws = workspace(L, max_tokens=8)
    with group:
        _, y, _, g = run(ws, L)
        assert y[0].shape == (0, 128) and g["d_router_w"][1].shape == (0, 2)
        assert not g["dw_gate"][0].any()  # experts without rows get zeros


# ---- bad inputs -----------------------------------------------------------------------------------------


@pytest.fixture
def small():
    L = make_layer(2, [20, 30], E=4, k=2, Is=64, seed=5)
    group, ws = workspace(L, max_tokens=30)
    yield L, ws
    group.close()


def test_library_errors_carry_the_message(small):
    L, ws = small
    too_many = [np.zeros((31, 2), np.int32), L["topk_ids"][1]]
    with pytest.raises(mok.MokError, match=r"num_tokens: 31 is not in \[0, max_tokens = 30\]") as info:
        mok.build_schedule(ws, too_many)
    assert info.value.status == mok.Status.ERR_INVALID_ARGUMENT
    assert isinstance(info.value, mok.InvalidArgumentError)
    assert "max_tokens" in info.value.message and info.value.status_string == "invalid argument"
    bad_ids = [L["topk_ids"][0].copy(), L["topk_ids"][1]]
    bad_ids[0][3, 1] = 4  # E = 4
    with pytest.raises(mok.MokError, match=r"expert id 4, not in \[-1, E = 4\)"):
        mok.build_schedule(ws, bad_ids)
    # the workspace stays usable after rejected arguments
    _, y, _, _ = run(ws, L)
    assert y[1].shape == (30, 128)


def test_workspace_shape_errors():
    group = mok.Group.create_local(2, backend="cpu", config=CONFIG)
    with group:
        with pytest.raises(mok.MokError, match=r"shape.topk: 5 is not in \[1, num_experts = 4\]"):
            mok.Workspace(group, 128, 64, 4, 5, max_tokens=16)
        with pytest.raises(mok.MokError, match="shape.hidden: 100"):
            mok.Workspace(group, 100, 64, 4, 2, max_tokens=16)
        with pytest.raises(mok.MokError, match="not divisible by the group size P = 2"):
            mok.Workspace(group, 128, 64, 3, 2, max_tokens=16)
    with pytest.raises(mok.MokError, match="nranks"):
        mok.Group.create_local(0, backend="cpu")


def test_python_checks_raise_value_error(small):
    L, ws = small
    s = mok.build_schedule(ws, L["topk_ids"])
    w = weights(L)
    with pytest.raises(ValueError, match=r"x\[0\] has dtype float32"):
        mok.forward(ws, s, [f32(L["x"][0]), L["x"][1]], L["router_w"], *w)
    with pytest.raises(ValueError, match=r"router_w\[1\] has shape \(30, 3\), expected \(30, 2\)"):
        mok.forward(ws, s, L["x"], [L["router_w"][0], np.zeros((30, 3), np.float32)], *w)
    with pytest.raises(ValueError, match="contiguous"):
        mok.forward(ws, s, [L["x"][0], np.asfortranarray(L["x"][1])], L["router_w"], *w)
    with pytest.raises(ValueError, match=r"w_down\[0\] has shape"):
        mok.forward(ws, s, L["x"], L["router_w"], w[0], w[1], [w[2][0][:, :, :32].copy(), w[2][1]], *w[3:])
    with pytest.raises(ValueError, match="one per local rank"):
        mok.forward(ws, s, L["x"][:1], L["router_w"], *w)
    with pytest.raises(ValueError, match="pass a list"):
        mok.build_schedule(ws, L["topk_ids"][0])
    with pytest.raises(ValueError, match="int32"):
        mok.build_schedule(ws, [ids.astype(np.int64) for ids in L["topk_ids"]])
    with pytest.raises(ValueError, match="no shared expert"):
        ws0 = mok.Workspace(ws.group, 128, 64, 4, 2, max_tokens=30)
        mok.forward(ws0, mok.build_schedule(ws0, L["topk_ids"]), L["x"], L["router_w"], *w)
    with pytest.raises(ValueError, match="accumulate"):
        _, _, ctx, _ = run(ws, L)
        mok.backward(ws, s, ctx, L["dy"], L["x"], L["router_w"], *w, accumulate=2)


def test_misaligned_input_is_copied(small):
    """A contiguous but misaligned input view is copied to an aligned buffer, not rejected."""
    L, ws = small
    s = mok.build_schedule(ws, L["topk_ids"])
    y_ref = mok.forward(ws, s, L["x"], L["router_w"], *weights(L))[0]
    shifted = []
    for rw in L["router_w"]:
        raw = np.empty(rw.size + 1, np.float32)
        view = raw[1:].reshape(rw.shape)
        view[...] = rw
        shifted.append(view)
    assert shifted[0].ctypes.data % 16 != 0
    y, _ = mok.forward(ws, s, L["x"], shifted, *weights(L))
    assert all(np.array_equal(a, b) for a, b in zip(y, y_ref))


# ---- bf16 ---------------------------------------------------------------------------------------------


def test_bf16_matches_the_library():
    rng = np.random.default_rng([SEED, 1])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0],
                       np.float32)
    ties = ((np.arange(0, 128, dtype=np.uint32) * 0x02000000 + 0x3F000000) | 0x8000).view(np.float32)  # exact halves
    ties = ties[np.isfinite(ties)]
    payload_nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F810000], np.uint32).view(np.float32)
    values = np.concatenate([special, ties, payload_nans, rng.normal(size=2000).astype(np.float32) * 100,
                             rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    mine = bf(values)
    theirs = np.array([_lib.lib.mok_bf16_from_float(float(v)) for v in values], np.uint16)
    # ctypes passes the value as a C float; NaNs keep their payload in that trip only up to the
    # quiet bit, so compare NaN-ness there and exact bits elsewhere.
    nan = np.isnan(values)
    assert np.array_equal(mine[~nan], theirs[~nan])
    assert np.isnan(f32(mine[nan])).all() and np.isnan(f32(theirs[nan])).all()
    back = np.array([_lib.lib.mok_bf16_to_float(int(b)) for b in mine[~nan]], np.float32)
    assert np.array_equal(f32(mine[~nan]), back)


def test_bf16_round_trip():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = f32(every)
    nan = np.isnan(values)
    assert np.array_equal(bf(values)[~nan], every[~nan])  # every bf16 value is exact in fp32
    assert np.isnan(f32(bf(values[nan]))).all()
    assert bf(np.float32(1.0 + 2**-8)) == bf(np.float32(1.0))  # a tie goes to even
    assert bf(np.float32(1.0 + 3 * 2**-8)) == bf(np.float32(1.0 + 2**-6))
    assert f32(bf(np.float32(3.4e38))) == np.inf  # past the largest bf16
    assert mok.bf16.round(np.float32(1.0 + 2**-9)) == 1.0


# ---- determinism, accumulate, recompute ---------------------------------------------------------------


def test_determinism_bitwise():
    L = make_layer(3, [60, 45, 70], E=6, k=2, Is=64, seed=21)
    outs = []
    for config in (CONFIG, CONFIG, CONFIG.replace(cpu_threads=3), CONFIG.replace(minibatch_rows=256, ring_rows=512)):
        group, ws = workspace(L, config=config)
        with group:
            _, y, _, g = run(ws, L)
        outs.append((y, g))
    y0, g0 = outs[0]
    for y, g in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(y, y0))
        for key in g0:
            assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(g[key], g0[key])), key


def test_turned_transfers_bitwise():
    """Every transfer direction turned around (the cpu backend runs them all) gives the defaults'
    bits, with several macrobatches and a rank with no tokens."""
    L = make_layer(3, [60, 0, 70], E=6, k=2, Is=64, seed=23)
    base = CONFIG.replace(minibatch_rows=128, ring_rows=256)
    turned = base.replace(fwd_dispatch="push", fwd_combine="pull", bwd_combine="push", bwd_dispatch="pull")
    outs = []
    for config in (base, turned):
        group, ws = workspace(L, config=config)
        with group:
            _, y, _, g = run(ws, L)
        outs.append((y, g))
    (y0, g0), (y1, g1) = outs
    assert all(np.array_equal(a, b) for a, b in zip(y1, y0))
    for key in g0:
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(g1[key], g0[key])), key


def test_accumulate_adds_into_fp32_grads():
    L = make_layer(2, [40, 35], E=8, k=2, Is=64, seed=31, even_only=True)
    rng = np.random.default_rng([SEED, 2])
    group, ws = workspace(L)
    with group:
        E, I, H, Is = ws.num_local_experts, 64, 128, 64
        shapes = {"dw_gate": (E, I, H), "dw_up": (E, I, H), "dw_down": (E, H, I),
                  "ds_gate": (Is, H), "ds_up": (Is, H), "ds_down": (H, Is)}
        start = {k: [rng.uniform(-1, 1, s).astype(np.float32) for _ in range(2)] for k, s in shapes.items()}
        grads = {k: [a.copy() for a in v] for k, v in start.items()}
        _, y, _, g = run(ws, L, accumulate=True, grads=grads)
        for key in shapes:
            assert all(a is b for a, b in zip(g[key], grads[key])), "updated in place"
            assert all(a.dtype == np.float32 for a in g[key])
        y_ref, g_ref = reference(L)
        check_against_reference(L, y, g, y_ref, g_ref, start=start)
        # odd experts received no rows: their buffers are untouched
        for p in range(2):
            for key in ("dw_gate", "dw_up", "dw_down"):
                assert np.array_equal(g[key][p][1::2], start[key][p][1::2])
        # without grads, accumulate mode starts from zeros and returns fp32
        _, _, _, g2 = run(ws, L, accumulate=True)
        assert g2["dw_up"][0].dtype == np.float32
        assert rel_err(g2["dw_up"][0], g_ref["dw_up"][0]) <= TOL["grads"]


def test_recompute_context_equals_forward_context():
    L = make_layer(3, [60, 45, 80], E=6, k=2, Is=64, seed=41)
    group, ws = workspace(L, config=CONFIG.replace(context_rows=128))
    with group:
        schedules, y, contexts, g = run(ws, L)
        other = make_layer(3, [41, 77, 38], E=6, k=2, Is=64, seed=42)
        run(ws, other)  # the workspace serves another call in between
        again = mok.recompute_forward_context(ws, schedules, L["x"], L["router_w"], L["w_gate"], L["w_up"],
                                              L["s_gate"], L["s_up"])
        for a, b in zip(contexts, again):
            assert a.to_bytes() == b.to_bytes()
        g2 = mok.backward(ws, schedules, again, L["dy"], L["x"], L["router_w"], *weights(L))
        for key in g:
            assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(g[key], g2[key])), key


def poison_unwritten(ws, contexts, context_rows):
    """Sets every byte of each context outside what the forward writes to 0xff (NaN as bf16):
    its tag (the first CONTEXT_TAG_BYTES, which the backward checks) and Context.to_bytes()'s
    ranges are kept. numpy or torch buffers."""
    for c in contexts:
        kept = c.to_bytes()
        b = c.buffer if isinstance(c.buffer, np.ndarray) else c.buffer.detach().cpu().numpy()
        tag = b.view(np.uint8)[:mok.CONTEXT_TAG_BYTES].copy()
        assert tag.any()  # the forward wrote it
        cap = ws.sizes.max_routed_rows
        if 0 < context_rows < cap:
            cap = -(-context_rows // mok.ROW_TILE) * mok.ROW_TILE
        routed = min(c.schedule.info().padded_rows, cap) * 4 * ws.intermediate
        routed_at = mok.CONTEXT_TAG_BYTES
        shared_at = routed_at + -(-cap * 4 * ws.intermediate // 256) * 256
        poison = np.full(c.buffer.shape[0], 0xFF, np.uint8)
        poison[:routed_at] = tag
        poison[routed_at:routed_at + routed] = np.frombuffer(kept[:routed], np.uint8)
        poison[shared_at:shared_at + len(kept) - routed] = np.frombuffer(kept[routed:], np.uint8)
        if isinstance(c.buffer, np.ndarray):
            c.buffer.view(np.uint8)[:] = poison
        else:
            import torch
            c.buffer.copy_(torch.from_numpy(poison))
        assert c.to_bytes() == kept


def check_context_bytes(ws, L, context_rows):
    """The binding does not clear a context buffer: the backward after poison_unwritten gives every
    gradient the same bits. The backward reads the tag too: with it poisoned as well, it refuses
    the context (on cuda at the next call, here mok_synchronize)."""
    schedules = mok.build_schedule(ws, L["topk_ids"])
    _, contexts = mok.forward(ws, schedules, L["x"], L["router_w"], *weights(L))
    clean = mok.backward(ws, schedules, contexts, L["dy"], L["x"], L["router_w"], *weights(L))
    poison_unwritten(ws, contexts, context_rows)
    dirty = mok.backward(ws, schedules, contexts, L["dy"], L["x"], L["router_w"], *weights(L))
    ws.synchronize()
    contexts[0].buffer[:mok.CONTEXT_TAG_BYTES] = 0xFF
    with pytest.raises(mok.InvalidArgumentError, match=r"args\[0\]\.context: holds no context tag"):
        mok.backward(ws, schedules, contexts, L["dy"], L["x"], L["router_w"], *weights(L))
        ws.synchronize()
    return clean, dirty


def test_backward_reads_only_the_context_bytes_the_forward_writes():
    L = make_layer(2, [70, 33], E=4, k=2, Is=64, seed=43)
    for context_rows in (0, 128):
        group, ws = workspace(L, config=CONFIG.replace(context_rows=context_rows))
        with group:
            clean, dirty = check_context_bytes(ws, L, context_rows)
        for key in clean:
            assert all((a is None and b is None) or np.array_equal(a, b)
                       for a, b in zip(clean[key], dirty[key])), (context_rows, key)


# ---- torch -----------------------------------------------------------------------------------------------


def test_without_torch():
    """mok and mok.torch import where torch cannot; MoE then says so."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mok, mok.torch\n"
            "try:\n    mok.torch.MoE\nexcept ImportError:\n    print('no torch')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"


def test_cuda_backend_refuses_numpy():
    fake = types.SimpleNamespace(backend="cuda", group=types.SimpleNamespace(devices=[0]))
    with pytest.raises(ValueError, match="use torch tensors for cuda"):
        functional._Call(fake, "forward").check(np.zeros((4, 128), np.uint16), "x[0]", "bf16", (4, 128), 0)


def _torch():
    return pytest.importorskip("torch")


def _cuda(n=1):
    """torch, when n GPUs and a CUDA build of libmok are there; else the test is skipped."""
    torch = _torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() < n or mok.device_count("cuda") < n:
        pytest.skip(f"needs {n} GPU(s) and a CUDA build of libmok")
    return torch


def to_torch(torch, a, device="cpu"):
    """numpy (np.uint16 = bf16) -> a tensor on device; lists element-wise, None stays None."""
    if a is None:
        return None
    if isinstance(a, list):
        return [to_torch(torch, v, device) for v in a]
    bf16 = a.dtype == np.uint16
    tensor = torch.from_numpy(a.view(np.int16) if bf16 else a)
    return (tensor.view(torch.bfloat16) if bf16 else tensor).to(device)


def to_numpy(torch, t):
    """A tensor -> numpy (bf16 as np.uint16); lists and dicts element-wise."""
    if t is None:
        return None
    if isinstance(t, list):
        return [to_numpy(torch, v) for v in t]
    if isinstance(t, dict):
        return {key: to_numpy(torch, v) for key, v in t.items()}
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def torch_layer(torch, L, devices):
    """L with every array as a tensor on its rank's device (the shared expert copied to each)."""
    T = dict(L)
    for key in ("x", "dy", "topk_ids", "router_w", "w_gate", "w_up", "w_down"):
        T[key] = [to_torch(torch, a, devices[p]) for p, a in enumerate(L[key])]
    for key in ("s_gate", "s_up", "s_down"):
        T[key] = None if L[key] is None else [to_torch(torch, L[key], d) for d in devices]
    return T


def test_functional_with_torch_tensors_equals_numpy():
    torch = _torch()
    L = make_layer(2, [30, 25], E=4, k=2, Is=64, seed=51)
    group, ws = workspace(L)
    with group:
        _, y, _, g = run(ws, L)
        T = torch_layer(torch, L, ["cpu", "cpu"])
        _, yt, _, gt = run(ws, T)
        assert yt[0].dtype == torch.bfloat16 and gt["d_router_w"][1].dtype == torch.float32
        for p in range(2):
            assert np.array_equal(to_numpy(torch, yt[p]), y[p])
            for key in g:
                assert np.array_equal(to_numpy(torch, gt[key][p]), g[key][p]), key
        y_ref = mok.reference_forward(T["x"], T["topk_ids"], T["router_w"], T["w_gate"], T["w_up"], T["w_down"],
                                      L["s_gate"], L["s_up"], L["s_down"])
        assert all(np.array_equal(a, b) for a, b in zip(y_ref, reference(L)[0]))
        with pytest.raises(ValueError, match="one kind"):
            mok.forward(ws, mok.build_schedule(ws, L["topk_ids"]), T["x"], L["router_w"], *weights(L))


def _torch_moe(torch, m, x):
    """The same layer in float32 PyTorch, from m's weights (float copies that collect gradients)."""
    F = torch.nn.functional
    params = {name: p.detach().float().clone().requires_grad_(True) for name, p in m.named_parameters()}
    xin = x.detach().clone().requires_grad_(True)
    xf = xin.to(torch.bfloat16).float()  # the experts see bf16 x; the router sees x itself, as in MoE
    logits = F.linear(xin.to(m.router.weight.dtype), params["router.weight"])
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, m.topk, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)

    def ffn(v, gate, up, down):
        return F.linear(F.silu(F.linear(v, gate)) * F.linear(v, up), down)

    y = torch.zeros_like(xf)
    if m.shared_intermediate:
        y = y + ffn(xf, params["s_gate"], params["s_up"], params["s_down"])
    for j in range(m.topk):
        for e in range(m.num_experts):
            rows = (ids[:, j] == e).nonzero().flatten()
            if len(rows):
                out = ffn(xf[rows], params["w_gate"][e], params["w_up"][e], params["w_down"][e])
                y = y.index_add(0, rows, w[rows, j:j + 1] * out)
    return xin, params, y


def _check_moe(torch, m, x):
    """m(x) forward and backward against _torch_moe, within TOL."""
    y = m(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    H = m.hidden
    xin, params, y_ref = _torch_moe(torch, m, x.reshape(-1, H))
    (y_ref * dy.reshape(-1, H)).sum().backward()

    def err(got, ref):
        got, ref = got.detach().float(), ref.detach().float()
        return float((got - ref).abs().max() / ref.abs().max())

    assert err(y.reshape(-1, H), y_ref) <= TOL["y"]
    assert err(x.grad.reshape(-1, H), xin.grad) <= TOL["dx"]
    assert err(m.router.weight.grad, params["router.weight"].grad) <= TOL["d_router_w"]
    for name in ("w_gate", "w_up", "w_down") + (("s_gate", "s_up", "s_down") if m.shared_intermediate else ()):
        p = getattr(m, name)
        assert p.grad is not None and p.grad.dtype == torch.bfloat16
        assert err(p.grad, params[name].grad) <= TOL["grads"], name


@pytest.mark.parametrize("shared", [64, 0])
def test_torch_moe_matches_float32_pytorch(shared):
    torch = _torch()
    torch.manual_seed(SEED)
    import mok.torch as mt
    m = mt.MoE(128, 64, 8, 2, shared_intermediate=shared, max_tokens=96, config=CONFIG, backend="cpu")
    x = torch.randn(2, 48, 128, requires_grad=True)
    _check_moe(torch, m, x)
    # a second step accumulates into .grad as autograd does
    before = m.w_up.grad.clone()
    m(x).sum().backward()
    assert not torch.equal(before, m.w_up.grad)


def test_torch_moe_rejects_too_many_tokens():
    torch = _torch()
    import mok.torch as mt
    m = mt.MoE(128, 64, 4, 2, max_tokens=16, config=CONFIG, backend="cpu")
    with pytest.raises(mok.MokError, match="max_tokens = 16"):
        m(torch.randn(17, 128))
    with pytest.raises(ValueError, match="hidden size"):
        m(torch.randn(4, 64))


# ---- cuda (skipped without a GPU and a CUDA build) -------------------------------------------------------

# Small rings for the GPU too, so that several macrobatches and replay run.
CUDA_CONFIG = mok.Config(minibatch_rows=128, ring_rows=256)


@pytest.mark.parametrize("P", [1, 2])
def test_cuda_functional_matches_reference(P):
    torch = _cuda(P)
    L = make_layer(P, [300, 211][:P], H=256, I=128, E=4 * P, k=2, Is=128, seed=60 + P, holes=True, signed=True)
    devices = [torch.device("cuda", p) for p in range(P)]
    group = mok.Group.create_local(P, backend="cuda", devices=list(range(P)), config=CUDA_CONFIG)
    with group:
        assert group.backend == "cuda" and group.devices == list(range(P))
        ws = mok.Workspace(group, 256, 128, 4 * P, 2, 128, max_tokens=300)
        T = torch_layer(torch, L, devices)
        with pytest.raises(ValueError, match="use torch tensors for cuda"):
            mok.build_schedule(ws, L["topk_ids"])
        schedules, y, contexts, g = run(ws, T)
        assert y[P - 1].device == devices[P - 1] and contexts[0].buffer.device == devices[0]
        y_np, g_np = to_numpy(torch, y), to_numpy(torch, g)
        y_ref, g_ref = reference(L)
        check_against_reference(L, y_np, g_np, y_ref, g_ref)
        # bitwise: a second run, and the recomputed context
        _, y2, _, g2 = run(ws, T)
        assert all(np.array_equal(a, b) for a, b in zip(to_numpy(torch, y2), y_np))
        for key in g_np:
            assert all((a is None and b is None) or np.array_equal(a, b)
                       for a, b in zip(to_numpy(torch, g2[key]), g_np[key])), key
        again = mok.recompute_forward_context(ws, schedules, T["x"], T["router_w"], T["w_gate"], T["w_up"],
                                              T["s_gate"], T["s_up"])
        assert all(a.to_bytes() == b.to_bytes() for a, b in zip(contexts, again))
        # accumulate into fp32 tensors on the GPU
        start = {key: [torch.rand(w.shape, device=w.device) for w in T[key.replace("d", "", 1)]]
                 for key in ("dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down")}
        grads = {key: [t.clone() for t in v] for key, v in start.items()}
        _, _, _, g3 = run(ws, T, accumulate=True, grads=grads)
        assert g3["dw_down"][0] is grads["dw_down"][0]
        check_against_reference(L, y_np, to_numpy(torch, g3), y_ref, g_ref, start=to_numpy(torch, start))


def test_cuda_backward_reads_only_the_context_bytes_the_forward_writes():
    torch = _cuda(1)
    L = make_layer(1, [300], H=256, I=128, E=4, k=2, Is=128, seed=71, holes=True, signed=True)
    for context_rows in (0, 128):
        config = CUDA_CONFIG.replace(context_rows=context_rows)
        group = mok.Group.create_local(1, backend="cuda", devices=[0], config=config)
        with group:
            ws = mok.Workspace(group, 256, 128, 4, 2, 128, max_tokens=300)
            clean, dirty = check_context_bytes(ws, torch_layer(torch, L, [torch.device("cuda", 0)]), context_rows)
            clean, dirty = to_numpy(torch, clean), to_numpy(torch, dirty)
        for key in clean:
            assert all((a is None and b is None) or np.array_equal(a, b)
                       for a, b in zip(clean[key], dirty[key])), (context_rows, key)


@pytest.mark.parametrize("P", [1, 2])
def test_cuda_turned_transfers_bitwise(P):
    """Every transfer turned around on the GPUs gives the defaults' bits (several macrobatches, a
    rank with no tokens at P = 2)."""
    torch = _cuda(P)
    L = make_layer(P, [300, 0][:P], H=256, I=128, E=4 * P, k=2, Is=128, seed=70 + P, holes=True, signed=True)
    devices = [torch.device("cuda", p) for p in range(P)]
    turned = CUDA_CONFIG.replace(fwd_dispatch="push", fwd_combine="pull", bwd_combine="push", bwd_dispatch="pull")
    outs = []
    for config in (CUDA_CONFIG, turned):
        group = mok.Group.create_local(P, backend="cuda", devices=list(range(P)), config=config)
        with group:
            ws = mok.Workspace(group, 256, 128, 4 * P, 2, 128, max_tokens=300)
            _, y, _, g = run(ws, torch_layer(torch, L, devices))
            outs.append((to_numpy(torch, y), to_numpy(torch, g)))
    (y0, g0), (y1, g1) = outs
    assert all(np.array_equal(a, b) for a, b in zip(y1, y0))
    for key in g0:
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(g1[key], g0[key])), key


@pytest.mark.parametrize("shared", [128, 0])
def test_cuda_torch_moe_matches_float32_pytorch(shared):
    torch = _cuda(1)
    torch.manual_seed(SEED)
    import mok.torch as mt
    m = mt.MoE(256, 128, 8, 2, shared_intermediate=shared, max_tokens=512, config=CUDA_CONFIG, device="cuda")
    x = torch.randn(4, 100, 256, device="cuda", requires_grad=True)
    _check_moe(torch, m, x)
    assert m.mok_workspace(x.device).backend == "cuda"


def test_cuda_graph_capture_replay_moe():
    """mok.torch.MoE forward + backward captured once in a CUDA graph (torch.cuda.graph), replayed
    with fresh inputs copied into the static ones, against an eager run on those inputs. The graph
    holds the router (PyTorch), mok's schedule, forward and backward; the fresh inputs route
    differently, so the replayed schedule is new too (built on the device, no host sync inside).
    mok is deterministic, so y and the experts' gradients (mok's alone, from the same ids, router
    weights and dy) must match bit for bit. x.grad and router.weight.grad also carry the router's
    backward in PyTorch (cuBLAS GEMMs, issued on the capture stream in one run and the default stream
    in the other), whose bits this test does not pin down: those two are held to TOL."""
    torch = _cuda(1)
    torch.manual_seed(SEED)
    import mok.torch as mt
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    H, T = 256, 300
    m = mt.MoE(H, 128, 8, 2, shared_intermediate=128, max_tokens=512, config=CUDA_CONFIG, device=dev)
    static_x = torch.randn(T, H, device=dev).to(torch.bfloat16).requires_grad_(True)
    static_dy = torch.randn(T, H, device=dev).to(torch.bfloat16)

    def clear_grads():
        m.zero_grad(set_to_none=True)
        static_x.grad = None

    # Warm up on a side stream (PyTorch's recipe for capturing autograd); this also makes the workspace,
    # which must exist before the capture.
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            clear_grads()
            m(static_x).backward(static_dy)
    torch.cuda.current_stream(dev).wait_stream(side)
    clear_grads()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = m(static_x)
        static_y.backward(static_dy)
    # the graph's outputs: y and the gradients that the captured backward assigned
    static = {"y": static_y, "x": static_x.grad, **{name: p.grad for name, p in m.named_parameters()}}
    assert all(v is not None for v in static.values()), [k for k, v in static.items() if v is None]
    for _ in range(2):  # replays on the capture's inputs must leave the workspace fit for more
        graph.replay()
    fresh_x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    fresh_dy = torch.randn(T, H, device=dev).to(torch.bfloat16)
    with torch.no_grad():
        static_x.copy_(fresh_x)
        static_dy.copy_(fresh_dy)
    graph.replay()
    torch.cuda.synchronize(dev)
    m.mok_workspace(dev).synchronize()  # raises what the kernels recorded, if anything
    replayed = {key: v.detach().clone() for key, v in static.items()}

    clear_grads()
    x = fresh_x.clone().requires_grad_(True)
    y = m(x)
    y.backward(fresh_dy)
    torch.cuda.synchronize(dev)
    eager = {"y": y.detach(), "x": x.grad, **{name: p.grad for name, p in m.named_parameters()}}

    for key, want in eager.items():
        got = replayed[key]
        assert got.shape == want.shape and got.dtype == want.dtype, key
        if key in ("x", "router.weight"):
            scale = float(want.float().abs().max())
            err = float((got.float() - want.float()).abs().max()) / max(scale, 1e-30)
            assert err <= TOL["dx" if key == "x" else "d_router_w"], f"{key}: replay vs eager error {err:.3g}"
        else:
            differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
            assert differ == 0, f"{key}: {differ} of {want.numel()} elements differ between the replay and eager"


def test_cuda_trace_events(tmp_path):
    """Config(trace=True) on a GPU: one forward, Workspace.trace_write, and bench/timeline.py's load
    reads the file: compute events for gateup and down, no negative duration, one residency event
    per SM, and every task inside the residency of the CTA that ran it (a CTA's "resident" event
    spans the kernel on that CTA, from its start to its end)."""
    torch = _cuda(1)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    import timeline

    L = make_layer(1, [600], H=256, I=128, E=8, k=4, Is=128, seed=70)
    dev = torch.device("cuda", 0)
    config = CUDA_CONFIG.replace(trace=True)
    group = mok.Group.create_local(1, backend="cuda", devices=[0], config=config)
    with group:
        ws = mok.Workspace(group, 256, 128, 8, 4, 128, max_tokens=600)
        T = torch_layer(torch, L, [dev])
        schedules = mok.build_schedule(ws, T["topk_ids"][0])
        mok.forward(ws, schedules, T["x"][0], T["router_w"][0], T["w_gate"][0], T["w_up"][0], T["w_down"][0],
                    T["s_gate"][0], T["s_up"][0], T["s_down"][0])
        ws.synchronize()
        path = str(tmp_path / "forward.json")
        ws.trace_write(path)
    tasks, resident = timeline.load(path), timeline.load(path, resident=True)
    kinds = {(e["name"], e["cat"]) for e in tasks}
    assert ("gateup", "compute") in kinds and ("down", "compute") in kinds, sorted(kinds)
    negative = [e for e in tasks + resident if not e["dur"] >= 0]
    assert not negative, negative[:3]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert len(resident) == sms, f"{len(resident)} residency events for a kernel on {sms} SMs"
    span = {(e["pid"], e["tid"]): (e["ts"], e["ts"] + e["dur"]) for e in resident}
    assert len(span) == sms, "two residency events for one CTA"
    eps = 1e-3  # us: the file's resolution (times are whole ns written with 3 decimals of us)
    outside = [e for e in tasks if (e["pid"], e["tid"]) not in span
               or e["ts"] < span[(e["pid"], e["tid"])][0] - eps
               or e["ts"] + e["dur"] > span[(e["pid"], e["tid"])][1] + eps]
    assert not outside, f"{len(outside)} of {len(tasks)} tasks outside their CTA's residency, e.g. {outside[:2]}"


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_trace_keeps_the_last_forward_and_backward(tmp_path, backend):
    """Config(trace=True), a forward and a backward, then Workspace.trace_write: the file holds both
    passes, the backward's tasks after the forward's on one time axis, each (rank, pass) a process
    named "rank R forward" / "rank R backward" and each worker a thread named "comm worker W" or
    "compute worker W"; bench/timeline.py's load(pass_name=...) gives one pass with pid = rank. On
    cuda each pass also has one residency event per SM."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    import timeline

    if backend == "cuda":
        torch = _cuda(1)
        L = make_layer(1, [600], H=256, I=128, E=8, k=4, Is=128, seed=72)
        config = CUDA_CONFIG.replace(trace=True)
        group = mok.Group.create_local(1, backend="cuda", devices=[0], config=config)
        arrays = torch_layer(torch, L, [torch.device("cuda", 0)])
    else:
        L = make_layer(2, [150, 97], E=6, k=2, Is=64, seed=72)
        config = CONFIG.replace(trace=True)
        group = mok.Group.create_local(2, backend="cpu", config=config)
        arrays = L
    path = str(tmp_path / "trace.json")
    with group:
        _, ws = workspace(L, group=group, config=config)
        with ws:
            run(ws, arrays)
            ws.synchronize()
            ws.trace_write(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] != "resident"]
    forward_kinds = {"dispatch", "gateup", "down", "combine", "shared_up", "shared_down"}
    for rank in range(L["P"]):
        assert names.get((rank, None)) == f"rank {rank} forward", names
        assert names.get((72 + rank, None)) == f"rank {rank} backward", names
    for e in tasks:
        backward = e["args"]["pass"] == "backward"
        assert e["pid"] == e["args"]["rank"] + (72 if backward else 0), e
        assert (e["name"] in forward_kinds) != backward, e
        assert names.get((e["pid"], e["tid"])) == f"{e['cat']} worker {e['tid']}", e
    forward, backward = timeline.load(path, pass_name="forward"), timeline.load(path, pass_name="backward")
    assert forward and backward and len(forward) + len(backward) == len(tasks)
    assert {e["pid"] for e in forward} == {e["pid"] for e in backward} == set(range(L["P"]))
    assert max(e["ts"] + e["dur"] for e in forward) <= min(e["ts"] for e in backward)
    if backend == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for name in ("forward", "backward"):
            assert len(timeline.load(path, resident=True, pass_name=name)) == sms, name


_EP_WORKER = r"""
import os, sys
import torch, torch.distributed as dist
import mok, mok.torch
sys.path.insert(0, os.environ["MOK_TEST_DIR"])
import test_binding as tb

rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", rank=rank, world_size=P, device_id=device)
H, I, E, k, Is, T = 256, 128, 8, 2, 128, [150, 97]
torch.manual_seed(1234)  # the same router, shared expert and full expert set on every rank
m = mok.torch.MoE(H, I, E, k, shared_intermediate=Is, group=dist.group.WORLD, max_tokens=256,
                  config=tb.CUDA_CONFIG, device=device)
full = mok.torch.MoE(H, I, E, k, shared_intermediate=Is, max_tokens=256, device=device)  # weights only
with torch.no_grad():
    m.router.weight.copy_(full.router.weight)
    for name in ("s_gate", "s_up", "s_down"):
        getattr(m, name).copy_(getattr(full, name))
    El = E // P
    for name in ("w_gate", "w_up", "w_down"):
        getattr(m, name).copy_(getattr(full, name)[rank * El:(rank + 1) * El])
xs = [torch.randn(T[p], H, generator=torch.Generator().manual_seed(p)).to(device) for p in range(P)]
dys = [torch.randn(T[p], H, generator=torch.Generator().manual_seed(100 + p)).to(device) for p in range(P)]
x = xs[rank].clone().requires_grad_(True)
y = m(x)
(y * dys[rank]).sum().backward()

# The reference: every rank's tokens through the full layer in float32; the routed experts' gradients
# sum over all ranks' tokens, everything else is this rank's own.
ref = {}
for p in range(P):
    xin, params, y_ref = tb._torch_moe(torch, full, xs[p])
    (y_ref * dys[p]).sum().backward()
    ref[p] = (xin, params, y_ref)
def err(got, want):
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max())
xin, params, y_ref = ref[rank]
errors = {"y": err(y, y_ref), "dx": err(x.grad, xin.grad), "router": err(m.router.weight.grad, params["router.weight"].grad)}
for name in ("s_gate", "s_up", "s_down"):
    errors[name] = err(getattr(m, name).grad, params[name].grad)
for name in ("w_gate", "w_up", "w_down"):
    want = sum(ref[p][1][name].grad for p in range(P))[rank * El:(rank + 1) * El]
    errors[name] = err(getattr(m, name).grad, want)
limits = {"y": tb.TOL["y"], "dx": tb.TOL["dx"], "router": tb.TOL["d_router_w"]}
bad = {key: v for key, v in errors.items() if not v <= limits.get(key, tb.TOL["grads"])}
print(f"rank {rank}: " + ", ".join(f"{key} {v:.2e}" for key, v in errors.items()), flush=True)
dist.barrier()
for ws in list(mok.torch._workspaces.values()):
    ws.close()  # collective: every rank closes its workspace, then its group
for group in list(mok.torch._groups.values()):
    group.close()
dist.destroy_process_group()
sys.exit(1 if bad else 0)
"""


def test_cuda_torch_moe_expert_parallel_over_torch_distributed():
    """Two processes, one GPU each: mok.torch.MoE over a torch.distributed NCCL group (the unique id
    travels by broadcast_object_list) against the full layer in float32 PyTorch."""
    _cuda(2)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + SEED % 1000), WORLD_SIZE="2",
               MOK_TEST_DIR=here, MOK_PY_SEED=str(SEED))
    procs = [subprocess.Popen([sys.executable, "-c", _EP_WORKER], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    print("\n".join(outs))
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
