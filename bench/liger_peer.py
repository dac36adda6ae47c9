"""LigerCute (LinkedIn's fused expert-parallel MoE for Hopper) on one case of the benchmark, in a
process of its own (one per GPU across GPUs), printing one JSON line.

    bench/liger-env.sh SITE python3 bench/liger_peer.py --layer mixtral-8x7b --experts 8 --tokens 8192
    bench/liger-env.sh SITE python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        bench/liger_peer.py --ranks 2 --layer deepseek-v3 --experts 256 --tokens 8192

LigerCute takes top-k ids and weights and runs the routed experts only (no shared expert, no
router), so it is compared with mok's routed-only layer on the same inputs (bench.make_inputs with
the shared expert left out). Its NVSHMEM heap is sized by `configure` once per process and cannot
grow, hence one process per case: each case's memory is its own. The environment it needs (its
NVSHMEM host library preloaded, its CUDA 12 runtime on the library path) is bench/liger-env.sh's.

Timed, CUDA-event medians after a warm-up (and --preheat seconds of the same work, as bench.py's):
  forward_nograd_ms  the forward under torch.no_grad() (inference: nothing kept for a backward);
  forward_ms         the forward as a training step runs it (autograd on, intermediates kept), each
                     queued behind the previous step's backward, whose launches the host has made:
                     the forward's host work overlaps GPU work (bench.py's time_in_step times
                     mok's forward so for the ratio);
  forward_backward_ms forward + backward of every input that has a gradient (x, the router weights,
                     the three expert weights).
memory_bytes: the most device memory the case held beyond its inputs (the allocator's peak plus
memory outside it, such as the NVSHMEM heap), as bench.py measures mok's.

Across P GPUs (--ranks P, one process each under torch.distributed.run) every rank takes its own
inputs of bench.make_inputs for P ranks (the same as mok's ranks: rank r's local experts, tokens
and routing; the generators give the same values on any GPU), its local experts' weights and
global expert ids, and LigerCute's EP group is the whole world (pg=None). Each time and the memory
are the largest over the ranks, and the error compares each rank's y with PyTorch's layer over all
P ranks' experts; rank 0 prints the line.
"""
import argparse
import json
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import baselines as B  # noqa: E402
import layers as LY  # noqa: E402
import memory as M  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", required=True, choices=sorted(LY.LAYERS))
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ranks", type=int, default=1, help="GPUs, one process each (torch.distributed.run)")
    B.add_state_args(ap)
    a = ap.parse_args()
    B.PREHEAT_S, B.SETTLE_S = a.preheat, a.settle

    import torch.distributed as dist
    from liger_cute_kernels import MoEConfig, configure
    from liger_kernel.ops.cute.ops.moe import moe_fused

    layer = dict(LY.LAYERS[a.layer], shared=0)
    H, I, k, E, T, P = layer["hidden"], layer["inter"], layer["topk"], a.experts, a.tokens, a.ranks
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) != P:
        sys.exit(f"liger_peer: --ranks {P} needs {P} processes (torch.distributed.run --nproc_per_node {P})")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl", rank=rank, world_size=P, device_id=dev)

    # the same inputs as mok's rows of the table: every rank's, made here, this rank's kept
    every = B.make_inputs(layer, E, T, [dev] * P, a.skew, a.seed)
    i = every[rank]
    w = i["w"]
    # PyTorch's layer over all P ranks' experts (the ids are global), before the other ranks'
    # inputs are let go
    experts_all = w if P == 1 else {n: torch.cat([q["w"][n] for q in every]) for n in ("w_gate", "w_up", "w_down")}
    y_ref = B.forward_single(i["x"], i["ids"], i["rw"], experts_all)
    del experts_all
    del every
    torch.cuda.empty_cache()
    ids = i["ids"].to(torch.int32)
    rw_bf16 = i["rw"].to(torch.bfloat16)  # LigerCute takes bf16 router weights
    torch.cuda.synchronize()

    # the autograd leaves are the inputs (no second copy), as mok's passes read the caller's tensors
    leaves = dict(x=i["x"], rw=rw_bf16, w_gate=w["w_gate"], w_up=w["w_up"], w_down=w["w_down"])
    leaves = {n: t.requires_grad_(True) for n, t in leaves.items()}
    before = M.snapshot()
    M.reset_peak()
    configure(device=dev, moe=MoEConfig(max_tokens=T, hidden_size=H, num_experts=E, top_k=k, num_hosts=1,
                                        gpus_per_host=P))
    out = dict(peer="ligercute", layer=a.layer, experts=E, tokens=T, skew=a.skew, ranks=P)

    with torch.no_grad():
        y = moe_fused(i["x"], ids, rw_bf16, w["w_gate"], w["w_up"], w["w_down"], E, k, pg=None)
    out["max_rel_err_vs_torch"] = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()

    windows = {}  # each time's clock window (bench/baselines.py, LAST_WINDOW), for bench.py --clocks
    with torch.no_grad():
        out["forward_nograd_ms"] = B.time_cuda(
            lambda: moe_fused(i["x"], ids, rw_bf16, w["w_gate"], w["w_up"], w["w_down"], E, k, pg=None),
            reps=a.reps)
    windows["forward_nograd_ms"] = B.LAST_WINDOW[0]

    def forward():
        return moe_fused(leaves["x"], ids, leaves["rw"], leaves["w_gate"], leaves["w_up"], leaves["w_down"], E, k,
                         pg=None)

    def forward_backward():
        torch.autograd.grad(forward(), list(leaves.values()), i["dy"])

    # A training forward keeps its intermediates until its backward: time it paired with a
    # backward outside the timed region, so the symmetric stack does not grow.
    B.ready(forward_backward, torch.cuda.synchronize, 1)
    B.window_start()
    times = []
    for rep in range(a.reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y = forward()
        e.record()
        torch.autograd.grad(y, list(leaves.values()), i["dy"])
        e.synchronize()
        if rep >= 3:
            times.append(s.elapsed_time(e))
    windows["forward_ms"] = B.window_end()
    times.sort()
    out["forward_ms"] = times[len(times) // 2]
    out["forward_backward_ms"] = B.time_cuda(forward_backward, reps=max(3, a.reps // 2))
    windows["forward_backward_ms"] = B.LAST_WINDOW[0]
    out["clock_windows"] = windows
    out["memory_bytes"] = M.held_since(before)
    keys = ("max_rel_err_vs_torch", "forward_nograd_ms", "forward_ms", "forward_backward_ms", "memory_bytes")
    if P > 1:  # the slowest rank's times, the most memory any rank held, the largest error
        worst = torch.tensor([float(out[key]) for key in keys], dtype=torch.float64, device=dev)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out.update({key: v for key, v in zip(keys, worst.tolist())})
        out["memory_bytes"] = int(out["memory_bytes"])
    flops = B.flops_forward(T, k, H, I, 0)
    out["forward_tflops"] = flops / out["forward_ms"] / 1e9
    out["forward_backward_tflops"] = 3 * flops / out["forward_backward_ms"] / 1e9
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
