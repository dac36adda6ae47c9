"""train_moe.py — a small MoE transformer trained twice from the same initial weights on the same
data: once with mok's layer (mok.torch.MoE) as the FFN of every block, once with a plain PyTorch
MoE of the same function (its twin). The two loss curves should agree up to bf16 noise.

    make
    MOK_LIBRARY=$PWD/build/libmok.so PYTHONPATH=python python3 examples/train_moe.py --steps 200
    ... --device cuda                  # mok's cuda backend (needs a CUDA build of libmok and a GPU)

The model: token embedding, `--blocks` blocks of [RMSNorm, causal self-attention, RMSNorm, MoE FFN]
(pre-norm residual), a final RMSNorm and an untied output head. Everything outside the MoE is fp32.
The MoE: router = fp32 linear, softmax over all experts, top-k, renormalised; SwiGLU experts and an
optional shared expert with bf16 weights; bf16 activations with fp32 accumulation.

The data: a fixed random "language", an order-2 Markov chain over a small vocabulary (the next token
depends on the two before it, so attention has to find the previous token); each context allows
`--branch` next tokens with random probabilities. Its entropy rate is the lowest loss any model can
reach, printed as the floor. Every step draws a fresh batch from a generator seeded by (seed, step),
so both runs see the same batches in the same order.

The twin follows mok's rounding points (include/mok.h): gate and up projections rounded to bf16,
h = bf16(silu(g) * u), each expert output rounded to bf16, the weighted sum in fp32 in the order
shared, slot 0 .. k-1, rounded once; in the backward, dx summed in fp32 and rounded once to bf16,
and d_router_w taken against the expert output before its rounding. It differs from mok only in
the order of the fp32 accumulations inside the matmuls and in how dx is summed, which is the bf16
noise this script measures. --noise-ref (on by default) trains two more models as yardsticks: the
twin with each bf16 matmul run in two halves of its inner dimension (the same function, another
order of its fp32 sums: the kind of difference mok has) and the twin with its MoE in fp32 (same
bf16 weights, no bf16 rounding of activations: what bf16 rounding itself does to the loss).

The verdict, "within bf16 noise": the mean |loss_mok - loss_twin| below twice the yardsticks' mean
|loss - loss_twin|, over the whole run and over its last quarter, and every same-weights check
within its limits: every --check-every steps, mok's layer on the twin's weights of that step and
the same batch against the twin (loss, and each parameter's gradient), so that differences cannot
pile up over steps. Free-running curves drift apart after the loss's sharp drop whatever the
perturbation (the yardsticks' own gaps reach 1-2%); the same-weights checks do not drift.

FP8 (--precision fp8): a fifth model, mok's layer in FP8 (mok.torch.MoE(precision="fp8"): E4M3
GEMM operands with power-of-two block scales, include/mok.h), from the same initial weights on the
same batches. It quantizes its bf16 master weights once per optimizer step. Its verdict: the mean
relative gap |loss_fp8 - loss_mok| / loss_mok over the last quarter of the run within --fp8-bar
(0.5%). That gap carries the free-running curves' drift too (see the yardsticks above), so every
--check-every steps the FP8 layer also runs on mok's bf16 weights of that step and the same batch
(loss and gradients against mok's, reported): its own error, which does not drift. The bf16
models do not see any of it: their curves are the same bits with or without it. H, I and I_s are
then multiples of 128.

Outputs in --out: losses.csv (step, lr, loss_* and gnorm_* of mok, torch[, order, fp32][, mok_fp8])
and losses.png when matplotlib is importable.
"""
import argparse
import csv
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
import mok  # noqa: E402
import mok.torch  # noqa: E402

# ---- data ----------------------------------------------------------------------------------------


