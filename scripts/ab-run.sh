#!/usr/bin/env bash
# ab-run.sh [--probe] [--tests] [--base-tests] [--no-base] [--ep2] [--trace] [--nccl] [--hash] [--fp8] [--clocks] [--env VAR=V,...]...
# [--config FIELD=V,...]... [--host] [--reps N] [--only LAYERS] [--rounds K] — on a GPU
# machine, after scripts/ab-export.sh:
# builds the checkout and every tree under ab/, then for each (checkout first): with --tests the
# quick GPU tests (MOK_TEST_NO_FULL=1 ./build/mok_tests cuda_; on the ab/ trees only, unless
# --base-tests: the checkout's GPU code is what gpu-check.sh tests), the EP1 benchmark beside PyTorch
# (bench.py --ranks 1 --no-sweep), with --ep2 the EP2 benchmark, with --trace the per-kind
# trace summary (EP1; with --ep2 also DeepSeek-V3 at EP2); with --nccl, once, the EP2 baseline (NCCL all-to-all + grouped GEMM under
# torchrun, forward and backward) for the DeepSeek-V3 and Qwen3 cases of bench/layers.py. Each
# --env adds a row per case to the EP1 and EP2 benchmarks with those variables set (bench.py
# --compare-env, one build); each --config FIELD=V,... likewise with config fields replaced
# (bench.py --compare-config); on even rounds those rows run before the defaults' row
# (bench.py --variants-first). --host adds, on EP1, each call's host time, the GPU time per call
# queued back to back and every kernel's GPU time (bench.py --host --profile). --probe first builds and runs every dev/*_probe.cu (while the trees
# build). --no-base leaves the checkout out (the ab/ trees only). Logs go to $OUT (or build/ab); the table at the end has one row per tree and
# case. --hash runs `mok run --check --repeat 2` on DeepSeek-V3 layers (scale 4 with carries and
# replay, EP1 and EP2) and `mok run --hash --repeat 2` at full size on EP1 in every tree and prints the outputs' hash: equal hashes across trees mean bitwise-equal results
# --fp8: the EP1 benchmark and traces also in FP8 (bench.py --precision fp8), and with --hash the FP8
# layers checked against the FP8 reference (`mok run --precision fp8 --fp8-alone --check --repeat 2`:
# DeepSeek-V3 at scale 4 as above, Qwen3-30B-A3B and Mixtral-8x7B at scale 2, 1000 tokens)
# (a change meant to keep every sum's order). --clocks: the EP1 benchmark samples the SM clock and
# power beside each time (bench.py --clocks): the passes run at the power cap, so a tree a few % apart
# from another may only have had another clock. --reps N: the EP1 benchmark's repetitions (8); --only
# LAYERS: the benchmarks' layers (bench.py --only); --rounds K: the benchmarks K times, the trees
# in turn each round (the machine drifts by a few % between minutes: interleaved rounds show how
# much; the tests and hashes run once). Keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-build/ab}
mkdir -p "$out"
clocks=()
tests=0 base_tests=0 ep2=0 trace=0 nccl=0 base=1 probe=0 hash=0 host=0 fp8=0 envs=() reps1=8 rounds=1 only=() ep2only=deepseek-v3,qwen3-30b-a3b
while [ $# -gt 0 ]; do
    a=$1
    shift
    case $a in
    --tests) tests=1 ;;
    --base-tests) base_tests=1 ;;
    --ep2) ep2=1 ;;
    --trace) trace=1 ;;
    --nccl) nccl=1 ;;
    --no-base) base=0 ;;
    --probe) probe=1 ;;
    --hash) hash=1 ;;
    --fp8) fp8=1 ;;
    --host) host=1 ;;
    --clocks) clocks=(--clocks) ;;
    --reps) reps1=$1; shift ;;
    --rounds) rounds=$1; shift ;;
    --only) only=(--only "$1"); ep2only=$1; shift ;;
    --env) envs+=(--compare-env "$1"); shift ;;
    --config) envs+=(--compare-config "$1"); shift ;;
    *) echo "ab-run: unknown option $a" >&2; exit 2 ;;
    esac
