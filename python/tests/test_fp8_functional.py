"""test_fp8_functional.py — FP8 through the Python binding on the cpu backend (include/mok.h, FP8):
Workspace(precision="fp8"), quantize_weights and its FP8Weights (the layout read back and checked
against a quantization written here in numpy), forward / backward / recompute_forward_context with
fp8_weights= against the library's FP8 reference for 1 to 3 ranks (empty slots, router weights
<= 0, uneven and zero tokens, several macrobatches), that the function computed is the FP8 one and
not the bf16 one, determinism, accumulate mode, torch tensors, every refusal of a missing or
mismatched fp8_weights, and bf16 unchanged beside it. Random inputs are fresh per run; the seed is
printed (MOK_PY_SEED=N replays a run).
"""
import os

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
    print(f"MOK_PY_SEED={SEED}")


# Tolerances against the FP8 reference: max |got - ref| / max |ref| per array (d_router_w over all
# ranks at once, its dots cancelling to small values on a rank of few tokens). tests/layer.c's FP8
# table says why each value (both sides quantize the same bf16 values; what is left is a bf16
# rounding that flips, now and then crossing an E4M3 boundary) and what it measured.
TOL = {"y": 1.5e-2, "dx": 2e-2, "d_router_w": 1e-2, "grads": 1e-2}

# Small buffers, so that a few hundred routed rows span several macrobatches.
CONFIG = mok.Config(cpu_threads=2, minibatch_rows=128, ring_rows=256)
GRAD_KEYS = ("dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down")


def make_layer(P, tokens, H=256, I=128, E=6, k=2, Is=128, seed=0, holes=False, signed=False):
    """A random layer of random_layer.make_layer (router weights uniform in [0.1, 1)) from this run's seed."""
    return random_layer.make_layer(SEED, P, tokens, H, I, E, k, Is, seed, holes=holes, signed=signed, router="uniform")


def workspace(L, precision="fp8", config=CONFIG):
    group = mok.Group.create_local(L["P"], backend="cpu", config=config)
    ws = mok.Workspace(group, L["H"], L["I"], L["E"], L["k"], L["Is"], max_tokens=max(max(L["tokens"]), 1),
                       config=config, precision=precision)
    return group, ws


def run(ws, L, fp8, accumulate=False, grads=None):
    schedules = mok.build_schedule(ws, L["topk_ids"])
    y, contexts = mok.forward(ws, schedules, L["x"], L["router_w"], *weights(L), fp8_weights=fp8)
    g = mok.backward(ws, schedules, contexts, L["dy"], L["x"], L["router_w"], *weights(L), accumulate=accumulate,
                     grads=grads, fp8_weights=fp8)
    return schedules, y, contexts, g


def reference(L, precision="fp8"):
    args = (L["x"], L["topk_ids"], L["router_w"], *weights(L))
    return (mok.reference_forward(*args, precision=precision),
            mok.reference_backward(L["dy"], *args, precision=precision))


def as_f32(a):
    return f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)


def rel_err(got, ref):
    got, ref = as_f32(got), as_f32(ref)
    assert got.shape == ref.shape
    if ref.size == 0:
        return 0.0
    assert np.isfinite(got).all(), "non-finite values in the result"
    return float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), 1e-30)


def check_against_reference(L, y, g, y_ref, g_ref, start=None):
    for p in range(L["P"]):
        assert rel_err(y[p], y_ref[p]) <= TOL["y"], f"y rank {p}"
        assert rel_err(g["dx"][p], g_ref["dx"][p]) <= TOL["dx"], f"dx rank {p}"
        for key in GRAD_KEYS:
            if g_ref[key][p] is None:
                assert g[key][p] is None
                continue
            got = as_f32(g[key][p]) - (start[key][p] if start else 0)
            assert rel_err(got, g_ref[key][p]) <= TOL["grads"], f"{key} rank {p}"
    got = np.concatenate([g["d_router_w"][p].ravel() for p in range(L["P"])])
    ref = np.concatenate([g_ref["d_router_w"][p].ravel() for p in range(L["P"])])
    finite = np.isfinite(ref)  # the NaN weights of empty slots give NaN in neither; both are 0 there
    assert rel_err(got[finite], ref[finite]) <= TOL["d_router_w"], "d_router_w"


# ---- the FP8 weights: layout and quantization ----------------------------------------------------------

