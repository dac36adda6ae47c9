#!/usr/bin/env bash
# trace-cost.sh [ROUNDS] — on a GPU machine: what tracing off costs. Builds the library twice
# (build/: the default, config.trace = 0 at run time; build-notrace/: NO_TRACE=1, the trace's
# code compiled out), then times the EP1 benchmark with each, alternating ROUNDS times (default
# 2) so that drift falls on both. Logs to $OUT (or build/trace-cost). Prints the mok rows of each.
set -u
cd "$(dirname "$0")/.."
rounds=${1:-2}
out=${OUT:-build/trace-cost}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/python
nh=$(bash scripts/nccl-home.sh)
args=(CUDA=1)
[ -n "$nh" ] && args+=(NCCL_HOME="$nh")
make -j"$(nproc)" "${args[@]}" all >"$out/build.log" 2>&1 &
make -j"$(nproc)" "${args[@]}" NO_TRACE=1 BUILD=build-notrace all >"$out/build-notrace.log" 2>&1 &
wait
for r in $(seq "$rounds"); do
    for b in build build-notrace; do
        MOK_LIBRARY=$PWD/$b/libmok.so timeout 200 python3 bench/bench.py --ranks 1 --no-sweep --reps 8 \
            --out "/tmp/trace-cost-$b" >"$out/$b-$r.txt" 2>&1
        grep -E "^(deepseek|qwen)" "$out/$b-$r.txt" | cut -c1-110 | sed "s|^|$b round $r: |"
    done
done
