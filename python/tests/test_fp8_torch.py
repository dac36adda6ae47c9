"""test_fp8_torch.py — mok.torch.MoE(precision="fp8") on the cpu backend: its forward and every
gradient against the library's FP8 reference through the binding, the FP8 weights quantized again
exactly when a master weight changes (an optimizer step, an in-place write, load_state_dict, a new
.data) and never between (counted), the context kept or rebuilt (recompute_context, checkpoint)
with the same bits, its refusals, and the bf16 layer unchanged beside it. Skipped without torch.
Random inputs are fresh per run; the seed is printed (MOK_PY_SEED=N replays a run).
"""
import os

import numpy as np
import pytest

import mok
from mok.bf16 import to_float32 as f32

torch = pytest.importorskip("torch")  # before anything below touches it: every test here needs it
import mok.torch  # noqa: E402  (after the skip)

SEED = int(os.environ.get("MOK_PY_SEED", np.random.SeedSequence().entropy % (1 << 32)))

# Against the FP8 reference (tests/layer.c's FP8 table says why): max |got - ref| / max |ref|.
TOL = {"y": 1.5e-2, "dx": 2e-2, "d_router_w": 1e-2, "grads": 1e-2}
WEIGHTS = ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"MOK_PY_SEED={SEED}")


def _layer(T, H=256, I=128, E=6, k=2, Is=128, seed=0, **kw):
    """An FP8 MoE on the cpu backend with random weights, routed by a fixed (topk_ids, router_w) so
    that dx is the experts' alone; the router weights are a leaf whose gradient is d_router_w."""
    torch.manual_seed(SEED + seed)
    m = mok.torch.MoE(H, I, E, k, shared_intermediate=Is, backend="cpu", max_tokens=T, precision="fp8",
                      config=mok.Config(cpu_threads=2, minibatch_rows=128, ring_rows=256), **kw)
    g = torch.Generator().manual_seed(SEED + seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    rw = (torch.rand(T, k, generator=g) * 1.5 - 0.25).requires_grad_(True)  # weights <= 0 too
    m.route = lambda flat: (ids, rw, None)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
    return m, ids, rw, x, dy


def _step(m, rw, x, dy):
    """One forward and backward: (y, dx, d_router_w, {weight name: gradient})."""
    xi = x.clone().requires_grad_(True)
    rw.grad = None
    m.zero_grad(set_to_none=True)
    y = m(xi)
    y.backward(dy)
    return y.detach(), xi.grad, rw.grad.clone(), {n: getattr(m, n).grad for n in WEIGHTS if getattr(m, n) is not None}


def _np(t):
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _rel(got, ref):
    got = f32(got) if got.dtype == np.uint16 else np.asarray(got, np.float32)
    ref = f32(ref) if ref.dtype == np.uint16 else np.asarray(ref, np.float32)
    assert got.shape == ref.shape and np.isfinite(got).all()
    return float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), 1e-30)


@pytest.mark.parametrize("Is", [128, 0])
def test_moe_fp8_matches_the_fp8_reference(Is):
    T = 160
    m, ids, rw, x, dy = _layer(T, Is=Is, seed=1)
    y, dx, d_rw, grads = _step(m, rw, x, dy)
    assert m.fp8_quantizations == 1
    w = [_np(getattr(m, n)) if getattr(m, n) is not None else None for n in WEIGHTS]
    args = (_np(x.to(torch.bfloat16)), ids.numpy(), _np(rw), *w)
    y_ref = mok.reference_forward(*args, precision="fp8")
    g_ref = mok.reference_backward(_np(dy.to(torch.bfloat16)), *args, precision="fp8")
    assert _rel(_np(y.to(torch.bfloat16)), y_ref) <= TOL["y"]
    assert torch.equal(dx, dx.to(torch.bfloat16).float()), "dx is not mok's bf16 dx"
    assert _rel(_np(dx.to(torch.bfloat16)), g_ref["dx"]) <= TOL["dx"]
    assert _rel(_np(d_rw), g_ref["d_router_w"]) <= TOL["d_router_w"]
    for n in WEIGHTS:
        if Is == 0 and n.startswith("s_"):
            assert n not in grads and g_ref["d" + n] is None
            continue
        assert _rel(_np(grads[n]), g_ref["d" + n]) <= TOL["grads"], n
    # and not the bf16 function: the bf16 reference is far further away
    y16 = mok.reference_forward(*args)
    got = f32(_np(y.to(torch.bfloat16)))
    assert 20 * np.abs(got - f32(y_ref)).mean() < np.abs(got - f32(y16)).mean()