class MarkovLanguage:
    """An order-2 Markov chain: P(next | prev2, prev1) puts its mass on `branch` random tokens."""

    def __init__(self, vocab, branch, seed):
        g = torch.Generator().manual_seed(seed + 7919)
        self.vocab = vocab
        # For each context (a, b): `branch` distinct candidates and their probabilities.
        scores = torch.rand(vocab * vocab, vocab, generator=g)
        self.next_tokens = scores.topk(branch, dim=-1).indices                          # [V*V, branch]
        logits = torch.randn(vocab * vocab, branch, generator=g) * 1.5
        self.next_probs = torch.softmax(logits, dim=-1)                                  # [V*V, branch]
        # Entropy rate: mean conditional entropy under the chain's stationary distribution of contexts,
        # estimated from a long sample (the chain has V*V states; exact solving is not needed here).
        ctx_entropy = -(self.next_probs * self.next_probs.log()).sum(-1)
        seqs = self.sample(64, 512, torch.Generator().manual_seed(seed + 104729))
        ctx = seqs[:, 1:-1] * vocab + seqs[:, 2:]
        self.entropy_rate = ctx_entropy[ctx[:, 64:].reshape(-1)].mean().item()

    def sample(self, batch, length, generator):
        seqs = torch.empty(batch, length, dtype=torch.long)
        seqs[:, :2] = torch.randint(0, self.vocab, (batch, 2), generator=generator)
        for t in range(2, length):
            ctx = seqs[:, t - 2] * self.vocab + seqs[:, t - 1]
            choice = torch.multinomial(self.next_probs[ctx], 1, generator=generator).squeeze(-1)
            seqs[:, t] = self.next_tokens[ctx, choice]
        return seqs

    def batch(self, step, batch, seq_len, seed):
        """The batch of step `step`: inputs [B, L] and targets [B, L] (the next token)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        seqs = self.sample(batch, seq_len + 1, g)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


# ---- the twin: a plain PyTorch MoE with mok's parameters and rounding points ----------------------


def _linear(a, w, cd, split_k):
    """a @ w.T with cd operands, fp32 accumulation, rounded once to cd; split_k: the two halves of
    the inner dimension as fp32 products of the cd values, added in fp32, then rounded (exact
    products, another order of the fp32 sums on every backend)."""
    if split_k and a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a, w = a.to(cd).float(), w.to(cd).float()
        return (F.linear(a[..., :h], w[:, :h]) + F.linear(a[..., h:], w[:, h:])).to(cd)
    return F.linear(a.to(cd), w.to(cd))


def _matmul(a, b, cd, split_k):
    """a @ b for cd operands, rounded once to cd; split_k as in _linear."""
    if split_k and a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a, b = a.float(), b.float()
        return (a[:, :h] @ b[:h] + a[:, h:] @ b[h:]).to(cd)
    return a @ b


class ExpertFFN(torch.autograd.Function):
    """One SwiGLU expert on rows v [n, H] (fp32 holding values of the compute dtype cd) with mok's
    rounding points, forward and backward (include/mok.h, src/cpu/tasks_bwd.c); with cd = fp32
    every rounding is a no-op. Returns the output rounded to cd and the output before that rounding
    (both fp32; the second only for d_router_w, without a gradient of its own).
    Backward, given gy = w * dy in fp32 (w = 1 for the shared expert): dh = gy . W_down in fp32 (not
    rounded), dg and du rounded to cd, the rows' dx part = dg . W_gate + du . W_up accumulated in
    fp32 and rounded once; weight gradients: W_down's from cd(gy) and h, W_gate's and W_up's from
    dg, du and v, each accumulated in fp32 and rounded once. split_k: every cd matmul in two halves
    of its inner dimension (the same function up to the order of its fp32 sums)."""

    @staticmethod
    def forward(ctx, v, wg, wu, wd, cd, split_k=False):
        vc = v.to(cd)
        g = _linear(vc, wg, cd, split_k)
        u = _linear(vc, wu, cd, split_k)
        h = (F.silu(g.float()) * u.float()).to(cd)
        y = _linear(h, wd, cd, split_k)
        exact = F.linear(h.float(), wd.float())
        ctx.save_for_backward(vc, g, u, h, wg, wu, wd)
        ctx.cd, ctx.split_k = cd, split_k
        ctx.mark_non_differentiable(exact)
        return y.float(), exact

    @staticmethod
    def backward(ctx, gy, _):
        vc, g, u, h, wg, wu, wd = ctx.saved_tensors
        cd, split_k = ctx.cd, ctx.split_k
        dh = gy @ wd.float()
        gf, uf = g.float(), u.float()
        sg = torch.sigmoid(gf)
        dg = (dh * uf * sg * (1 + gf * (1 - sg))).to(cd)
        du = (dh * gf * sg).to(cd)
        dx = _matmul(torch.cat([dg, du], 1), torch.cat([wg.to(cd), wu.to(cd)], 0), cd, split_k).float()
        dwd = _matmul(gy.to(cd).t(), h, cd, split_k)
        dwg, dwu = _matmul(dg.t(), vc, cd, split_k), _matmul(du.t(), vc, cd, split_k)
        return dx, dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype), None, None


class TorchMoE(nn.Module):
    """The function of mok.torch.MoE in plain PyTorch. Same parameter names, shapes and dtypes, so
    a state_dict copies across. compute_dtype=torch.bfloat16 follows mok's rounding points;
    torch.float32 computes the experts in fp32 from the same (bf16) weights. split_k runs each bf16
    matmul in two halves of its inner dimension: the bf16 function again, another order of sums."""

    def __init__(self, hidden, intermediate, num_experts, topk, shared_intermediate=0, device=None,
                 compute_dtype=torch.bfloat16, split_k=False):
        super().__init__()
        self.split_k = split_k
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.topk, self.shared_intermediate = num_experts, topk, shared_intermediate
        self.compute_dtype = compute_dtype
        bf = dict(dtype=torch.bfloat16, device=device)
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=torch.float32)
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **bf))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **bf))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **bf))
        if shared_intermediate:
            self.s_gate = nn.Parameter(torch.empty(shared_intermediate, hidden, **bf))
            self.s_up = nn.Parameter(torch.empty(shared_intermediate, hidden, **bf))
            self.s_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **bf))
        else:
            self.s_gate = self.s_up = self.s_down = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """mok.torch.MoE's initialisation (uniform in +-1/sqrt(fan_in)); a copied state_dict replaces it."""
        self.router.reset_parameters()
        for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden), (self.w_down, self.intermediate),
                          (self.s_gate, self.hidden), (self.s_up, self.hidden), (self.s_down, self.shared_intermediate)):
            if w is not None:
                w.copy_(torch.empty(w.shape, dtype=torch.float32, device=w.device).uniform_(-fan_in ** -0.5,
                                                                                               fan_in ** -0.5))

    def route(self, x):
        logits = F.linear(x.float(), self.router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.hidden)
        T = flat.shape[0]
        ids, rw = self.route(flat)
        # x goes in as bf16 and dx comes out as bf16, as through mok.torch.MoE: autograd sums the
        # parts of dx (shared, then the gathered rows') in fp32 on xc and rounds the sum once, at
        # the cast (mok: fp32 sum of bf16 parts, rounded once). In the fp32 twin both casts are
        # no-ops.
        xc = flat.to(self.compute_dtype).float()
        cd = self.compute_dtype
        y = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        if self.s_gate is not None:
            y = y + ExpertFFN.apply(xc, self.s_gate, self.s_up, self.s_down, cd, self.split_k)[0]
        # Rows sorted by expert, one matmul chain per expert, back to (token, slot) order, then the
        # weighted fp32 sum in slot order (mok's order).
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        rows = xc[order // self.topk]
        outs = [ExpertFFN.apply(chunk, self.w_gate[e], self.w_up[e], self.w_down[e], cd, self.split_k)
                for e, chunk in enumerate(rows.split(counts)) if counts[e]]
        back = torch.argsort(order)
        out = torch.cat([o for o, _ in outs])[back].view(T, self.topk, self.hidden)
        # d_router_w[t, j] = <dy[t], FFN_e(x[t])> with the expert output before its bf16 rounding
        # (mok.h): the product's value uses the rounded output, its router-weight gradient the
        # unrounded one (zero in value: rw - rw.detach()).
        exact = torch.cat([e for _, e in outs])[back].view(T, self.topk, self.hidden)
        rw3 = rw.unsqueeze(-1)
        contrib = out * rw3.detach() + exact * (rw3 - rw3.detach())
        for j in range(self.topk):
            y = y + contrib[:, j]
        if self.compute_dtype != torch.float32:
            y = y.to(self.compute_dtype)
        return y.to(x.dtype).reshape(*lead, self.hidden)


# ---- the model -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads, max_len):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)  # learned absolute positions, per block

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x + self.pos[:L]).split(D, dim=-1)
        q, k, v = (t.view(B, L, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, dim, heads, max_len, moe):
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim), Attention(dim, heads, max_len)
        self.norm2, self.moe = RMSNorm(dim), moe

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoETransformer(nn.Module):
    def __init__(self, vocab, dim, heads, blocks, max_len, make_moe):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, max_len, make_moe()) for _ in range(blocks))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


