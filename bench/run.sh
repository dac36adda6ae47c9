#!/usr/bin/env bash
# run.sh OUT — the benchmark of docs/perf.md: mok on one and two GPUs with the in-process
# PyTorch baseline, and the NCCL all-to-all baseline under torchrun, in one run.
set -u
out=${1:-build/bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_LIBRARY=$PWD/build/libmok.so
ngpu=$(nvidia-smi -L | wc -l)
python3 bench/bench.py --ranks 1 --out "$out" --trace 2>&1 | tee "$out/bench_ep1.txt"
if [ "$ngpu" -ge 2 ]; then
    python3 bench/bench.py --ranks 2 --out "$out" --sweep-comm 16,32,48 --sweep-mb 2048 2>&1 | tee "$out/bench_ep2.txt"
    for skew in 0 1.5; do
        torchrun --nproc-per-node 2 bench/torch_baseline.py --name deepseek-v3 --hidden 7168 --inter 2048 \
            --experts 256 --topk 8 --shared 2048 --tokens 8192 --skew $skew --backward 2>&1 | grep '^{' | tee -a "$out/baseline_ep2.txt"
        torchrun --nproc-per-node 2 bench/torch_baseline.py --name qwen3-30b-a3b --hidden 2048 --inter 768 \
            --experts 128 --topk 8 --tokens 16384 --skew $skew --backward 2>&1 | grep '^{' | tee -a "$out/baseline_ep2.txt"
    done
fi
python3 bench/torch_baseline.py --name deepseek-v3 --hidden 7168 --inter 2048 --experts 32 --topk 8 --shared 2048 \
    --tokens 8192 --backward | tee -a "$out/baseline_ep1.txt"
python3 bench/torch_baseline.py --name qwen3-30b-a3b --hidden 2048 --inter 768 --experts 128 --topk 8 \
    --tokens 16384 --backward | tee -a "$out/baseline_ep1.txt"
