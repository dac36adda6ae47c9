"""test_megatron.py — mok.integrations.megatron with Megatron-Core (PyPI megatron-core; skipped when it
is not installed). On the CPU: what the installed package offers (no megakernel-backend boundary),
the TransformerConfig -> mok mapping and its refusals, and an MCore MoELayer (allgather dispatcher,
SequentialMLP, one rank of a gloo group) against the same layer through mok on the cpu backend:
output, input gradient and every parameter's gradient, the state dict unchanged, the shared expert
fused or gated, and recompute_modules=["moe"] rebuilding mok's context. On GPUs: a tiny GPT-MoE
trained with MCore's own path and with mok, EP1 and EP2 (skipped without the GPUs).
The seed is printed (MOK_PY_SEED=N replays a run).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import mok

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")
import torch.nn.functional as F  # noqa: E402

from mok.integrations import megatron as mm  # noqa: E402

SEED = int(os.environ.get("MOK_PY_SEED", np.random.SeedSequence().entropy % (1 << 32)))
CONFIG = mok.Config(cpu_threads=2, minibatch_rows=128, ring_rows=256)
# Tolerances as in test_transformers.py: max |mok - mcore| / max |mcore|, both bf16. MCore's experts
# scale each expert's bf16 output by its probability and sum them in bf16; mok sums in fp32 and
# rounds once: both a few bf16 ulps (2^-8) from the exact layer.
TOL = {"y": 2e-2, "dx": 2e-2, "grads": 3e-2}


@pytest.fixture(autouse=True)
def _seed():
    print(f"MOK_PY_SEED={SEED}")
    torch.manual_seed(SEED)


def test_the_installed_package_has_no_megakernel_backend_boundary():
    """The facts mok.integrations.megatron's note is built on, read from the installed package: no
    moe_megakernel_backend field, no MegakernelBackend class, and a closed set of token
    dispatchers. Should a release add the boundary, this test fails and the integration is revisited."""
    found = mm.boundary()
    print(found)
    assert found["moe_megakernel_backend"] is False and found["MegakernelBackend"] is False
    assert set(found["token_dispatchers"]) <= {"allgather", "alltoall", "flex", "alltoall_seq"}


def _config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig
    values = dict(num_layers=1, hidden_size=64, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0)
    values.update(changes)
    return TransformerConfig(**values)


def test_config_mapping_and_refusals():
    assert mm.mok_shape(_config(moe_shared_expert_intermediate_size=128)) == {
        "hidden": 64, "intermediate": 64, "num_experts": 8, "topk": 2, "shared_intermediate": 128}
    # a gated shared expert stays MCore's module: mok fuses none
    assert mm.mok_shape(_config(moe_shared_expert_intermediate_size=128,
                                moe_shared_expert_gate=True))["shared_intermediate"] == 0
    mm.check_config(_config())
    cases = [
        (dict(moe_ffn_hidden_size=96), "moe_ffn_hidden_size = 96 is not a multiple of 64"),
        (dict(gated_linear_unit=False), "gated_linear_unit is False"),
        (dict(activation_func=F.gelu), "activation_func is gelu"),
        (dict(add_bias_linear=True), "add_bias_linear is True"),
        (dict(params_dtype=torch.float32, bf16=False), "params_dtype is torch.float32"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            mm.check_config(_config(**changes))
    with pytest.raises(ValueError, match="tensor parallel size 2"):
        mm.check_config(_config(), tp_size=2)


@pytest.fixture(scope="module")
def mcore_cpu(tmp_path_factory):
    """One rank of a gloo group with Megatron's parallel state, and MCore's TopKRouter.gating made to
    run on the CPU: MCore's own gating moves a CPU router weight to the GPU (router.py), so on a
    machine without one it is replaced here by the same product, F.linear in fp32, for both paths."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('store')}/store", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    original = TopKRouter.gating
    TopKRouter.gating = lambda self, x: F.linear(x.float(), self.weight.float())
    yield
    TopKRouter.gating = original
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _layer(config, seed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    torch.manual_seed(SEED + seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = build_module(spec.submodules.mlp, config=config)
    with torch.no_grad():  # random weights of a trained scale; the router sharp enough to rank clearly
        for name, p in layer.named_parameters():
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape) * (1.0 if name == "router.weight" else fan_in ** -0.5))
    return layer, spec


