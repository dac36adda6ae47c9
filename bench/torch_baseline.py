"""Times the PyTorch baselines of bench/baselines.py and prints one JSON line per case.

    python3 bench/torch_baseline.py --hidden 7168 --inter 2048 --experts 32 --topk 8 \
        --shared 2048 --tokens 8192 [--skew 0] [--backward]
    torchrun --nproc-per-node 2 bench/torch_baseline.py ... --experts 256   # NCCL all-to-all
    python3 bench/torch_baseline.py --layer glm-5.2 --experts 8 --tokens 2048   # dims from bench/layers.py

With several processes, --experts is the global count (E / P per GPU) and --tokens per GPU.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines as B  # noqa: E402
import layers as LY  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="")
    ap.add_argument("--layer", choices=sorted(LY.LAYERS), help="take H, I, top-k and I_s from bench/layers.py")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--inter", type=int)
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--shared", type=int)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--backward", action="store_true")
    B.add_state_args(ap)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    B.PREHEAT_S, B.SETTLE_S = a.preheat, a.settle
    if a.layer:
        d = LY.LAYERS[a.layer]
        a.name = a.name or a.layer
        a.hidden = a.hidden or d["hidden"]
        a.inter = a.inter or d["inter"]
        a.topk = a.topk or d["topk"]
        a.shared = d["shared"] if a.shared is None else a.shared
    if not (a.hidden and a.inter and a.topk):
        ap.error("give --layer, or --hidden, --inter and --topk")
    a.shared = a.shared or 0

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(rank)
    else:
        rank, world = 0, 1
    dev = torch.device("cuda", torch.cuda.current_device())
    E_local = a.experts // world
    layer = B.make_layer(a.hidden, a.inter, E_local, a.shared, dev, seed=100 + rank)
    ids, w = B.route(a.tokens, a.experts, a.topk, a.skew, dev, seed=200 + rank)
    x = (torch.rand(a.tokens, a.hidden, device=dev) * 2 - 1).to(torch.bfloat16)

    fwd = (lambda: B.forward_all_to_all(x, ids, w, layer)) if distributed else (lambda: B.forward_single(x, ids, w, layer))
    ms = B.time_cuda(fwd, reps=a.reps)
    result = {"name": a.name, "ranks": world, "experts": a.experts, "tokens": a.tokens, "skew": a.skew, "forward_ms": ms}
    flops = B.flops_forward(a.tokens, a.topk, a.hidden, a.inter, a.shared)
    result["forward_tflops"] = flops / ms / 1e9
    if a.backward:
        params = [t.requires_grad_(True) for t in layer.values()]
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        dy = torch.rand_like(x)

        def step():
            y = B.forward_all_to_all(xg, ids, wg, layer) if distributed else B.forward_single(xg, ids, wg, layer)
            torch.autograd.grad(y, [xg, wg] + params, dy)

        ms2 = B.time_cuda(step, reps=max(5, a.reps // 2))
        result["forward_backward_ms"] = ms2
        result["forward_backward_tflops"] = 3 * flops / ms2 / 1e9
    if rank == 0:
        print(json.dumps(result), flush=True)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
