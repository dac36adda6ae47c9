#!/usr/bin/env bash
# gpu-check.sh [--quick] [--sanitize] [--bench] [--dev] [--train] — on a GPU machine: build against the NCCL that
# runs (PyTorch's, when python3 has it), run every GPU test, the command's and the binding's tests,
# optionally the training example, compute-sanitizer (EP1 in the test process; EP2 as two processes,
# one per GPU, through build/mok_mp_rank), the dev kernels and the benchmark, in that order; write
# the full log to $OUT/gpu-check.log (or build/gpu-check.log) and end with a short table. Keep
# NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-build}
mkdir -p "$out" build
log=$out/gpu-check.log
: >"$log"
sanitize=0
bench=0
dev=0
train=0
for a in "$@"; do
    case $a in
    --sanitize) sanitize=1 ;;
    --bench) bench=1 ;;
    --quick) export MOK_TEST_NO_FULL=1 ;;
    --dev) dev=1 ;;
    --train) train=1 ;;
    esac
done
declare -a rows
row() { rows+=("$(printf '%-44s %s' "$1" "$2")"); }
step() { # step NAME CMD...: run, log, record pass/fail
    local name=$1
    shift
    echo "== $name: $*" >>"$log"
    local t0=$SECONDS
    "$@" >>"$log" 2>&1
    local rc=$?
    local dt=$((SECONDS - t0))
    if [ $rc -eq 0 ]; then row "$name" "ok (${dt}s)"; else row "$name" "FAILED rc=$rc (${dt}s)"; fi
    return $rc
}

{
    nvidia-smi -L
    nvcc --version | tail -1
} >>"$log" 2>&1
nccl_home=$(bash scripts/nccl-home.sh)
if [ -n "$nccl_home" ]; then
    echo "NCCL: $nccl_home ($(grep -E '#define NCCL_(MAJOR|MINOR|PATCH) ' "$nccl_home/include/nccl.h" | awk '{print $3}' | paste -sd.))" >>"$log"
    make_args=(CUDA=1 NCCL_HOME="$nccl_home")
else
    echo "NCCL: the toolkit's" >>"$log"
    make_args=(CUDA=1)
fi
ngpu=$(nvidia-smi -L | wc -l)
row "GPUs" "$ngpu"

step "build" make -j16 "${make_args[@]}" all build/mok_tests || { printf '%s\n' "${rows[@]}"; exit 1; }
step "GPU tests (cuda_*)" timeout 900 ./build/mok_tests cuda_
grep -E '^(PASS|FAIL|SKIP) cuda_|passed, ' "$log" | tail -n 20 >>"$out/gpu-tests.txt"
step "mok command (tests/cli.sh, cuda cases)" timeout 600 bash tests/cli.sh build
step "Python binding on GPUs" env MOK_LIBRARY="$PWD/build/libmok.so" PYTHONPATH="$PWD/python" timeout 600 \
    python3 -m pytest -q -x python/tests
grep -E '(passed|failed).* in ' "$log" | tail -n 1 >>"$out/gpu-tests.txt"
# Before the sanitizers: their runs are the longest steps, and a job's time limit should cut them,
# not this.
if [ $train -eq 1 ]; then
    # mok's layer and its PyTorch twin trained from the same weights, seeds 0-3 (the verdict is a
    # statistic of one run: one seed says little); each exits non-zero if the loss curves differ
    # by more than bf16 noise or a same-weights check fails
    for seed in 0 1 2 3; do
        step "train example on the GPU, seed $seed (examples/train_moe.py)" env MOK_LIBRARY="$PWD/build/libmok.so" \
            PYTHONPATH="$PWD/python" timeout 600 python3 examples/train_moe.py --device cuda --steps 300 \
            --seed $seed --out "$out/train_moe_s$seed"
        grep -E "within bf16 noise|yardsticks' mean|same weights, |time per step" "$log" | tail -n 4 >>"$out/gpu-tests.txt"
    done
fi