def _run(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y, bias = layer(x)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad.detach(), {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def _err(got, want):
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("shared", ["none", "fused", "gated"])
def test_layer_matches_mcore_on_the_cpu(mcore_cpu, shared):
    changes = {} if shared == "none" else dict(moe_shared_expert_intermediate_size=128,
                                               moe_shared_expert_gate=shared == "gated")
    config = _config(**changes)
    layer, _ = _layer(config, 1)
    moked, _ = _layer(config, 1)
    keys = list(moked.state_dict())
    params = dict(moked.named_parameters())
    assert mm.apply(torch.nn.Sequential(moked), mok_config=CONFIG, max_tokens=96) == ["0"]
    assert isinstance(moked, mm.MokMoELayer) and list(moked.state_dict()) == keys
    assert all(p is params[n] for n, p in moked.named_parameters())
    x = torch.randn(24, 3, 64).to(torch.bfloat16)  # [sequence, batch, hidden]
    dy = torch.randn(24, 3, 64).to(torch.bfloat16)
    want, got = _run(layer, x, dy), _run(moked, x, dy)
    assert moked._mok.shared_intermediate == (128 if shared == "fused" else 0)
    errors = {"y": _err(got[0], want[0]), "dx": _err(got[1], want[1])}
    errors.update({name: _err(got[2][name], g) for name, g in want[2].items()})
    print(shared, "worst", max(errors.items(), key=lambda kv: kv[1]))
    bad = {k: v for k, v in errors.items() if not v <= TOL.get(k, TOL["grads"])}
    assert not bad, bad


def test_recompute_modules_moe_rebuilds_the_context(mcore_cpu, monkeypatch):
    """recompute_modules=["moe"] (selective): mok keeps x, the router weights and the schedule, not
    the context, and rebuilds it in the backward; the gradients equal the kept-context run bit for bit."""
    counts = {"forward": 0, "recompute_forward_context": 0, "backward": 0}
    for name in counts:
        original = getattr(mok.functional, name)

        def counted(*args, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(mok.functional, name, counted)
    x, dy = torch.randn(16, 2, 64).to(torch.bfloat16), torch.randn(16, 2, 64).to(torch.bfloat16)
    runs = []
    for recompute in (False, True):
        changes = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
        layer, _ = _layer(_config(**changes), 2)
        mm.apply(torch.nn.Sequential(layer), mok_config=CONFIG, max_tokens=64)
        runs.append(_run(layer, x, dy))
    assert counts == {"forward": 2, "recompute_forward_context": 1, "backward": 2}, counts
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(runs[0][2][n], runs[1][2][n]) for n in runs[0][2])


def test_spec_builds_a_mok_layer(mcore_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    spec = mm.mok_moe_spec(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), mok_config=CONFIG,
                           max_tokens=64)
    layer = build_module(spec.submodules.mlp, config=_config())
    assert isinstance(layer, mm.MokMoELayer)
    y, _ = layer(torch.randn(8, 2, 64).to(torch.bfloat16))
    assert y.shape == (8, 2, 64)
    with pytest.raises(ValueError, match="builds no MoELayer"):
        mm.mok_moe_spec(get_gpt_layer_local_spec())


# ---- GPUs: a tiny GPT-MoE trained through MCore's path and through mok (skipped without them) ----------

_GPU_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_gpu_worker.py")


@pytest.mark.parametrize("ep", [1, 2])
def test_gpu_gpt_moe_trains_like_mcore(ep):
    """torchrun-style processes, one per GPU: a 2-layer GPT-MoE (MCore's GPTModel, alltoall
    dispatcher) trained 30 steps with MCore's own MoE and, from the same weights on the same
    batches, with mok (apply); the loss curves must agree (megatron_gpu_worker.py states the
    criterion)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < ep or mok.device_count("cuda") < ep:
        pytest.skip(f"needs {ep} GPU(s) and a CUDA build of libmok")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + SEED % 1000 + ep), WORLD_SIZE=str(ep),
               MOK_PY_SEED=str(SEED))
    procs = [subprocess.Popen([sys.executable, _GPU_WORKER], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(ep)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=540)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    print("\n".join(outs))
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
