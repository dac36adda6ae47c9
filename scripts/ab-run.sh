#!/usr/bin/env bash
# ab-run.sh [--tests] [--ep2] [--trace] — on a GPU machine, after scripts/ab-export.sh: builds
# the checkout and every tree under ab/, then for each (checkout first): with --tests the quick
# GPU tests (MOK_TEST_NO_FULL=1 ./build/mok_tests cuda_), the EP1 benchmark beside PyTorch
# (bench.py --ranks 1 --no-sweep), with --ep2 the EP2 benchmark, with --trace the per-kind
# trace summary. Logs go to $OUT (or build/ab); the table at the end has one row per tree and
# case. Keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-build/ab}
mkdir -p "$out"
tests=0 ep2=0 trace=0
for a in "$@"; do
    case $a in
    --tests) tests=1 ;;
    --ep2) ep2=1 ;;
    --trace) trace=1 ;;
    *) echo "ab-run: unknown option $a" >&2; exit 2 ;;
    esac
done
nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
args=(CUDA=1)
[ -n "$nccl" ] && args+=(NCCL_HOME="$nccl")
trees=(.)
for d in ab/*/; do [ -d "$d" ] && trees+=("${d%/}"); done
for t in "${trees[@]}"; do # build side by side
    (cd "$t" && mkdir -p build && make -j"$(nproc)" "${args[@]}" all build/mok_tests >build/ab-build.log 2>&1 ||
        echo "ab-run: build failed in $t (see $t/build/ab-build.log)") &
done
wait
for t in "${trees[@]}"; do
    name=$(echo "$t" | tr '/.' '__')
    log=$out/ab$name.txt
    : >"$log"
    (
        cd "$t" || exit 1
        export MOK_LIBRARY=$PWD/build/libmok.so PYTHONPATH=$PWD/python
        [ $tests -eq 1 ] && MOK_TEST_NO_FULL=1 timeout 300 ./build/mok_tests cuda_ 2>&1 | grep -E "^(FAIL|PASS)|passed,"
        timeout 300 python3 bench/bench.py --ranks 1 --no-sweep --reps 8 --out "/tmp/ab$name" 2>&1 | grep -A6 "^layer"
        [ $ep2 -eq 1 ] && timeout 300 python3 bench/bench.py --ranks 2 --no-sweep --reps 5 \
            --only deepseek-v3,qwen3-30b-a3b --out "/tmp/ab$name" 2>&1 | grep -A6 "^layer"
        [ $trace -eq 1 ] && timeout 200 python3 bench/bench.py --ranks 1 --no-sweep --reps 2 --trace \
            --trace-dir "/tmp/ab$name-tr" --out "/tmp/ab$name" 2>&1 | grep -E "^trace|rank 0 compute"
    ) >>"$log" 2>&1
    echo "==== $t ($(grep -h "passed," "$log" | tail -1))"
    grep -E "^(deepseek|qwen)" "$log" | cut -c1-150
done