def test_fp8_weights_are_quantized_once_per_change_of_the_weights():
    T = 96
    m, ids, rw, x, dy = _layer(T, seed=2)
    assert m.fp8_quantizations == 0
    y1, *_ = _step(m, rw, x, dy)
    y2, *_ = _step(m, rw, x, dy)
    with torch.no_grad():
        y3 = m(x)
    assert m.fp8_quantizations == 1, "forwards without a change of the weights quantized again"
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    first = m.fp8_weights(x.device)
    assert m.fp8_weights(x.device) is first and m.fp8_quantizations == 1

    def fresh_output():
        """y of a new layer holding m's current weights (its own first quantization)."""
        other, *_ = _layer(T, seed=2)
        other.load_state_dict(m.state_dict())
        with torch.no_grad():
            return other(x)

    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt.step()  # the gradients of the last _step
    y4, *_ = _step(m, rw, x, dy)
    assert m.fp8_quantizations == 2, "the forward after optimizer.step() did not quantize again"
    assert not torch.equal(y4, y1) and torch.equal(y4, fresh_output())
    _step(m, rw, x, dy)
    assert m.fp8_quantizations == 2

    changes = {
        "an in-place write of one weight": lambda: m.s_down.mul_(0.5),
        "load_state_dict": lambda: m.load_state_dict({k: v.clone() * (0.5 if k == "w_up" else 1)
                                                      for k, v in m.state_dict().items()}),
        "a new .data": lambda: setattr(m.w_down, "data", m.w_down.data * 2),
    }
    count = m.fp8_quantizations
    for what, change in changes.items():
        with torch.no_grad():
            change()
        before = m.fp8_quantizations
        y, *_ = _step(m, rw, x, dy)
        assert m.fp8_quantizations == before + 1, f"{what}: not quantized again"
        assert torch.equal(y, fresh_output()), f"{what}: the forward did not use the new weights"
        count += 1
    assert m.fp8_quantizations == count
    # A write through .data moves no version counter that autograd or the cache sees:
    # invalidate_fp8_weights() says so.
    with torch.no_grad():
        m.w_gate.data.mul_(0.5)
    y, *_ = _step(m, rw, x, dy)
    assert m.fp8_quantizations == count and not torch.equal(y, fresh_output())
    m.invalidate_fp8_weights()
    y, *_ = _step(m, rw, x, dy)
    count += 1
    assert m.fp8_quantizations == count and torch.equal(y, fresh_output())
    # the router's weights are not the experts': changing them quantizes nothing
    with torch.no_grad():
        m.router.weight.mul_(2)
    _step(m, rw, x, dy)
    assert m.fp8_quantizations == count


def test_a_graph_keeps_the_fp8_weights_of_its_forward():
    """A new quantization writes a new buffer: a forward whose backward has not run yet keeps the FP8
    weights it ran with, untouched, and its backward reads them."""
    T = 64
    m, ids, rw, x, dy = _layer(T, seed=3)
    xa = x.clone().requires_grad_(True)
    ya = m(xa)
    held = m.fp8_weights(x.device)
    saved = held.buffer.clone()
    m.invalidate_fp8_weights()
    xb = x.clone().requires_grad_(True)
    yb = m(xb)
    new = m.fp8_weights(x.device)
    assert m.fp8_quantizations == 2 and new is not held and new.buffer.data_ptr() != held.buffer.data_ptr()
    yb.backward(dy)
    ya.backward(dy)
    assert torch.equal(held.buffer, saved) and torch.equal(new.buffer, saved)  # the same weights: the same bits
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)


@pytest.mark.parametrize("mode", ["recompute", "checkpoint"])
def test_rebuilt_context_gives_the_same_bits(mode):
    T = 128
    m, ids, rw, x, dy = _layer(T, seed=4)
    kept = _step(m, rw, x, dy)
    if mode == "recompute":
        m.kernel.recompute_context = True
        rebuilt = _step(m, rw, x, dy)
    else:
        from torch.utils.checkpoint import checkpoint

        xi = x.clone().requires_grad_(True)
        rw.grad = None
        m.zero_grad(set_to_none=True)
        y = checkpoint(m, xi, use_reentrant=False)
        y.backward(dy)
        rebuilt = (y.detach(), xi.grad, rw.grad.clone(), {n: getattr(m, n).grad for n in WEIGHTS})
    assert m.fp8_quantizations == 1
    assert torch.equal(kept[0], rebuilt[0]) and torch.equal(kept[1], rebuilt[1]) and torch.equal(kept[2], rebuilt[2])
    for n in WEIGHTS:
        assert torch.equal(kept[3][n], rebuilt[3][n]), n


def test_refusals():
    with pytest.raises(ValueError, match="MoE: precision='fp16' is not 'bf16' or 'fp8'"):
        mok.torch.MoE(256, 128, 4, 2, backend="cpu", precision="fp16")
    with pytest.raises(ValueError, match="MoE: intermediate=64 is not a multiple of 128, which precision='fp8' needs"):
        mok.torch.MoE(256, 64, 4, 2, backend="cpu", precision="fp8")
    with pytest.raises(ValueError, match="MoE: shared_intermediate=192 is not a multiple of 128"):
        mok.torch.MoE(256, 128, 4, 2, shared_intermediate=192, backend="cpu", precision="fp8")
    bf16 = mok.torch.MoE(256, 128, 4, 2, backend="cpu")
    with pytest.raises(ValueError, match="MoE.fp8_weights: the layer's precision is bf16"):
        bf16.fp8_weights(torch.device("cpu"))


def test_bf16_layer_unchanged():
    """MoE without a precision is the bf16 layer through the mok:: ops, as before: it quantizes
    nothing and computes what precision="bf16" does, bit for bit, and not what the FP8 layer does."""
    T = 96
    fp8, ids, rw, x, dy = _layer(T, seed=5)
    layers = {}
    for name, kw in (("default", {}), ("bf16", {"precision": "bf16"})):
        torch.manual_seed(0)
        layers[name] = mok.torch.MoE(256, 128, 6, 2, shared_intermediate=128, backend="cpu", max_tokens=T, **kw)
        layers[name].load_state_dict(fp8.state_dict())
        layers[name].route = lambda flat: (ids, rw, None)
    out = {name: _step(layer, rw, x, dy) for name, layer in layers.items()}
    out["fp8"] = _step(fp8, rw, x, dy)
    assert layers["default"].precision == "bf16" and layers["default"].fp8_quantizations == 0
    assert layers["default"].mok_workspace(x.device).precision == "bf16"
    a, b = out["default"], out["bf16"]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert all(torch.equal(a[3][n], b[3][n]) for n in WEIGHTS)
    assert not torch.equal(a[0], out["fp8"][0])
    assert fp8.mok_workspace(x.device) is not layers["default"].mok_workspace(x.device)