done
precision=()
[ $fp8 -eq 1 ] && precision=(--precision fp8)
nccl_home=$(bash scripts/nccl-home.sh)
args=(CUDA=1)
[ -n "$nccl_home" ] && args+=(NCCL_HOME="$nccl_home")
trees=()
[ $base -eq 1 ] && trees+=(.)
# a tree exported for an earlier call and removed since leaves its ignored build/ on the machine:
# only directories with a Makefile are trees
for d in ab/*/; do [ -f "$d/Makefile" ] && trees+=("${d%/}"); done
for t in "${trees[@]}"; do # build side by side
    (cd "$t" && mkdir -p build && make -j"$(nproc)" "${args[@]}" all build/mok_tests >build/ab-build.log 2>&1 ||
        echo "ab-run: build failed in $t (see $t/build/ab-build.log)") &
done
if [ $probe -eq 1 ]; then
    mkdir -p build
    for f in dev/*_probe.cu; do
        n=$(basename "$f" .cu)
        nvcc -std=c++17 -O3 -Isrc -Iinclude ${nccl_home:+-I"$nccl_home/include"} -gencode=arch=compute_90a,code=sm_90a "$f" -o "build/$n" &&
            timeout 120 "./build/$n" | tee "$out/$n.txt"
    done
fi
wait
# The outputs' hashes of one tree (`--hash`): scale 4 with four macrobatches (carried weight
# gradients) and replayed rows past the context, on 1 and 2 GPUs; then full size on one GPU
# (SwiGLU-backward tiles 256 wide; --hash: no reference, whose fp64 copy of 256 full-size experts
# did not finish in 180 s). Timing plays no part, so two trees' hashes run at once.
hash_tree() {
    (
        cd "$1" || exit 1
        for P in 1 2; do
            timeout 120 ./build/mok run --backend cuda --preset deepseek-v3 --scale 4 --tokens 2048 --ranks $P \
                --minibatch 1024 --ring 4096 --context-rows 4096 --check --repeat 2 2>&1 |
                grep -E "^(outputs|PASS|FAIL)" | sed "s/^/hash EP$P scale 4: /"
        done
        timeout 120 ./build/mok run --backend cuda --preset deepseek-v3 --tokens 1024 --hash --repeat 2 2>&1 |
            grep -E "^(outputs|PASS|FAIL)" | sed "s/^/hash EP1 full size: /"
        if [ "$fp8" -eq 1 ]; then
            timeout 120 ./build/mok run --backend cuda --preset deepseek-v3 --scale 4 --tokens 2048 --minibatch 1024 \
                --ring 4096 --context-rows 4096 --precision fp8 --fp8-alone --check --repeat 2 2>&1 |
                grep -E "^(outputs|PASS|FAIL)" | sed "s/^/hash FP8 deepseek-v3 scale 4: /"
            for preset in qwen3-30b-a3b mixtral-8x7b; do
                timeout 120 ./build/mok run --backend cuda --preset $preset --scale 2 --tokens 1000 --precision fp8 \
                    --fp8-alone --check --repeat 2 2>&1 | grep -E "^(outputs|PASS|FAIL)" | sed "s/^/hash FP8 $preset scale 2: /"
            done
        fi
    ) >"$2" 2>&1
}
start=$SECONDS
if [ $hash -eq 1 ]; then
    for t in "${trees[@]}"; do
        while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
        hash_tree "$t" "$out/hash$(echo "$t" | tr '/.' '__').txt" &
    done
    wait
    echo "ab-run: hashes of ${#trees[@]} trees in $((SECONDS - start)) s"
fi
for round in $(seq 1 "$rounds"); do
    for t in "${trees[@]}"; do
        name=$(echo "$t" | tr '/.' '__')
        log=$out/ab$name.txt
        if [ "$round" -eq 1 ]; then
            : >"$log"
            [ $hash -eq 1 ] && cat "$out/hash$name.txt" >>"$log"
        else
            echo "-- round $round" >>"$log"
        fi
        t0=$SECONDS
        # the --env / --config rows after the defaults' row on odd rounds, before it on even ones:
        # the row timed second has come out a few % faster whichever setting it had (docs/log.md)
        order=()
        [ ${#envs[@]} -gt 0 ] && [ $((round % 2)) -eq 0 ] && order=(--variants-first)
        (
            cd "$t" || exit 1
            export MOK_LIBRARY=$PWD/build/libmok.so PYTHONPATH=$PWD/python
            [ $tests -eq 1 ] && [ "$round" -eq 1 ] && { [ "$t" != . ] || [ $base_tests -eq 1 ]; } && MOK_TEST_NO_FULL=1 timeout 300 ./build/mok_tests cuda_ 2>&1 | grep -E "^(FAIL|PASS)|passed,|^    "
            timeout 300 python3 bench/bench.py --ranks 1 --no-sweep --reps "$reps1" ${only[@]+"${only[@]}"} ${envs[@]+"${envs[@]}"} \
                ${order[@]+"${order[@]}"} ${precision[@]+"${precision[@]}"} ${clocks[@]+"${clocks[@]}"} --out "/tmp/ab$name" 2>&1 | grep -E -A24 "^layer|^clocks during"
            [ $ep2 -eq 1 ] && timeout 300 python3 bench/bench.py --ranks 2 --no-sweep --reps 5 ${envs[@]+"${envs[@]}"} ${order[@]+"${order[@]}"} \
                --only "$ep2only" --out "/tmp/ab$name" 2>&1 | grep -A24 "^layer"
            [ $trace -eq 1 ] && [ "$round" -eq 1 ] && timeout 200 python3 bench/bench.py --ranks 1 --no-sweep --reps 2 --trace \
                ${precision[@]+"${precision[@]}"} --trace-dir "/tmp/ab$name-tr" --out "/tmp/ab$name" 2>&1 |
                grep -E "^trace|rank 0 (compute|comm)"
            # --host: EP1 host time per call, GPU time queued back to back, and every kernel's time
            [ $host -eq 1 ] && [ "$round" -eq 1 ] && timeout 300 python3 bench/bench.py --ranks 1 --no-sweep --reps 5 --host --profile \
                --out "/tmp/ab$name-h" 2>&1 | grep -E "^host |^profile |forward_kernel|backward_kernel|slot_sums|epilogue|sched_|spans_|groups_|Memset|Memcpy|elementwise|fill|Self CUDA time total"
            # with --ep2 too: DeepSeek-V3's EP2 passes traced (rank 0 is the heavy rank at skew 1.5)
            [ $trace -eq 1 ] && [ $ep2 -eq 1 ] && [ "$round" -eq 1 ] && timeout 200 python3 bench/bench.py --ranks 2 --no-sweep --reps 2 --trace \
                --only deepseek-v3 --trace-dir "/tmp/ab$name-tr2" --out "/tmp/ab$name-2" 2>&1 | grep -E "^trace|rank [0-9]+ (compute|comm)"
        ) >>"$log" 2>&1
        echo "==== $t, round $round ($(grep -h "passed," "$log" | tail -1)) [$((SECONDS - t0)) s]"
        if [ "$round" -eq 1 ]; then grep -E "^(deepseek|qwen|mixtral|hash|host |clocks )" "$log"; else sed -n "/^-- round $round\$/,\$p" "$log" | grep -E "^(deepseek|qwen|mixtral|clocks )"; fi | cut -c1-200
    done
done
if [ $nccl -eq 1 ]; then
    echo "==== EP2 baseline: NCCL all-to-all + grouped GEMM (torchrun, 2 processes)"
    python3 bench/layers.py 2 2>/dev/null | grep -E "^(deepseek-v3|qwen3-30b-a3b) " | while read -r name experts tokens skew; do
        timeout 300 torchrun --nproc-per-node 2 bench/torch_baseline.py --layer "$name" --experts "$experts" \
            --tokens "$tokens" --skew "$skew" --backward 2>&1 | grep '^{'
    done | tee "$out/nccl_baseline_ep2.txt"
fi
