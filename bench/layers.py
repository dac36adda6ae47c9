"""The benchmark's layers and, per EP size, its cases: (layer, experts in total, tokens per GPU, skew).

    python3 bench/layers.py RANKS      # one case per line: name experts tokens skew (for bench/run.sh)

DeepSeek-V3 and Qwen3-30B-A3B are DESIGN §6's baselines; the four MoK benchmark layers run at the
per-GPU load of their 64-GPU run (E/64 experts per GPU, 2048 tokens per GPU) across GPUs, and on one
GPU Kimi K2.7, DeepSeek-V4-Pro and GLM-5.2 at an 8-GPU run's (E/8 experts, 8192 tokens), beside
DeepSeek-V3 at the same load; Mixtral-8x7B (few, wide experts, top-2) is the one-GPU case where
LigerCute's lead over mok was largest.
"""
import sys

LAYERS = {
    "deepseek-v3": dict(hidden=7168, inter=2048, topk=8, shared=2048, experts=256),
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, topk=8, shared=0, experts=128),
    "kimi-k2.7": dict(hidden=7168, inter=2048, topk=8, shared=2048, experts=384),
    "glm-5.2": dict(hidden=6144, inter=2048, topk=8, shared=2048, experts=256),
    "qwen3.5-397b-a17b": dict(hidden=4096, inter=1024, topk=10, shared=1024, experts=512),
    "deepseek-v4-pro": dict(hidden=7168, inter=3072, topk=6, shared=3072, experts=384),
    "mixtral-8x7b": dict(hidden=4096, inter=14336, topk=2, shared=0, experts=8),
}
MOK_LAYERS = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")


def cases(ranks):
    """The standard cases for an EP size."""
    if ranks == 1:
        wide = [(name, LAYERS[name]["experts"] // 8, 8192, 0.0) for name in ("kimi-k2.7", "deepseek-v4-pro", "glm-5.2")]
        return [("deepseek-v3", 32, 8192, 0.0), ("qwen3-30b-a3b", 128, 8192, 0.0), ("qwen3-30b-a3b", 128, 16384, 0.0),
                ("mixtral-8x7b", 8, 8192, 0.0)] + wide
    mok = [(name, LAYERS[name]["experts"] // 64 * ranks, 2048, 0.0) for name in MOK_LAYERS]
    if ranks == 2:
        return [("deepseek-v3", 256, 8192, 0.0), ("deepseek-v3", 256, 8192, 1.5), ("qwen3-30b-a3b", 128, 16384, 0.0),
                ("qwen3-30b-a3b", 128, 16384, 1.5)] + mok
    return [("deepseek-v3", 256, 4096, 0.0), ("deepseek-v3", 256, 8192, 0.0), ("deepseek-v3", 256, 8192, 1.5)] + mok


if __name__ == "__main__":
    for name, experts, tokens, skew in cases(int(sys.argv[1])):
        print(name, experts, tokens, skew)