# sanitize_ep2 TOOL [TRANSFERS]: sanitize_case's EP2 layer as two processes, rank r on GPU r, each under
# compute-sanitizer TOOL (build/mok_mp_rank, tests/mp_rank.c). One process driving both GPUs cannot
# run under a sanitizer: it runs the process's kernels one at a time, and the first cross-GPU
# barrier needs both GPUs' kernels at once. Rank 0 writes the unique id to a fresh file that rank 1
# waits for. Both ranks' output goes into the log; one row for the pair. TRANSFERS: default or
# turned (mok_mp_rank --transfers).
sanitize_ep2() {
    local tool=$1 transfers=${2:-default} t0=$SECONDS dir r
    local -a pids=() rcs=()
    dir=$(mktemp -d "${TMPDIR:-/tmp}/mok-ep2-$tool.XXXXXX")
    echo "== compute-sanitizer $tool, EP2 as two processes: build/mok_mp_rank --ranks 2 --id-file $dir/id --transfers $transfers" >>"$log"
    for r in 0 1; do
        timeout 300 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
            ./build/mok_mp_rank --rank $r --ranks 2 --id-file "$dir/id" --timeout-ms 250000 \
            --transfers "$transfers" >"$dir/rank$r.log" 2>&1 &
        pids+=($!)
    done
    for r in 0 1; do
        wait "${pids[$r]}"
        rcs+=($?)
    done
    for r in 0 1; do
        echo "-- rank $r (exit ${rcs[$r]})" >>"$log"
        cat "$dir/rank$r.log" >>"$log"
    done
    rm -rf "$dir"
    local name="compute-sanitizer $tool ep2 (2 processes, $transfers transfers)" dt=$((SECONDS - t0))
    if [ "${rcs[0]}" -eq 0 ] && [ "${rcs[1]}" -eq 0 ]; then
        row "$name" "ok (${dt}s)"
    else
        row "$name" "FAILED rc=${rcs[0]},${rcs[1]} (${dt}s)"
    fi
}

if [ $sanitize -eq 1 ]; then
    # NCCL probes for kernel images at init and gets "no kernel image" API errors by design:
    # leave API errors out, report memory, race and sync errors. The sanitizers slow a pass
    # past the default 10 s peer timeout: the runs take a longer one (EP1 from the environment,
    # EP2 from --timeout-ms), short enough that a real hang is reported before `timeout` kills it.
    # cuda_sanitize_ep2 stays out of this loop (it is one of the GPU tests above).
    for tool in memcheck racecheck synccheck; do
        step "compute-sanitizer $tool cuda_sanitize_ep1" env MOK_TEST_PEER_TIMEOUT_MS=200000 timeout 240 \
            compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 ./build/mok_tests cuda_sanitize_ep1
        if [ "$ngpu" -ge 2 ]; then
            sanitize_ep2 $tool default
            sanitize_ep2 $tool turned
        else
            row "compute-sanitizer $tool ep2 (2 processes)" "skipped ($ngpu GPU)"
        fi
    done
fi
if [ $dev -eq 1 ]; then
    # kernel experiments of dev/: each validates itself before it times anything
    step "dev: wgmma tile (self-test + timing)" bash -c 'nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a \
        -DWITH_CUBLAS dev/gemm_wgmma_v1.cu -lcublas -o build/gemm_wgmma_v1 && timeout 300 ./build/gemm_wgmma_v1'
    grep -E 'TFLOP|passed, ' "$log" | tail -n 12 >>"$out/gpu-tests.txt"
fi
if [ $bench -eq 1 ] && [ -x bench/run.sh ]; then
    step "benchmark" timeout 900 bash bench/run.sh "$out"
    grep -h -A8 "^layer " "$out"/bench_ep*.txt >>"$out/gpu-tests.txt" 2>/dev/null
    cat "$out"/baseline_ep*.txt >>"$out/gpu-tests.txt" 2>/dev/null
fi
echo
echo "---- gpu-check summary (full log: $log)"
printf '%s\n' "${rows[@]}"
grep -E '^(PASS|FAIL|SKIP) cuda_' "$log" | sed 's/  */ /g'
grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c
[ $bench -eq 1 ] && { grep -h -A8 "^layer " "$out"/bench_ep*.txt; cat "$out"/baseline_ep*.txt; } 2>/dev/null
