"""test_train_twin.py — the training example's PyTorch twin (examples/train_moe.py) computes mok's
function with mok's rounding points, forward and backward: its hand-written expert backward
(ExpertFFN) equals autograd in fp32, and in bf16 its layer matches mok.torch.MoE on the cpu
backend up to the order of fp32 sums: dx rounded once to bf16, d_router_w from the expert output
before its rounding, every other gradient within a bf16 step. Skipped without torch.
"""
import importlib.util
import os

import numpy as np
import pytest

import mok

torch = pytest.importorskip("torch")  # before anything below touches it: every test here needs it
import torch.nn.functional as F  # noqa: E402  (after the skip)

SEED = int(os.environ.get("MOK_PY_SEED", np.random.SeedSequence().entropy % (1 << 32)))
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_moe.py")


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"MOK_PY_SEED={SEED}")


def _example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_expert_ffn_fp32_is_autograd():
    ex = _example()
    g = torch.Generator().manual_seed(SEED)
    n, H, I = 37, 64, 48
    v = torch.randn(n, H, generator=g, dtype=torch.float64).float().requires_grad_(True)
    wg, wu = (torch.randn(I, H, generator=g).div(8).requires_grad_(True) for _ in range(2))
    wd = torch.randn(H, I, generator=g).div(8).requires_grad_(True)
    gy = torch.randn(n, H, generator=g)
    y, exact = ex.ExpertFFN.apply(v, wg, wu, wd, torch.float32)
    assert torch.equal(y, exact)
    got = torch.autograd.grad(y, (v, wg, wu, wd), gy)
    ref_y = F.linear(F.silu(F.linear(v, wg)) * F.linear(v, wu), wd)
    want = torch.autograd.grad(ref_y, (v, wg, wu, wd), gy)
    assert _rel(y, ref_y) < 1e-6
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), got, want):
        assert _rel(a, b) < 1e-5, name


def _pair(ex, T, H, I, E, k, Is, seed):
    """mok.torch.MoE (cpu backend) and the bf16 twin with the same weights, both routed by the
    same fixed (topk_ids, router_w) so that dx is the MoE's alone (no router path)."""
    g = torch.Generator().manual_seed(seed)
    m = mok.torch.MoE(H, I, E, k, shared_intermediate=Is, backend="cpu", max_tokens=T)
    t = ex.TorchMoE(H, I, E, k, Is, compute_dtype=torch.bfloat16)
    t.load_state_dict(m.state_dict())
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[::7, -1] = ids[::7, 0]  # a token twice on one expert
    rw = torch.rand(T, k, generator=g) * 2 - 0.5  # weights <= 0 too
    leaf = rw.clone().requires_grad_(True)
    m.route = lambda flat: (ids, leaf, None)
    t.route = lambda flat: (ids.long(), leaf)
    return m, t, leaf, g


def test_twin_matches_mok_cpu_up_to_sum_order():
    ex = _example()
    T, H, I, E, k, Is = 96, 128, 64, 6, 2, 64
    m, t, leaf, g = _pair(ex, T, H, I, E, k, Is, SEED)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
    out = {}
    for name, layer in (("mok", m), ("twin", t)):
        xi = x.clone().requires_grad_(True)
        leaf.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(xi)
        y.backward(dy)
        out[name] = dict(y=y.detach(), dx=xi.grad, d_router_w=leaf.grad.clone(),
                         **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    a, b = out["mok"], out["twin"]
    # y and the gradients: the same bf16 values up to one bf16 step of the largest (a sum order
    # may move a value by a step; measured: most are equal, the rest within 1e-3)
    assert _rel(a["y"], b["y"]) < 8e-3
    # dx: one bf16 rounding of the fp32 sum on both sides
    for name in ("mok", "twin"):
        dx = out[name]["dx"]
        assert torch.equal(dx, dx.to(torch.bfloat16).float()), f"{name}'s dx is not rounded to bf16"
    assert _rel(a["dx"], b["dx"]) < 8e-3
    # d_router_w: fp32 dot products with the unrounded expert outputs. Most agree to ~1e-7 of the
    # largest (a g or u that a sum order moved by a bf16 step moves its row's by up to ~1e-3);
    # taken against the rounded outputs, every one would be ~1e-3 off.
    e = ((a["d_router_w"] - b["d_router_w"]).abs() / b["d_router_w"].abs().max()).flatten()
    assert e.median().item() < 1e-5 and e.max().item() < 8e-3, (e.median().item(), e.max().item())
    for n in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
        assert n in a and n in b, n
        assert _rel(a[n], b[n]) < 8e-3, n


def test_split_k_twin_is_the_twin_up_to_sum_order():
    """The yardstick twin with split-K matmuls computes the twin's function: the same rounding
    points, another order of the fp32 sums (every value within a bf16 step of the largest)."""
    ex = _example()
    g = torch.Generator().manual_seed(SEED)
    T, H, I, E, k, Is = 80, 128, 64, 5, 2, 64
    a = ex.TorchMoE(H, I, E, k, Is, compute_dtype=torch.bfloat16)
    b = ex.TorchMoE(H, I, E, k, Is, compute_dtype=torch.bfloat16, split_k=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(T, H, generator=g)
    dy = torch.randn(T, H, generator=g)
    out = []
    for layer in (a, b):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        out.append(dict(y=y.detach(), dx=xi.grad, **{n: p.grad for n, p in layer.named_parameters()}))
    for name in out[0]:
        assert _rel(out[1][name], out[0][name]) < 8e-3, name
    same = [name for name in out[0] if torch.equal(out[0][name], out[1][name])]
    assert len(same) < len(out[0]), "the split-K twin gave the same bits: it is not another sum order"


def _models(ex, seed):
    """A one-block model with mok's layer (cpu backend) and its twin holding the same weights, and a
    batch of the example's language."""
    H, I, E, k, Is, V, B, L = 64, 64, 4, 2, 64, 16, 4, 16

    def mok_moe():
        return mok.torch.MoE(H, I, E, k, Is, backend="cpu", max_tokens=B * L)

    def twin_moe():
        return ex.TorchMoE(H, I, E, k, Is, compute_dtype=torch.bfloat16)

    torch.manual_seed(seed)
    m = ex.MoETransformer(V, H, 2, 1, L, mok_moe)
    t = ex.MoETransformer(V, H, 2, 1, L, twin_moe)
    t.load_state_dict(m.state_dict())
    inputs, targets = ex.MarkovLanguage(V, 2, seed).batch(0, B, L, seed)
    return m, t, inputs, targets


def test_same_weights_check_passes_mok_and_catches_defects():
    """The example's same-weights check passes mok against its twin, and fails a layer with a
    defect: the router's gradient lost, or the output 2% too large."""
    ex = _example()
    m, t, inputs, targets = _models(ex, SEED)
    c = ex.same_weights_check(m, t, inputs, targets)
    assert ex.same_weights_ok(c), c

    moe = m.blocks[0].moe
    route = moe.route
    moe.route = lambda flat: (lambda r: (r[0], r[1].detach(), r[2]))(route(flat))
    c = ex.same_weights_check(m, t, inputs, targets)
    assert not ex.same_weights_ok(c) and c["worst"] == "blocks.0.moe.router.weight", c
    moe.route = route

    forward = moe.forward
    moe.forward = lambda x: forward(x) * 1.02
    c = ex.same_weights_check(m, t, inputs, targets)
    assert not ex.same_weights_ok(c), c
    moe.forward = forward
    assert ex.same_weights_ok(ex.same_weights_check(m, t, inputs, targets))
