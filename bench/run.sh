#!/usr/bin/env bash
# run.sh OUT — the benchmark of docs/results.md, in one job: mok on 1 GPU (with the in-process
# PyTorch baseline, a sweep and traces), then on 2, 4 and 8 GPUs as the machine has them (with a
# comm-CTA sweep) beside the NCCL all-to-all baseline under torchrun, case by case
# (bench/layers.py), and the PyTorch autograd baselines on one GPU.
set -u
out=${1:-build/bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_LIBRARY=$PWD/build/libmok.so
ngpu=$(nvidia-smi -L | wc -l)
python3 bench/bench.py --ranks 1 --out "$out" --trace 2>&1 | tee "$out/bench_ep1.txt"
for P in 2 4 8; do
    [ "$ngpu" -ge $P ] || continue
    python3 bench/bench.py --ranks $P --out "$out" --sweep-comm 10,16,24,32 --sweep-mb 2048 2>&1 | tee "$out/bench_ep$P.txt"
    python3 bench/layers.py $P | while read -r name experts tokens skew; do
        torchrun --nproc-per-node $P bench/torch_baseline.py --layer "$name" --experts "$experts" --tokens "$tokens" \
            --skew "$skew" --backward 2>&1 | grep '^{' | tee -a "$out/baseline_ep$P.txt"
    done
done
python3 bench/layers.py 1 | while read -r name experts tokens skew; do
    python3 bench/torch_baseline.py --layer "$name" --experts "$experts" --tokens "$tokens" --skew "$skew" \
        --backward | tee -a "$out/baseline_ep1.txt"
done
