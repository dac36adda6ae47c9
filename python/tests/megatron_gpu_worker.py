"""megatron_gpu_worker.py — one rank of test_megatron.py's GPU test (RANK, WORLD_SIZE, MASTER_ADDR /
MASTER_PORT in the environment, one GPU per rank): a 2-layer GPT-MoE built with Megatron-Core
(GPTModel, local spec, alltoall dispatcher, expert parallel over every rank) trained 30 steps with
MCore's own MoE and, from the same weights on the same batches, with mok (mok.integrations.megatron
.apply). Exit status 0 when the loss curves agree: the mean loss of the last 10 steps within 3%,
every step within 10% (bf16 rounding differences grow through training; the same criterion as the
Hugging Face fine-tune of test_transformers.py), and both runs learning (last-10 mean below 60% of
the first loss).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mok
from mok.integrations import megatron as mm

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
seed = int(os.environ.get("MOK_PY_SEED", "0"))
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
    # Without Transformer Engine, MCore's router gating tests `te_general_gemm is not None`, a name its
    # module defines only when the import of Transformer Engine succeeds; None is what it means there.
    moe_utils.te_general_gemm = None
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
VOCAB, SEQ, BATCH, STEPS = 128, 64, 4, 30
config = TransformerConfig(
    num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, num_moe_experts=8, moe_router_topk=2,
    moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128, gated_linear_unit=True, activation_func=F.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=world,
    hidden_dropout=0.0, attention_dropout=0.0)
spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)


def build():
    """The model as Megatron trains it in bf16: wrapped in Float16Module, which casts every parameter
    (the norms' too) and the inputs to bf16 and the loss back to fp32."""
    model_parallel_cuda_manual_seed(seed + 123)
    torch.manual_seed(seed + 123)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    return Float16Module(config, gpt)


perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), 1)[None, None]
positions = torch.arange(SEQ, device="cuda")[None].expand(BATCH, SEQ)


def batch(step):
    """This rank's batch of sequences that follow a fixed permutation of the vocabulary."""
    g = torch.Generator().manual_seed(seed * 1000 + step * world + rank)
    seq = [torch.randint(0, VOCAB, (BATCH, 1), generator=g)]
    for _ in range(SEQ):
        seq.append(perm[seq[-1]])
    seq = torch.cat(seq, 1).cuda()
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def train(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    curve = []
    for step in range(STEPS):
        ids, labels = batch(step)
        loss = model(input_ids=ids, position_ids=positions, attention_mask=mask, labels=labels).float().mean()
        loss.backward()
        for p in model.parameters():  # data parallel over the ranks: average; experts hold every rank's tokens
            if p.grad is None:
                continue
            if getattr(p, "allreduce", True):
                dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        curve.append(float(reported) / world)
    return curve


reference = build()
mcore_curve = train(reference)
moked = build()
print(f"rank {rank}: converted {mm.apply(moked, mok_config=mok.Config())}", flush=True)
mok_curve = train(moked)
tail = lambda c: sum(c[-10:]) / 10  # noqa: E731
tail_gap = abs(tail(mok_curve) - tail(mcore_curve)) / tail(mcore_curve)
step_gap = max(abs(a - b) / b for a, b in zip(mok_curve, mcore_curve))
learned = tail(mcore_curve) < 0.6 * mcore_curve[0] and tail(mok_curve) < 0.6 * mok_curve[0]
print(f"rank {rank} EP{world}: mcore {[round(v, 3) for v in mcore_curve[::5]]}\n"
      f"rank {rank} EP{world}: mok   {[round(v, 3) for v in mok_curve[::5]]}\n"
      f"rank {rank}: last-10 gap {tail_gap:.4f}, worst step gap {step_gap:.4f}, learned {learned}", flush=True)
ok = tail_gap <= 0.03 and step_gap <= 0.10 and learned
dist.barrier()
for ws in list(mok.torch._workspaces.values()):
    ws.close()
for group in list(mok.torch._groups.values()):
    group.close()
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
sys.exit(0 if ok else 1)