def e4m3_values():
    """The value of every E4M3 code, from the library's decoder (its own tests check it bit by bit)."""
    return np.array([_lib.lib.mok_e4m3_to_float(c) for c in range(256)], dtype=np.float64)


def quantize_blocks(w, block_rows):
    """mok.h's Q written in numpy, on a bf16 matrix [rows, cols] (as fp32 values): blocks of
    block_rows x 128, scale 2^e with e the smallest >= -124 for which max|v| <= 448 * 2^e (0 for an
    all-zero block), each value rounded to E4M3 (nearest, ties to even) at that scale. Returns the
    dequantized values and the scales [rows / block_rows, cols / 128]."""
    rows, cols = w.shape
    out = np.empty_like(w, dtype=np.float64)
    scales = np.empty((rows // block_rows, cols // 128))
    for bi in range(rows // block_rows):
        for bj in range(cols // 128):
            block = (slice(bi * block_rows, (bi + 1) * block_rows), slice(bj * 128, (bj + 1) * 128))
            v = w[block].astype(np.float64)
            amax = np.abs(v).max()
            e = 0
            if amax > 0:
                e = max(int(np.ceil(np.log2(amax / 448.0))), -124)
                while amax > 448.0 * 2.0 ** e:
                    e += 1
                while e > -124 and amax <= 448.0 * 2.0 ** (e - 1):
                    e -= 1
            u = v / 2.0 ** e
            binade = np.floor(np.log2(np.maximum(np.abs(u), 2.0 ** -6)))  # subnormals share 2^-6's quantum
            quantum = 2.0 ** (binade - 3)
            out[block] = np.round(u / quantum) * quantum * 2.0 ** e
            scales[bi, bj] = 2.0 ** e
    return out, scales


def test_fp8_weights_hold_the_quantized_weights_in_both_orientations():
    L = make_layer(2, [8, 8], H=256, I=256, E=4, Is=128, seed=1)
    # a block spanning a wide range: one large value among small ones, and a block of zeros
    L["w_gate"][0][0, :128, :128] = bf(np.random.default_rng([SEED, 2]).uniform(-1, 1, (128, 128)) * 1e-3)
    L["w_gate"][0][0, 5, 7] = bf(np.array([300.0]))[0]
    L["w_up"][1][1, 128:, 128:] = 0
    group, ws = workspace(L)
    with group, ws:
        assert ws.fp8_layout.bytes > 0 and set(ws.fp8_layout.codes) == {m.name.lower() for m in _lib.FP8Matrix}
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        again = mok.functional.quantize_weights(ws, *weights(L))
        table = e4m3_values()
        for r in range(2):
            assert fp8[r].local_rank == r and fp8[r].nbytes == ws.fp8_layout.bytes
            assert np.array_equal(fp8[r].buffer, again[r].buffer), "quantize_weights is not deterministic"
            mats = {"w_gate": L["w_gate"][r], "w_up": L["w_up"][r], "w_down": L["w_down"][r],
                    "s_gate": L["s_gate"][None], "s_up": L["s_up"][None], "s_down": L["s_down"][None]}
            for name, w in mats.items():
                codes, scales = fp8[r].codes(name), fp8[r].scales(name)
                codes_t, scales_t = fp8[r].codes(name + "_t"), fp8[r].scales(name + "_t")
                if name.startswith("s"):
                    codes, scales, codes_t, scales_t = codes[None], scales[None], codes_t[None], scales_t[None]
                assert codes.shape == w.shape and codes_t.shape == w.shape[:1] + w.shape[:0:-1], name
                for e in range(w.shape[0]):
                    want, want_scales = quantize_blocks(f32(w[e]), 128)
                    got = table[codes[e]] * np.kron(scales[e], np.ones((128, 128)))
                    assert np.array_equal(scales[e], want_scales), f"{name} rank {r} expert {e}: scales"
                    assert np.array_equal(got, want), f"{name} rank {r} expert {e}: values"
                    assert np.array_equal(codes_t[e], codes[e].T) and np.array_equal(scales_t[e], scales[e].T), \
                        f"{name}_t rank {r} expert {e}: not the transposed copy"
        assert fp8[0].scales("w_gate")[0, 0, 0] == 1.0  # 300 fits 448 at scale 1
        assert fp8[1].scales("w_up")[1, 1, 1] == 1.0    # the zero block's scale


def test_quantize_weights_bare_and_without_shared_expert():
    L = make_layer(1, [16], Is=0, seed=3)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, L["w_gate"][0], L["w_up"][0], L["w_down"][0])
        assert isinstance(fp8, mok.functional.FP8Weights)  # bare in, bare out
        assert fp8.codes("s_gate").shape == (0, 256) and fp8.scales("s_down_t").shape == (0, 2)
        with pytest.raises(ValueError, match="is not one of the FP8 matrices"):
            fp8.codes("w_sideways")


# ---- the passes against the FP8 reference ----------------------------------------------------------------

@pytest.mark.parametrize("P,tokens,Is,holes,signed", [
    (1, [150], 128, False, False),
    (2, [90, 0], 0, True, False),
    (2, [200, 130], 128, False, True),
    (3, [70, 1, 160], 128, True, True),
])
def test_forward_backward_match_the_fp8_reference(P, tokens, Is, holes, signed):
    L = make_layer(P, tokens, E=6, Is=Is, seed=10 + P, holes=holes, signed=signed)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        _, y, _, g = run(ws, L, fp8)
    y_ref, g_ref = reference(L)
    check_against_reference(L, y, g, y_ref, g_ref)


def mean_err(got, ref):
    got, ref = as_f32(got), as_f32(ref)
    return float(np.abs(got - ref).mean()) / float(np.abs(ref).mean())


def test_the_function_is_fp8_not_bf16():
    """Every output sits far closer to the FP8 reference than to the bf16 one: the FP8 function is
    what ran (a missing quantization point lands in between, tests/layer.c)."""
    L = make_layer(2, [120, 100], seed=20)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        _, y, _, g = run(ws, L, fp8)
    y8, g8 = reference(L, "fp8")
    y16, g16 = reference(L, "bf16")
    for p in range(2):
        pairs = [("y", y[p], y8[p], y16[p])] + [(k, g[k][p], g8[k][p], g16[k][p]) for k in ("dx", "dw_down", "ds_up")]
        for name, got, near, far in pairs:
            assert 20 * mean_err(got, near) < mean_err(got, far), (name, p, mean_err(got, near), mean_err(got, far))


def test_deterministic_recompute_and_stale_weights():
    L = make_layer(2, [160, 96], seed=30)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        schedules, y1, contexts, g1 = run(ws, L, fp8)
        _, y2, _, g2 = run(ws, L, fp8)
        for p in range(2):
            assert np.array_equal(y1[p], y2[p]), f"y rank {p} differs between runs"
            for key in ("dx", "d_router_w") + GRAD_KEYS:
                assert np.array_equal(g1[key][p], g2[key][p]), f"{key} rank {p} differs between runs"
        rebuilt = mok.recompute_forward_context(ws, schedules, L["x"], L["router_w"], L["w_gate"], L["w_up"],
                                                L["s_gate"], L["s_up"], fp8_weights=fp8)
        for p in range(2):
            assert rebuilt[p].to_bytes() == contexts[p].to_bytes(), f"recomputed context rank {p}"
        g3 = mok.backward(ws, schedules, rebuilt, L["dy"], L["x"], L["router_w"], *weights(L), fp8_weights=fp8)
        for key in ("dx", "d_router_w") + GRAD_KEYS:
            assert all(np.array_equal(g1[key][p], g3[key][p]) for p in range(2)), key
        # The FP8 GEMMs read the FP8 weights alone: new bf16 weights change nothing until quantized.
        w_down = [bf(f32(w) * 2) for w in L["w_down"]]
        changed = dict(L, w_down=w_down)
        s = mok.build_schedule(ws, L["topk_ids"])
        stale, _ = mok.forward(ws, s, L["x"], L["router_w"], *weights(changed), fp8_weights=fp8)
        fresh_fp8 = mok.functional.quantize_weights(ws, *weights(changed))
        fresh, _ = mok.forward(ws, s, L["x"], L["router_w"], *weights(changed), fp8_weights=fresh_fp8)
        for p in range(2):
            assert np.array_equal(stale[p], y1[p])
            assert not np.array_equal(fresh[p], y1[p])


def test_accumulate_mode():
    L = make_layer(2, [100, 140], seed=40)
    rng = np.random.default_rng([SEED, 41])
    E_local, H, I, Is = L["E"] // 2, L["H"], L["I"], L["Is"]
    shapes = {"dw_gate": (E_local, I, H), "dw_up": (E_local, I, H), "dw_down": (E_local, H, I),
              "ds_gate": (Is, H), "ds_up": (Is, H), "ds_down": (H, Is)}
    start = {k: [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(2)] for k, shape in shapes.items()}
    buffers = {k: [v.copy() for v in vs] for k, vs in start.items()}
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        _, y, _, g = run(ws, L, fp8, accumulate=True, grads=buffers)
    for k in GRAD_KEYS:
        assert all(g[k][p] is buffers[k][p] for p in range(2)), f"{k}: not accumulated in place"
    y_ref, g_ref = reference(L)
    check_against_reference(L, y, g, y_ref, g_ref, start=start)


def test_torch_tensors_give_the_numpy_bits():
    torch = pytest.importorskip("torch")
    L = make_layer(1, [130], seed=50)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        _, y, _, g = run(ws, L, fp8)

        def t(a):
            return None if a is None else torch.from_numpy(a.copy()).view(torch.bfloat16) \
                if a.dtype == np.uint16 else torch.from_numpy(a.copy())

        T = {k: [t(a) for a in L[k]] for k in ("x", "dy", "topk_ids", "router_w", "w_gate", "w_up", "w_down")}
        shared = [t(L[k]) for k in ("s_gate", "s_up", "s_down")]
        tw = (T["w_gate"], T["w_up"], T["w_down"], *shared)
        tfp8 = mok.functional.quantize_weights(ws, *tw)
        assert isinstance(tfp8[0].buffer, torch.Tensor) and np.array_equal(tfp8[0].buffer.numpy(), fp8[0].buffer)
        s = mok.build_schedule(ws, T["topk_ids"])
        ty, c = mok.forward(ws, s, T["x"], T["router_w"], *tw, fp8_weights=tfp8)
        tg = mok.backward(ws, s, c, T["dy"], T["x"], T["router_w"], *tw, fp8_weights=tfp8)
        assert np.array_equal(ty[0].view(torch.int16).numpy().view(np.uint16), y[0])
        for key in ("dx", "dw_gate", "dw_down", "ds_up"):
            assert np.array_equal(tg[key][0].view(torch.int16).numpy().view(np.uint16), g[key][0]), key
        # numpy FP8 weights beside torch tensors: one kind per call
        with pytest.raises(ValueError, match=r"fp8_weights\[0\] is a numpy array but the call's other arrays are "
                                             "torch"):
            mok.forward(ws, s, T["x"], T["router_w"], *tw, fp8_weights=fp8)


# ---- refusals ------------------------------------------------------------------------------------------

def test_missing_or_mismatched_fp8_weights_are_refused():
    L = make_layer(2, [40, 40], seed=60)
    group, ws = workspace(L)
    with group, ws:
        fp8 = mok.functional.quantize_weights(ws, *weights(L))
        s = mok.build_schedule(ws, L["topk_ids"])
        xs = (L["x"], L["router_w"])
        for what, call in (("forward", lambda **kw: mok.forward(ws, s, *xs, *weights(L), **kw)),
                           ("recompute_forward_context", lambda **kw: mok.recompute_forward_context(
                               ws, s, *xs, L["w_gate"], L["w_up"], L["s_gate"], L["s_up"], **kw))):
            with pytest.raises(ValueError, match=f"{what}: fp8_weights is required: the workspace's precision is fp8"):
                call()
            with pytest.raises(ValueError, match=rf"{what}: fp8_weights\[0\] was quantized for local rank 1"):
                call(fp8_weights=[fp8[1], fp8[0]])
            with pytest.raises(ValueError, match=rf"{what}: fp8_weights\[1\] must be the FP8Weights that "
                                                 "quantize_weights returns, got ndarray"):
                call(fp8_weights=[fp8[0], fp8[1].buffer])
            with pytest.raises(ValueError, match="fp8_weights: expected 2 entries"):
                call(fp8_weights=[fp8[0]])
        _, contexts = mok.forward(ws, s, *xs, *weights(L), fp8_weights=fp8)
        with pytest.raises(ValueError, match="backward: fp8_weights is required"):
            mok.backward(ws, s, contexts, L["dy"], *xs, *weights(L))
        # another layer: other H, and the same H, I, I_s with other experts per rank
        for other in (make_layer(2, [8, 8], H=128, seed=61), make_layer(2, [8, 8], E=4, seed=62)):
            og, ows = workspace(other)
            with og, ows:
                theirs = mok.functional.quantize_weights(ows, *weights(other))
            with pytest.raises(ValueError, match=r"forward: fp8_weights\[0\] was quantized for another layer"):
                mok.forward(ws, s, *xs, *weights(L), fp8_weights=theirs)
        with pytest.raises(ValueError, match="quantize_weights: w_down.0. has shape"):
            mok.functional.quantize_weights(ws, L["w_gate"], L["w_up"], L["w_gate"], L["s_gate"], L["s_up"],
                                            L["s_down"])


def test_fp8_weights_of_another_workspace_of_the_same_layer_are_accepted():
    L = make_layer(1, [64], seed=70)
    group, ws = workspace(L)
    with group, ws:
        other = mok.Workspace(group, L["H"], L["I"], L["E"], L["k"], L["Is"], max_tokens=64, config=CONFIG,
                              precision="fp8")
        with other:
            fp8 = mok.functional.quantize_weights(other, *(w[0] if isinstance(w, list) else w for w in weights(L)))
        s = mok.build_schedule(ws, L["topk_ids"][0])
        y, _ = mok.forward(ws, s, L["x"][0], L["router_w"][0], *(w[0] if isinstance(w, list) else w
                                                                 for w in weights(L)), fp8_weights=fp8)
    assert rel_err(y, reference(L)[0][0]) <= TOL["y"]


def test_precision_rules():
    L = make_layer(1, [16], seed=80)
    group = mok.Group.create_local(1, backend="cpu", config=CONFIG)
    with group:
        with pytest.raises(ValueError, match="Workspace: precision: 'fp16' is not 'bf16' or 'fp8'"):
            mok.Workspace(group, 256, 128, 6, 2, max_tokens=16, precision="fp16")
        with pytest.raises(mok.InvalidArgumentError, match="shape.intermediate: 64 is not a multiple of MOK_FP8_BLOCK"):
            mok.Workspace(group, 256, 64, 6, 2, max_tokens=16, precision="fp8")
        assert mok.Workspace(group, 256, 128, 6, 2, max_tokens=16, precision=_lib.Precision.FP8).precision == "fp8"
        with mok.Workspace(group, 256, 128, 6, 2, 128, max_tokens=16, config=CONFIG) as bf16_ws:
            assert bf16_ws.precision == "bf16" and bf16_ws.fp8_layout is None
            with pytest.raises(ValueError, match="quantize_weights: the workspace's precision is bf16"):
                mok.functional.quantize_weights(bf16_ws, *(w[0] if isinstance(w, list) else w for w in weights(L)))
            with mok.Workspace(group, 256, 128, 6, 2, 128, max_tokens=16, config=CONFIG, precision="FP8") as fp8_ws:
                fp8 = mok.functional.quantize_weights(fp8_ws, *(w[0] if isinstance(w, list) else w
                                                                for w in weights(L)))
            s = mok.build_schedule(bf16_ws, L["topk_ids"][0])
            with pytest.raises(ValueError, match="forward: fp8_weights given, but the workspace's precision is bf16"):
                mok.forward(bf16_ws, s, L["x"][0], L["router_w"][0],
                            *(w[0] if isinstance(w, list) else w for w in weights(L)), fp8_weights=fp8)


# ---- bf16 beside it ------------------------------------------------------------------------------------

def test_bf16_unchanged():
    """A Workspace without a precision is bf16 and computes what precision="bf16" does, bit for bit,
    matching the bf16 reference (the same as before FP8 existed; test_binding.py has the rest)."""
    L = make_layer(2, [120, 80], seed=90)
    results = []
    for precision in (None, "bf16"):
        group = mok.Group.create_local(2, backend="cpu", config=CONFIG)
        kw = {} if precision is None else {"precision": precision}
        ws = mok.Workspace(group, L["H"], L["I"], L["E"], L["k"], L["Is"], max_tokens=120, config=CONFIG, **kw)
        with group, ws:
            assert ws.precision == "bf16"
            results.append(run(ws, L, None))
    (_, ya, _, ga), (_, yb, _, gb) = results
    for p in range(2):
        assert np.array_equal(ya[p], yb[p])
        assert all(np.array_equal(ga[k][p], gb[k][p]) for k in ("dx", "d_router_w") + GRAD_KEYS)
    y_ref, g_ref = reference(L, "bf16")
    for p in range(2):
        assert rel_err(ya[p], y_ref[p]) <= 2e-2
        assert rel_err(ga["dx"][p], g_ref["dx"][p]) <= 2e-2
    default = mok.reference_forward(L["x"], L["topk_ids"], L["router_w"], *weights(L))
    assert all(np.array_equal(default[p], y_ref[p]) for p in range(2))