# ---- training --------------------------------------------------------------------------------------


def make_optimizer(model, lr, weight_decay):
    # No weight decay on norms and embeddings; the same groups for every model.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed" in name or name.endswith(".pos") else decay).append(p)
    # foreach=False: the plain per-parameter loop, the same arithmetic for fp32 and bf16 parameters.
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), foreach=False)


def lr_at(step, base, warmup, total):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model, inputs, targets):
    """The next-token cross-entropy of a batch (fp32), the one loss every model here trains on."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def train_step(model, opt, inputs, targets, lr, clip):
    for group in opt.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, inputs, targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item(), grad_norm.item()


def first_step_check(model_mok, model_torch, inputs, targets):
    """Same weights, same batch: how far apart are the two MoE layers' outputs and the gradients
    before any training? Returns a dict of relative differences (|a - b|_max / max(|a|_max, |b|_max));
    gradients that are zero up to rounding on both sides are left out."""
    out = {}
    x = model_mok.embed(inputs).detach()
    b0_mok, b0_torch = model_mok.blocks[0], model_torch.blocks[0]
    h = b0_mok.norm2(x + b0_mok.attn(b0_mok.norm1(x))).detach()
    hs = [h.clone().requires_grad_(True) for _ in range(2)]
    y_mok, y_torch = b0_mok.moe(hs[0]), b0_torch.moe(hs[1])
    out["moe0_y"] = ((y_mok - y_torch).abs().max() / y_torch.abs().max()).item()
    dy = torch.randn(y_mok.shape, generator=torch.Generator().manual_seed(11)).to(h.device)
    y_mok.backward(dy)
    y_torch.backward(dy)
    # dx: the MoE's part (bf16 on both sides) plus the router's (fp32)
    out["moe0_dx"] = ((hs[0].grad - hs[1].grad).abs().max() / hs[1].grad.abs().max()).item()
    for m in (model_mok, model_torch):
        m.zero_grad(set_to_none=True)
        lm_loss(m, inputs, targets).backward()
    worst = (None, 0.0)
    for (name, pa), (_, pb) in zip(model_mok.named_parameters(), model_torch.named_parameters()):
        if pa.grad is None or pb.grad is None:
            continue
        scale = max(pa.grad.float().abs().max().item(), pb.grad.float().abs().max().item())
        if scale < 1e-8:  # a gradient that is zero up to rounding (the router with top-1: weights are all 1)
            continue
        d = (pa.grad.float() - pb.grad.float()).abs().max().item() / scale
        if "moe" in name:
            key = "grad_" + name.split("moe.")[-1].split(".")[0]
            out[key] = max(out.get(key, 0.0), d)
        if d > worst[1]:
            worst = (name, d)
    out["worst_param"], out["worst_grad"] = worst
    for m in (model_mok, model_torch):
        m.zero_grad(set_to_none=True)
    return out


# What the same-weights check allows: mok against the twin on the twin's weights of that step, so
# that no difference carries over from earlier steps. The loss and, per parameter, the gradient's
# norm-relative difference ||g_mok - g_twin|| / max(||g_mok||, ||g_twin||); the worst of the MoE's parameters and
# the worst of the rest (attention, norms, head: a different dx out of the MoE shows there). Both
# sides round at the same points, so what is left is the order of fp32 sums (a bf16 value a step
# apart here and there) and the routing of tokens whose top-k probabilities tie to rounding.
SAME_WEIGHTS_LIMITS = {"loss": 1e-4, "moe": 1e-2, "other": 1e-2}


def same_weights_check(model_mok, model_torch, inputs, targets):
    """One batch through both models, which hold the same weights: {"loss": relative difference,
    "moe" / "other": the worst norm-relative gradient difference, "worst": that parameter's name}.
    A parameter with a gradient on one side only counts as a difference of 1."""
    losses, grads = [], []
    for m in (model_mok, model_torch):
        m.zero_grad(set_to_none=True)
        loss = lm_loss(m, inputs, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().float().clone() for n, p in m.named_parameters() if p.grad is not None})
        m.zero_grad(set_to_none=True)
    out = {"loss": abs(losses[0] - losses[1]) / abs(losses[1]), "moe": 0.0, "other": 0.0, "worst": None}
    worst = 0.0
    for name in sorted(set(grads[0]) | set(grads[1])):
        ga, gb = grads[0].get(name), grads[1].get(name)
        if ga is None or gb is None:
            d = 1.0
        else:
            scale = max(ga.norm().item(), gb.norm().item())
            if scale < 1e-12:  # zero on both sides (the router with top-1)
                continue
            d = (ga - gb).norm().item() / scale
        key = "moe" if ".moe." in name else "other"
        out[key] = max(out[key], d)
        if d > worst:
            worst, out["worst"] = d, name
    return out


def same_weights_ok(check):
    return all(check[k] < lim for k, lim in SAME_WEIGHTS_LIMITS.items())


def fp8_refusal(backend, device):
    """Why mok's backend refuses FP8 workspaces (the library's words), or None when it runs them:
    asked of the library itself on a one-rank layer, before any model is made."""
    group = mok.Group.create_local(1, backend=backend,
                                   devices=[device.index or 0] if backend == "cuda" else None)
    try:
        mok.Workspace(group, 128, 128, 1, 1, max_tokens=1, precision="fp8").close()
    except mok.UnsupportedError as err:
        message = err.message or str(err)
        return message.split(": ", 1)[1] if message.startswith("shape.precision: ") else message
    finally:
        group.close()
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: mok's cpu backend; cuda: its cuda backend (both models on that device)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128, help="model width H (a multiple of 64)")
    ap.add_argument("--intermediate", type=int, default=128, help="routed expert's I (a multiple of 64)")
    ap.add_argument("--shared", type=int, default=128, help="shared expert's I_s (multiple of 64; 0 = none)")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--branch", type=int, default=2, help="next tokens each context of the language allows")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=0,
                    help="mok cpu backend: worker threads (0 = the library's default, the machine's cores)")
    ap.add_argument("--noise-ref", action=argparse.BooleanOptionalAction, default=True,
                    help="also train two yardsticks for bf16 noise: the twin with split-K matmuls (another "
                         "sum order) and the twin with an fp32 MoE (default on)")
    ap.add_argument("--threshold", type=float, default=0.02,
                    help="with --no-noise-ref, 'within bf16 noise': mean and last-quarter mean |rel diff| "
                         "both below this")
    ap.add_argument("--check-every", type=int, default=50,
                    help="every this many steps (and at the last), mok on the twin's weights of that step "
                         "against the twin (0: never)")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: also train mok's layer in FP8 from the same weights on the same batches and compare "
                         "its loss curve with mok's bf16 curve (H, I and I_s multiples of 128)")
    ap.add_argument("--fp8-bar", type=float, default=0.005,
                    help="with --precision fp8: the largest mean relative gap of the FP8 loss curve to the bf16 one "
                         "over the last quarter that passes (default 0.5%%)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default="build/train_moe")
    a = ap.parse_args()

    if a.device == "cuda" and not (torch.cuda.is_available() and mok.backend_available("cuda") >= 1):
        sys.exit("--device cuda: needs a GPU and a CUDA build of libmok (mok.backend_available('cuda') == 0)")
    fp8 = a.precision == "fp8"
    if fp8:
        for name, value in (("--hidden", a.hidden), ("--intermediate", a.intermediate), ("--shared", a.shared)):
            if value % 128:
                sys.exit(f"{name} {value}: --precision fp8 needs a multiple of 128 (FP8's blocks)")
    device = torch.device(a.device)
    os.makedirs(a.out, exist_ok=True)
    tokens_per_step = a.batch * a.seq
    config = mok.Config(cpu_threads=a.cpu_threads) if a.cpu_threads else None
    lang = MarkovLanguage(a.vocab, a.branch, a.seed)

    def mok_moe(precision="bf16"):
        return mok.torch.MoE(a.hidden, a.intermediate, a.experts, a.topk, a.shared, config=config,
                             backend=a.device, max_tokens=tokens_per_step, device=device, precision=precision)

    if fp8:
        reason = fp8_refusal(a.device, device)
        if reason:
            sys.exit(f"--device {a.device} --precision fp8: mok's {a.device} backend does not run FP8 layers: "
                     f"{reason}; --device cpu trains the FP8 layer")

    def torch_moe(dtype, split_k=False):
        return lambda: TorchMoE(a.hidden, a.intermediate, a.experts, a.topk, a.shared, device=device,
                                compute_dtype=dtype, split_k=split_k)

    torch.manual_seed(a.seed)
    model_mok = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq, mok_moe).to(device)
    models = {"mok": model_mok}
    models["torch"] = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq, torch_moe(torch.bfloat16)).to(device)
    if a.noise_ref:
        models["order"] = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq,
                                         torch_moe(torch.bfloat16, split_k=True)).to(device)
        models["fp32"] = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq, torch_moe(torch.float32)).to(device)
    # mok's layer on the twin's weights, for the same-weights checks along the run
    shadow = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq, mok_moe).to(device) if a.check_every else None
    shadow_fp8 = None
    if fp8:  # made last: the models above draw nothing from the random state after it
        models["mok_fp8"] = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq,
                                           lambda: mok_moe("fp8")).to(device)
        # the FP8 layer on mok's bf16 weights of that step, for the FP8 same-weights checks
        if a.check_every:
            shadow_fp8 = MoETransformer(a.vocab, a.hidden, a.heads, a.blocks, a.seq, lambda: mok_moe("fp8")).to(device)
    state = model_mok.state_dict()
    for name, m in models.items():
        if m is not model_mok:
            m.load_state_dict(state)  # every parameter, the MoE's bf16 weights bitwise
    n_params = sum(p.numel() for p in model_mok.parameters())
    n_moe = sum(p.numel() for n, p in model_mok.named_parameters() if ".moe." in n)
    print(f"model: {a.blocks} blocks, H={a.hidden}, {a.heads} heads, E={a.experts}, k={a.topk}, I={a.intermediate}, "
          f"I_s={a.shared}; {n_params / 1e6:.2f}M parameters ({n_moe / 1e6:.2f}M in the MoE); "
          f"{tokens_per_step} tokens per step; device {a.device}; torch threads {torch.get_num_threads()}")
    print(f"data: order-2 Markov chain, vocab {a.vocab}, {a.branch} next tokens per context; "
          f"uniform loss {math.log(a.vocab):.3f}, entropy rate (the floor) {lang.entropy_rate:.3f}")

    inputs, targets = lang.batch(0, a.batch, a.seq, a.seed)
    check = first_step_check(model_mok, models["torch"], inputs.to(device), targets.to(device))
    print("step-0 check, same weights (max rel diff mok vs torch): " +
          ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in check.items()))

    opts = {name: make_optimizer(m, a.lr, a.weight_decay) for name, m in models.items()}
    rows, times = [], {name: 0.0 for name in models}
    checks, fp8_checks = [], []
    names = list(models)
    for step in range(a.steps):
        inputs, targets = lang.batch(step, a.batch, a.seq, a.seed)
        inputs, targets = inputs.to(device), targets.to(device)
        lr = lr_at(step, a.lr, a.warmup, a.steps)
        if shadow is not None and (step % a.check_every == 0 or step == a.steps - 1):
            shadow.load_state_dict(models["torch"].state_dict())
            c = same_weights_check(shadow, models["torch"], inputs, targets)
            checks.append((step, c))
            print(f"step {step:4d}  same weights (the twin's): loss {c['loss']:.1e}, gradients: MoE {c['moe']:.1e}, "
                  f"other {c['other']:.1e} (worst {c['worst']})  {'ok' if same_weights_ok(c) else 'OVER THE LIMIT'}",
                  flush=True)
        if shadow_fp8 is not None and (step % a.check_every == 0 or step == a.steps - 1):
            shadow_fp8.load_state_dict(model_mok.state_dict())
            c = same_weights_check(shadow_fp8, model_mok, inputs, targets)
            fp8_checks.append((step, c))
            print(f"step {step:4d}  same weights (mok's), FP8 against bf16: loss {c['loss']:.1e}, gradients: MoE "
                  f"{c['moe']:.1e}, other {c['other']:.1e} (worst {c['worst']})", flush=True)
        row = {"step": step, "lr": lr}
        for name in names:
            t0 = time.perf_counter()
            loss, gnorm = train_step(models[name], opts[name], inputs, targets, lr, a.clip)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name] += time.perf_counter() - t0
            if not math.isfinite(loss):
                sys.exit(f"step {step}: {name} loss is {loss}")
            row[f"loss_{name}"], row[f"gnorm_{name}"] = loss, gnorm
        rows.append(row)
        if step % a.log_every == 0 or step == a.steps - 1:
            extra = f"  order {row['loss_order']:.4f}  fp32 {row['loss_fp32']:.4f}" if a.noise_ref else ""
            extra += f"  fp8 {row['loss_mok_fp8']:.4f}" if fp8 else ""
            print(f"step {step:4d}  lr {lr:.2e}  mok {row['loss_mok']:.4f}  torch {row['loss_torch']:.4f}  "
                  f"|diff| {abs(row['loss_mok'] - row['loss_torch']):.4f}{extra}  "
                  f"gnorm mok {row['gnorm_mok']:.3f} torch {row['gnorm_torch']:.3f}", flush=True)

    # ---- the verdict --------------------------------------------------------------------------
    def stats(key_a, key_b):
        ad = [abs(r[key_a] - r[key_b]) for r in rows]
        rd = [d / abs(r[key_b]) for d, r in zip(ad, rows)]
        q = max(1, len(rows) // 4)
        # Trend: least-squares slope of |rel diff| against step, per 100 steps.
        n = len(rd)
        xm, ym = (n - 1) / 2, sum(rd) / n
        var = sum((i - xm) ** 2 for i in range(n))
        slope = sum((i - xm) * (v - ym) for i, v in enumerate(rd)) / var * 100 if var else 0.0
        return dict(max_abs=max(ad), mean_abs=sum(ad) / n, last_q_abs=sum(ad[-q:]) / q, max_rel=max(rd),
                    mean_rel=ym, first_q_rel=sum(rd[:q]) / q, last_q_rel=sum(rd[-q:]) / q,
                    slope_rel_per_100=slope)

    s = stats("loss_mok", "loss_torch")
    first, last = rows[0], rows[-1]
    print()
    print(f"loss, step 0 -> {a.steps - 1}: mok {first['loss_mok']:.4f} -> {last['loss_mok']:.4f}, "
          f"torch {first['loss_torch']:.4f} -> {last['loss_torch']:.4f} (floor {lang.entropy_rate:.4f})")
    print(f"|loss_mok - loss_torch|: max {s['max_abs']:.5f}, mean {s['mean_abs']:.5f}; relative: max "
          f"{s['max_rel']:.3%}, mean {s['mean_rel']:.3%}, first quarter {s['first_q_rel']:.3%}, last quarter "
          f"{s['last_q_rel']:.3%}, trend {s['slope_rel_per_100']:+.3%} per 100 steps")
    if a.noise_ref:
        # The yardsticks: the twin against itself with another fp32 sum order (what mok differs by)
        # and against its fp32 MoE (bf16 rounding itself). A run passes through a sharp drop of the
        # loss whose timing any perturbation moves, so each pair of curves ends up ~1-2% apart
        # whatever the perturbation's size: the bar is relative to the pairs measured in this run.
        refs = {"twin with split-K matmuls": stats("loss_order", "loss_torch"),
                "twin with fp32 MoE": stats("loss_fp32", "loss_torch")}
        for label, n in refs.items():
            print(f"yardstick |twin - {label}|: max {n['max_abs']:.5f}, mean {n['mean_abs']:.5f}; "
                  f"relative mean {n['mean_rel']:.3%}, last quarter {n['last_q_rel']:.3%}")
        noise = sum(n["mean_abs"] for n in refs.values()) / len(refs)
        noise_last = sum(n["last_q_abs"] for n in refs.values()) / len(refs)
        ratio, ratio_last = s["mean_abs"] / max(noise, 1e-12), s["last_q_abs"] / max(noise_last, 1e-12)
        print(f"|mok - twin| / the yardsticks' mean: {ratio:.2f} over the run, {ratio_last:.2f} over its last quarter")
        agree = ratio < 2.0 and ratio_last < 2.0
        rule = "mean |mok - twin| below 2x the yardsticks' mean, over the run and over its last quarter"
    else:
        agree = s["mean_rel"] < a.threshold and s["last_q_rel"] < a.threshold
        rule = f"mean and last-quarter mean relative difference < {a.threshold:.1%}"
    if checks:
        bad = [st for st, c in checks if not same_weights_ok(c)]
        worst = {k: max(c[k] for _, c in checks) for k in SAME_WEIGHTS_LIMITS}
        print(f"same weights, {len(checks)} checks: worst loss {worst['loss']:.1e}, MoE gradient {worst['moe']:.1e}, "
              f"other gradient {worst['other']:.1e} (limits {SAME_WEIGHTS_LIMITS['loss']:.0e} / "
              f"{SAME_WEIGHTS_LIMITS['moe']:.0e} / {SAME_WEIGHTS_LIMITS['other']:.0e})"
              + (f"; over at steps {bad}" if bad else ""))
        agree = agree and not bad
        rule += "; every same-weights check within its limits"
    print(f"within bf16 noise ({rule}): {'yes' if agree else 'NO'}")
    fp8_ok = True
    if fp8:
        f = stats("loss_mok_fp8", "loss_mok")
        counts = [b.moe.fp8_quantizations for b in models["mok_fp8"].blocks]
        print(f"FP8: loss step 0 -> {a.steps - 1}: {first['loss_mok_fp8']:.4f} -> {last['loss_mok_fp8']:.4f}; "
              f"|loss_fp8 - loss_mok| / loss_mok: mean {f['mean_rel']:.3%}, max {f['max_rel']:.3%}, first quarter "
              f"{f['first_q_rel']:.3%}, last quarter {f['last_q_rel']:.3%} (for scale, bf16 mok against its twin: "
              f"{s['last_q_rel']:.3%} over the last quarter)")
        print(f"FP8: weights quantized {counts} times per layer over {a.steps} steps (once per optimizer step)")
        if fp8_checks:  # the FP8 layer's own error, which free-running curves bury under their drift
            losses = [c["loss"] for _, c in fp8_checks]
            print(f"FP8 on mok's bf16 weights, {len(fp8_checks)} checks: loss relative difference mean "
                  f"{sum(losses) / len(losses):.2e}, worst {max(losses):.2e}; gradients (norm-relative) worst MoE "
                  f"{max(c['moe'] for _, c in fp8_checks):.2e}, other {max(c['other'] for _, c in fp8_checks):.2e}")
        fp8_ok = f["last_q_rel"] <= a.fp8_bar
        print(f"FP8 within {a.fp8_bar:.1%} of bf16 (mean relative gap over the last quarter): "
              f"{'yes' if fp8_ok else 'NO'}")
    print("time per step: " + ", ".join(f"{k} {v / a.steps * 1e3:.1f} ms" for k, v in times.items()))
    ok = agree and fp8_ok

    csv_path = os.path.join(a.out, "losses.csv")
    keys = ["step", "lr"] + [f"loss_{n}" for n in names] + [f"gnorm_{n}" for n in names]
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for r in rows:
            w.writerow([r["step"], f"{r['lr']:.6g}"] + [f"{r[k]:.6f}" for k in keys[2:]])
    print(f"wrote {csv_path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot (pip install matplotlib)")
        return 0 if ok else 1
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, [r["loss_mok"] for r in rows], label="mok (mok.torch.MoE)", lw=1.4)
    ax.plot(steps, [r["loss_torch"] for r in rows], label="PyTorch twin (bf16)", lw=1.0, ls="--")
    if a.noise_ref:
        ax.plot(steps, [r["loss_order"] for r in rows], label="PyTorch twin (split-K matmuls)", lw=0.8, ls="-.")
        ax.plot(steps, [r["loss_fp32"] for r in rows], label="PyTorch twin (fp32 MoE)", lw=0.8, ls=":")
    if fp8:
        ax.plot(steps, [r["loss_mok_fp8"] for r in rows], label="mok in FP8", lw=1.0)
    ax.axhline(lang.entropy_rate, color="gray", lw=0.8, ls="-.", label=f"entropy rate {lang.entropy_rate:.3f}")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(f"MoE transformer, {a.blocks} blocks, E={a.experts} k={a.topk} H={a.hidden} I_s={a.shared}, "
                 f"{a.device}")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, [100 * abs(r["loss_mok"] - r["loss_torch"]) / r["loss_torch"] for r in rows], lw=0.8,
             label="|mok - twin| / twin")
    if a.noise_ref:
        ax2.plot(steps, [100 * abs(r["loss_order"] - r["loss_torch"]) / r["loss_torch"] for r in rows], lw=0.8,
                 label="|twin (split-K) - twin| / twin", alpha=0.7)
        ax2.plot(steps, [100 * abs(r["loss_fp32"] - r["loss_torch"]) / r["loss_torch"] for r in rows], lw=0.8,
                 label="|twin (fp32 MoE) - twin| / twin", alpha=0.7)
    if fp8:
        ax2.plot(steps, [100 * abs(r["loss_mok_fp8"] - r["loss_mok"]) / r["loss_mok"] for r in rows], lw=0.8,
                 label="|mok FP8 - mok| / mok")
    ax2.set_ylabel("rel. diff (%)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(a.out, "losses.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
