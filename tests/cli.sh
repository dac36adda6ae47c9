#!/usr/bin/env bash
# cli.sh — checks of the `mok` command: usage, the preset list, every preset scaled down on four
# cpu ranks against the reference, a few configurations that stress the protocol, the report's
# options (--no-backward, --check-tokens, link bandwidth), the cuda backend (checked against the
# reference where nvidia-smi lists GPUs, else it must be refused cleanly), --precision fp8 (checked
# against the FP8 reference, deterministic, bf16 unchanged beside it), and bad input (each
# must exit 2 with a message: the command's own, or the library's "mok: <function>: ..."); and
# build/mok_mp_rank, the one-rank driver of tests/mp_rank.c (its arguments, its run on the cpu
# backend, its refusal where there is no GPU for its rank).
# Usage: tests/cli.sh BUILD_DIR. Prints PASS/FAIL per check and closes with `N passed, N failed`.
set -u

build=${1:?usage: tests/cli.sh BUILD_DIR}
mok="$build/mok"
if [ ! -x "$mok" ]; then
    echo "cli.sh: $mok is not an executable (run make first)" >&2
    echo "0 passed, 1 failed"
    exit 1
fi

passed=0
failed=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# expect NAME STATUS TEXT ARGS...: runs `mok ARGS`, wants exit status STATUS and TEXT (a fixed
# string; empty = anything) somewhere in stdout + stderr. On failure shows the output's tail.
expect() {
    local name=$1 want=$2 text=$3
    shift 3
    local start=$SECONDS
    "$mok" "$@" >"$out" 2>&1
    local got=$?
    if [ "$got" -eq "$want" ] && { [ -z "$text" ] || grep -qF -- "$text" "$out"; }; then
        echo "PASS $name ($((SECONDS - start))s)"
        passed=$((passed + 1))
    else
        echo "FAIL $name: exit $got (wanted $want), wanted text '$text'; mok $*"
        tail -n 25 "$out" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}

# ---- usage and the preset list ----------------------------------------------------------------
expect help 0 "usage: mok" --help
expect run-help 0 "--preset NAME" run --help
expect no-arguments 2 "usage: mok"
expect unknown-command 2 "unknown command 'frobnicate'" frobnicate
expect presets 0 "deepseek-v4-pro" presets

presets=$("$mok" presets | awk 'NR > 1 { print $1 }')
count=$(printf '%s\n' "$presets" | grep -c .)
if [ "$count" -eq 11 ]; then
    echo "PASS presets-count"
    passed=$((passed + 1))
else
    echo "FAIL presets-count: $count presets listed, wanted 11"
    failed=$((failed + 1))
fi

# ---- every preset, scaled, on four cpu ranks against the reference ------------------------------
# same_hash NAME A B: passes when two runs' "outputs hash" lines (A, B) are there and equal.
same_hash() {
    if [ -n "$2" ] && [ "$2" = "$3" ]; then
        echo "PASS $1 ($2)"
        passed=$((passed + 1))
    else
        echo "FAIL $1: '$2' against '$3'"
        failed=$((failed + 1))
    fi
}

check_run() {
    local name=$1
    shift
    local start=$SECONDS
    "$mok" run "$@" >"$out" 2>&1
    local got=$?
    if [ "$got" -eq 0 ] && grep -qx PASS "$out"; then
        echo "PASS $name ($((SECONDS - start))s)"
        passed=$((passed + 1))
    else
        echo "FAIL $name: exit $got; mok run $*"
        tail -n 25 "$out" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}

for preset in $presets; do
    check_run "check-$preset" --preset "$preset" --scale 16 --ranks 4 --check --backend cpu
done

# ---- configurations that stress the protocol ---------------------------------------------------
# Upper-case name, uneven tokens, skewed routing, a SwiGLU clamp, small minibatches and a ring of
# two of them (several macrobatches), and a context that keeps only part of the rows (replay).
check_run uneven-skew-limit --preset Qwen3.5-397B-A17B --scale 16 --ranks 3 --uneven --skew 4 \
    --limit 0.5 --seed 7 --repeat 2 --check --backend cpu
check_run small-ring-replay --preset qwen3-30b-a3b --scale 16 --ranks 2 --tokens 192 --minibatch 128 \
    --ring 256 --context-rows 256 --repeat 2 --check --backend cpu
check_run one-rank-shared --preset glm-4.5 --scale 16 --ranks 1 --tokens 96 --repeat 1 --check --backend cpu
check_run no-tokens --preset deepseek-v3 --scale 16 --ranks 2 --tokens 0 --repeat 1 --check --backend cpu
check_run experts-rounded-up-to-ranks --preset mixtral-8x7b --scale 32 --ranks 8 --tokens 16 --repeat 1 \
    --check --backend cpu
# Every transfer turned around: the token owners push the dispatch and the reverse-combine and
# pull the combine and the reverse-dispatch (config fwd_dispatch = bwd_combine = MOK_PUSH,
# fwd_combine = bwd_dispatch = MOK_PULL), several macrobatches, uneven tokens.
check_run turned-transfers --preset qwen3-30b-a3b --scale 16 --ranks 4 --uneven --tokens 192 --minibatch 128 \
    --ring 256 --fwd-dispatch push --fwd-combine pull --bwd-combine push --bwd-dispatch pull --repeat 2 --check \
    --backend cpu
# --hash: the outputs' hash without the reference, the same as --check prints for the same inputs.
hash_args=(--preset olmoe-1b-7b --scale 16 --ranks 2 --uneven --tokens 48 --repeat 2 --backend cpu)
check_run hash-with-check "${hash_args[@]}" --check
hash_check=$(grep "^outputs hash" "$out")
check_run hash-alone "${hash_args[@]}" --hash
same_hash hash-alone-equals-check "$hash_check" "$(grep "^outputs hash" "$out")"

# ---- FP8 (--precision fp8) -------------------------------------------------------------------------
# The FP8 function (include/mok.h, FP8) on the cpu backend against the FP8 reference: four ranks with
# a shared expert; and uneven skewed tokens, a clamp, several macrobatches and a replayed context.
check_run fp8-check-four-ranks --preset deepseek-v3 --scale 16 --ranks 4 --precision fp8 --repeat 2 --check \
    --backend cpu
check_run fp8-protocol --preset qwen3-30b-a3b --scale 16 --ranks 2 --uneven --skew 2 --tokens 192 \
    --minibatch 128 --ring 256 --context-rows 256 --limit 0.5 --precision FP8 --repeat 2 --check --backend cpu
# The same FP8 bits from two processes, and the hash --check prints is the one --hash prints.
fp8_args=(--preset olmoe-1b-7b --scale 16 --ranks 2 --uneven --tokens 48 --repeat 2 --backend cpu)
check_run fp8-hash-with-check "${fp8_args[@]}" --precision fp8 --check
fp8_check=$(grep "^outputs hash" "$out")
check_run fp8-hash-first "${fp8_args[@]}" --precision fp8 --hash
fp8_first=$(grep "^outputs hash" "$out")
check_run fp8-hash-second "${fp8_args[@]}" --precision fp8 --hash
same_hash fp8-hash-twice "$fp8_first" "$(grep "^outputs hash" "$out")"
same_hash fp8-hash-equals-check "$fp8_check" "$fp8_first"
# bf16 is what it was: the default and --precision bf16 write the same bits (the hash-alone run
# above has the same arguments), and FP8 writes other bits than bf16.
check_run bf16-explicit "${hash_args[@]}" --precision bf16 --hash
same_hash bf16-explicit-equals-default "$hash_check" "$(grep "^outputs hash" "$out")"
if grep -q "precision bf16  backend cpu" "$out"; then
    echo "PASS bf16-header"
    passed=$((passed + 1))
else
    echo "FAIL bf16-header: the header does not say 'precision bf16'"
    failed=$((failed + 1))
fi
# qwen3-235b-a22b at --scale 16 has the same shape under both (H 256, I 128): the same layer and
# inputs, other bits.
same_shape=(--preset qwen3-235b-a22b --scale 16 --ranks 2 --tokens 48 --repeat 1 --backend cpu --hash)
check_run bf16-same-shape "${same_shape[@]}"
bf16_hash=$(grep "^outputs hash" "$out")
check_run fp8-same-shape "${same_shape[@]}" --precision fp8
if grep -q "rounds to multiples" "$out"; then
    echo "FAIL fp8-same-shape-kept: the FP8 run's shape differs from the bf16 run's"
    failed=$((failed + 1))
elif [ -n "$bf16_hash" ] && [ "$bf16_hash" != "$(grep "^outputs hash" "$out")" ]; then
    echo "PASS fp8-differs-from-bf16"
    passed=$((passed + 1))
else
    echo "FAIL fp8-differs-from-bf16: the FP8 run of the same layer and inputs wrote the bf16 run's bits ($bf16_hash)"
    failed=$((failed + 1))
fi
# The header says the precision, and when FP8's blocks of 128 make --scale round differently; the
# inputs line shows the weights' quantization; the memory lines the FP8 weights.
expect fp8-header 0 "precision fp8  backend cpu  ranks 2" run --preset deepseek-v3 --scale 16 --ranks 2 --tokens 32 \
    --repeat 1 --precision fp8 --backend cpu
# ... and after the FP8 runs the same layer runs in bf16, both precisions' phases side by side
if grep -q "^bf16 beside FP8" "$out" && grep -qE "^forward +[0-9.]+ +[0-9.]+ +[0-9.]+x$" "$out"; then
    echo "PASS fp8-beside-bf16"
    passed=$((passed + 1))
else
    echo "FAIL fp8-beside-bf16: no bf16 runs beside the FP8 ones, or no forward row with both times and their ratio"
    failed=$((failed + 1))
fi
if "$mok" run --preset deepseek-v3 --scale 16 --ranks 2 --tokens 32 --repeat 1 --precision fp8 --backend cpu \
    --fp8-alone 2>&1 | grep -q "bf16 beside FP8"; then
    echo "FAIL fp8-alone: --fp8-alone still ran bf16 beside"
    failed=$((failed + 1))
else
    echo "PASS fp8-alone"
    passed=$((passed + 1))
fi
expect fp8-scale-rounds 0 "--scale 16 rounds to multiples of 128 under fp8 (its blocks), not 64: H 512 (bf16: 448)" \
    run --preset deepseek-v3 --scale 16 --ranks 2 --tokens 32 --repeat 1 --precision fp8 --backend cpu
if grep -q "^inputs .*random .*quantize " "$out" && grep -q "FP8 weights .* bytes: codes, block scales" "$out"; then
    echo "PASS fp8-quantize-shown"
    passed=$((passed + 1))
else
    echo "FAIL fp8-quantize-shown: no quantize pass on the inputs line, or no FP8 weights in the memory lines"
    failed=$((failed + 1))
fi
if grep -q "rounds to multiples" <("$mok" run --preset deepseek-v3 --scale 8 --ranks 2 --tokens 32 --repeat 1 \
    --precision fp8 --backend cpu 2>&1); then
    echo "FAIL fp8-scale-kept: deepseek-v3 at --scale 8 (H 896, I 256, I_s 256) is said to round differently"
    failed=$((failed + 1))
else
    echo "PASS fp8-scale-kept"
    passed=$((passed + 1))
fi
expect bad-precision 2 "--precision expects bf16 or fp8, not 'fp16'" run --preset olmoe-1b-7b --precision fp16

# ---- what the report holds -----------------------------------------------------------------------
# --no-backward: the forward alone, checked; the backward row says why it is missing.
expect no-backward 0 "backward  n/a (skipped: --no-backward)" run --preset glm-4.5 --scale 16 --ranks 2 \
    --tokens 64 --no-backward --check --backend cpu
# --check-tokens below T: y, dx and d_router_w of the first N tokens; the weight gradients n/a.
expect check-tokens-sampled 0 "ds_down     n/a (sampled tokens)" run --preset glm-4.5 --scale 16 --ranks 2 \
    --tokens 64 --uneven --check-tokens 20 --check --backend cpu
# A layer with H*I > 512*512 samples 32 tokens per rank by default.
expect check-tokens-default 0 "the first 32 tokens of each rank" run --preset mixtral-8x7b --scale 8 --ranks 2 \
    --tokens 64 --repeat 1 --check --backend cpu
expect check-tokens-all 0 "(fp64, all tokens)" run --preset olmoe-1b-7b --scale 16 --ranks 2 --tokens 48 \
    --check-tokens 48 --repeat 1 --check --backend cpu
expect memory-symmetric 0 "of it symmetric" run --preset olmoe-1b-7b --scale 16 --ranks 2 --repeat 1 --backend cpu
expect link-bandwidth 0 "fwd link GB/s" run --preset olmoe-1b-7b --scale 16 --ranks 2 --repeat 1 --backend cpu

# ---- what a run shows while it runs ----------------------------------------------------------------
# The version is include/mok.h's, the one home of it.
header="$(dirname "$0")/../include/mok.h"
version=$(awk '/^#define MOK_VERSION_(MAJOR|MINOR|PATCH) / { v = v (v == "" ? "" : ".") $3 } END { print v }' "$header")
expect version 0 "mok $version" --version
expect version-backends 0 "backends: cpu" --version
# The header comes first, then one line per run with each pass's time and the time elapsed, then
# the tables.
expect progress-lines 0 "run 2/2   schedule " run --preset olmoe-1b-7b --scale 16 --ranks 2 --repeat 2 --backend cpu
order=$(grep -E "^(layer|memory|inputs|run 1/2|run 2/2|phase) " "$out" | awk '{ printf "%s|", $1 == "run" ? $1 " " $2 : $1 }')
if [ "$order" = "layer|memory|inputs|run 1/2|run 2/2|phase|" ] && grep -q "^run 1/2 .*forward .*backward .*(elapsed " "$out"
then
    echo "PASS progress-order"
    passed=$((passed + 1))
else
    echo "FAIL progress-order: the output's lines come as '$order'"
    failed=$((failed + 1))
fi
# A long run shows its header and its first runs while it is still running.
"$mok" run --preset olmoe-1b-7b --scale 16 --ranks 2 --tokens 256 --repeat 100000 --backend cpu >"$out" 2>&1 &
long=$!
seen=0
for _ in $(seq 1 100); do
    if grep -q "^run 2/100000 .*(elapsed " "$out"; then
        seen=1
        break
    fi
    sleep 0.2
done
kill "$long" 2>/dev/null
wait "$long" 2>/dev/null
if [ "$seen" -eq 1 ] && grep -q "^layer " "$out"; then
    echo "PASS progress-while-running"
    passed=$((passed + 1))
else
    echo "FAIL progress-while-running: after 20 s of a long run the output is:"
    head -n 20 "$out" | sed 's/^/    /'
    failed=$((failed + 1))
fi
expect tokens-zero-header 0 "tokens   0 per rank (0 in all)" run --preset olmoe-1b-7b --scale 16 --ranks 2 --tokens 0 \
    --repeat 1 --backend cpu
# --scale that leaves fewer experts than k says so; k = E says that every token goes everywhere.
expect k-lowered 0 "k lowered from the preset's 8 to 4: --scale 16 leaves 4 experts" run --preset olmoe-1b-7b \
    --scale 16 --ranks 2 --tokens 32 --repeat 1 --backend cpu
expect k-equals-e 0 "k = E: --scale 16 leaves 8 experts, so every token goes to every expert" \
    run --preset qwen3-30b-a3b --scale 16 --ranks 2 --tokens 32 --repeat 1 --backend cpu
if grep -q "k lowered\|k = E" <("$mok" run --preset deepseek-v3 --scale 16 --ranks 2 --tokens 32 --repeat 1 \
    --backend cpu 2>&1); then
    echo "FAIL k-kept: deepseek-v3 at --scale 16 (E 16, k 8) is said to change k"
    failed=$((failed + 1))
else
    echo "PASS k-kept"
    passed=$((passed + 1))
fi
# Host memory: a run that cannot fit is refused before its tensors exist, with a --scale that
# fits; one that comes close gets a warning. MOK_HOST_MEMORY stands for the memory available.
MOK_HOST_MEMORY=1G expect memory-refused 2 "of host memory but 1.00 GiB are available; --scale 8 fits (or leave out --check)" \
    run --preset deepseek-v3 --check --backend cpu
MOK_HOST_MEMORY=1G expect memory-refused-early 2 "of host memory but 1.00 GiB are available; --scale 8 fits" \
    run --preset kimi-k2 --ranks 4 --backend cpu
if grep -qE "^(memory|inputs) " "$out"; then
    echo "FAIL memory-refused-before-inputs: the workspace or the inputs were made before the refusal"
    failed=$((failed + 1))
else
    echo "PASS memory-refused-before-inputs"
    passed=$((passed + 1))
fi
expect memory-estimate 0 "host memory: about " run --preset olmoe-1b-7b --scale 16 --ranks 2 --repeat 1 --backend cpu
need=$(sed -n 's/.*host memory: about \([0-9.]*\) MiB at the peak.*/\1/p' "$out")
if [ -n "$need" ]; then
    near=$(awk -v m="$need" 'BEGIN { printf "%d", m * 1.1 * 1048576 }')
    MOK_HOST_MEMORY=$near expect memory-warning 0 "mok run: warning: this run needs about $need MiB of the" \
        run --preset olmoe-1b-7b --scale 16 --ranks 2 --repeat 1 --backend cpu
else
    echo "FAIL memory-warning: no estimate in MiB in the output"
    failed=$((failed + 1))
fi
# Direction names in any case, as the other names.
check_run directions-any-case --preset qwen3-30b-a3b --scale 16 --ranks 2 --tokens 64 --fwd-dispatch PUSH \
    --fwd-combine Pull --bwd-combine PUSH --bwd-dispatch pUlL --repeat 1 --check --backend CPU
# --trace: the last run's forward and backward, each (rank, pass) a named process, each worker a
# named thread (read with Python's json module where python3 is).
trace="$(mktemp -d)/trace.json"
expect trace-written 0 "forward and backward written to $trace" run --preset glm-4.5 --scale 16 --ranks 2 --tokens 64 \
    --repeat 2 --trace "$trace" --backend cpu
if command -v python3 >/dev/null 2>&1; then
    if python3 - "$trace" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
tasks = [e for e in events if e["ph"] == "X"]
want = {(0, None): "rank 0 forward", (1, None): "rank 1 forward", (72, None): "rank 0 backward",
        (73, None): "rank 1 backward"}
assert all(names.get(k) == v for k, v in want.items()), names
for e in tasks:
    thread = names.get((e["pid"], e["tid"]), "")
    assert thread == f"{e['cat']} worker {e['tid']}", (e, thread)
    assert e["pid"] == e["args"]["rank"] + (72 if e["args"]["pass"] == "backward" else 0), e
passes = {e["args"]["pass"] for e in tasks}
assert passes == {"forward", "backward"}, passes
forward_end = max(e["ts"] + e["dur"] for e in tasks if e["args"]["pass"] == "forward")
assert forward_end <= min(e["ts"] for e in tasks if e["args"]["pass"] == "backward")
PY
    then
        echo "PASS trace-both-passes-named"
        passed=$((passed + 1))
    else
        echo "FAIL trace-both-passes-named: $trace"
        failed=$((failed + 1))
    fi
fi
rm -rf "$(dirname "$trace")"

# ---- the cuda backend --------------------------------------------------------------------------
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); fi
if [ "${gpus:-0}" -eq 0 ]; then
    # No GPU: cuda is refused with the real cause (a build without the CUDA backend, or no GPU
    # visible to a build that has it: `mok --version` says which build this is); auto means cpu.
    if "$mok" --version | grep -q "no CUDA backend"; then
        unavailable="--backend cuda: this build has no CUDA backend"
    else
        unavailable="--backend cuda: no GPU is visible to this process (this build has the CUDA backend"
    fi
    expect cuda-unavailable 2 "$unavailable" run --preset olmoe-1b-7b --scale 16 --backend cuda
    expect cuda-unavailable-fp8 2 "$unavailable" run --preset olmoe-1b-7b --scale 16 --precision fp8 --backend cuda
    expect cuda-unavailable-ranks 2 "$unavailable" run --preset qwen3-30b-a3b --scale 16 --ranks 4 --check \
        --backend CUDA
    expect auto-is-cpu 0 "backend cpu  ranks 2" run --preset olmoe-1b-7b --scale 16 --ranks 2 --tokens 32 \
        --repeat 1 --check --backend auto
else
    # Rank r on GPU r. A backend without a backward yet reports it n/a and checks the forward.
    check_run cuda-one-rank --preset qwen3-30b-a3b --scale 16 --ranks 1 --repeat 2 --check --backend cuda
    check_run cuda-one-rank-shared --preset glm-4.5 --scale 16 --ranks 1 --tokens 96 --check --backend cuda
    if [ "$gpus" -ge 2 ]; then
        check_run cuda-two-ranks --preset deepseek-v3 --scale 16 --ranks 2 --uneven --skew 2 --repeat 2 --check \
            --backend cuda
        # Every transfer turned around gives the defaults' bits: the same outputs' hash.
        turned=(--preset qwen3-30b-a3b --scale 16 --ranks 2 --uneven --skew 2 --tokens 192 --minibatch 128
            --ring 256 --context-rows 256 --repeat 2 --check --backend cuda)
        check_run cuda-defaults "${turned[@]}"
        hash_defaults=$(grep "^outputs hash" "$out")
        check_run cuda-turned-transfers "${turned[@]}" --fwd-dispatch push --fwd-combine pull --bwd-combine push \
            --bwd-dispatch pull
        same_hash cuda-turned-transfers-hash "$hash_defaults" "$(grep "^outputs hash" "$out")"
    fi
    # FP8 on cuda: forward and backward against the FP8 reference, and the outputs' bits the same
    # on every --repeat run.
    check_run cuda-fp8 --preset olmoe-1b-7b --scale 16 --precision fp8 --backend cuda --check --repeat 2
    expect cuda-fp8-hash 0 "PASS" run --preset deepseek-v3 --scale 8 --precision fp8 --backend cuda --hash --repeat 3
    expect cuda-too-few-gpus 2 "ranks on the cuda backend need $((gpus + 1)) GPUs" \
        run --preset olmoe-1b-7b --scale 16 --ranks $((gpus + 1)) --backend cuda
fi

# ---- build/mok_mp_rank (tests/mp_rank.c) -------------------------------------------------------
mp="$build/mok_mp_rank"
if [ -x "$mp" ]; then
    mpdir=$(mktemp -d)
    trap 'rm -f "$out"; rm -rf "$mpdir"' EXIT
    expect_mp() { # expect_mp NAME STATUS TEXT ARGS...: expect, for mok_mp_rank instead of mok
        local saved=$mok
        mok=$mp
        expect "$@"
        mok=$saved
    }
    expect_mp mp-rank-help 0 "usage: mok_mp_rank" --help
    expect_mp mp-rank-cpu 0 "5 passed, 0 failed" --rank 0 --ranks 1 --id-file "$mpdir/id" --backend cpu
    if [ -e "$mpdir/id" ]; then
        echo "FAIL mp-rank-cpu-id-removed: rank 0 left $mpdir/id behind after every rank joined"
        failed=$((failed + 1))
    else
        echo "PASS mp-rank-cpu-id-removed"
        passed=$((passed + 1))
    fi
    expect_mp mp-rank-cpu-turned 0 "5 passed, 0 failed" --rank 0 --ranks 1 --id-file "$mpdir/id-turned" \
        --backend cpu --transfers turned
    expect_mp mp-rank-bad-transfers 2 "--transfers expects default or turned, not 'sideways'" --rank 0 --ranks 1 \
        --id-file "$mpdir/x" --transfers sideways
    : >"$mpdir/stale"
    expect_mp mp-rank-stale-id-file 1 "exists already" --rank 0 --ranks 1 --id-file "$mpdir/stale" --backend cpu
    expect_mp mp-rank-missing-args 2 "--rank, --ranks and --id-file are required" --ranks 2
    expect_mp mp-rank-rank-too-large 2 "--rank 2 is not below --ranks 2" --rank 2 --ranks 2 --id-file "$mpdir/x"
    expect_mp mp-rank-bad-number 2 "--ranks expects an integer" --rank 0 --ranks 2x --id-file "$mpdir/x"
    expect_mp mp-rank-cpu-one-rank 2 "--backend cpu runs --ranks 1 only" --rank 0 --ranks 2 --id-file "$mpdir/x" \
        --backend cpu
    # A rank without its GPU is refused before it touches the id file (exit 3).
    expect_mp mp-rank-no-gpu 3 "mok_mp_rank: " --rank "$gpus" --ranks $((gpus + 1)) --id-file "$mpdir/x"
fi

# ---- bad input: the command's own rules --------------------------------------------------------
expect bad-unknown-preset 2 "unknown preset 'gpt-5'" run --preset gpt-5
expect bad-no-preset 2 "--preset NAME is required" run --scale 16
expect bad-scale-zero 2 "--scale must be greater than 0" run --preset olmoe-1b-7b --scale 0
expect bad-scale-negative 2 "--scale must be greater than 0" run --preset olmoe-1b-7b --scale -1
expect bad-scale-text 2 "--scale expects a finite number, not '16x'" run --preset olmoe-1b-7b --scale 16x
expect bad-scale-nan 2 "--scale expects a finite number" run --preset olmoe-1b-7b --scale nan
expect bad-tokens-negative 2 "--tokens must be at least 0, not '-5'" run --preset olmoe-1b-7b --tokens -5
expect bad-tokens-overflow 2 "--tokens expects an integer that fits in 64 bits, not '99999999999999999999'" \
    run --preset olmoe-1b-7b --tokens 99999999999999999999
expect bad-scale-tiny 2 "--scale must be between 1 (the preset at full size) and 4096" \
    run --preset olmoe-1b-7b --scale 1e-300
expect bad-scale-below-one 2 "not '0.5'" run --preset olmoe-1b-7b --scale 0.5
expect bad-scale-huge 2 "--scale must be between 1" run --preset olmoe-1b-7b --scale 1e300
expect bad-scale-overflow 2 "--scale expects a finite number, not '1e999'" run --preset olmoe-1b-7b --scale 1e999
expect bad-direction 2 "--fwd-dispatch expects push or pull, not 'sideways'" \
    run --preset olmoe-1b-7b --fwd-dispatch sideways
# --trace's folder is checked before anything runs (no run line, no header).
expect bad-trace-folder 2 "--trace /nonexistent-dir/trace.json: the folder '/nonexistent-dir' does not exist" \
    run --preset olmoe-1b-7b --scale 16 --repeat 1 --trace /nonexistent-dir/trace.json --backend cpu
if grep -q "^run 1/" "$out"; then
    echo "FAIL bad-trace-folder-before-runs: a run started before the bad --trace path was reported"
    failed=$((failed + 1))
else
    echo "PASS bad-trace-folder-before-runs"
    passed=$((passed + 1))
fi
expect bad-trace-is-folder 2 "is a folder; give a file name" run --preset olmoe-1b-7b --scale 16 --trace /tmp \
    --backend cpu
expect bad-ranks-text 2 "--ranks expects an integer, not '4.5'" run --preset olmoe-1b-7b --ranks 4.5
expect bad-ranks-overflow 2 "--ranks expects an integer that fits in an int" run --preset olmoe-1b-7b \
    --ranks 99999999999
expect bad-check-tokens-zero 2 "--check-tokens must be at least 1, not '0'" run --preset olmoe-1b-7b \
    --check-tokens 0
expect bad-repeat-zero 2 "--repeat must be between 1" run --preset olmoe-1b-7b --repeat 0
expect bad-seed-negative 2 "--seed expects a non-negative integer" run --preset olmoe-1b-7b --seed -3
expect bad-backend 2 "--backend expects cpu, cuda or auto, not 'tpu'" run --preset olmoe-1b-7b --backend tpu
expect bad-unknown-flag 2 "unknown option '--bogus'" run --preset olmoe-1b-7b --bogus 1
expect bad-missing-value 2 "--seed needs a value" run --preset olmoe-1b-7b --seed
expect bad-stray-argument 2 "unexpected argument 'extra'" run --preset olmoe-1b-7b extra

# ---- bad input the library rejects: its message in the words of the flag that set the field ------
expect lib-ranks-zero 2 "mok run: --ranks: 0 is not in [1, " run --preset olmoe-1b-7b --scale 16 --ranks 0 --backend cpu
expect lib-ranks-too-many 2 "mok run: --ranks: 100 is not in [1, " \
    run --preset olmoe-1b-7b --scale 16 --ranks 100 --backend cpu
expect lib-experts-not-divisible 2 "mok run: --ranks 3 does not divide the 256 experts of deepseek-v3" \
    run --preset deepseek-v3 --ranks 3 --backend cpu
expect lib-too-many-tokens 2 "mok run: --tokens: 20000000 " \
    run --preset olmoe-1b-7b --scale 16 --tokens 20000000 --backend cpu
expect lib-minibatch 2 "mok run: --minibatch: 100 " run --preset olmoe-1b-7b --scale 16 --minibatch 100 --backend cpu
expect lib-ring 2 "mok run: --ring: 1536 " run --preset olmoe-1b-7b --scale 16 --ring 1536 --backend cpu
expect lib-ring-names-minibatch 2 "(--minibatch 4096)" run --preset olmoe-1b-7b --scale 16 --ring 1536 --backend cpu
expect lib-threads 2 "mok run: --threads: 1 " run --preset olmoe-1b-7b --scale 16 --threads 1 --backend cpu
expect lib-comm-threads 2 "mok run: --comm-threads: 0 " \
    run --preset olmoe-1b-7b --scale 16 --comm-threads 0 --backend cpu
expect lib-comm-sms 2 "mok run: --comm-sms: -3 " run --preset olmoe-1b-7b --scale 16 --comm-sms -3 --backend cpu
expect lib-limit 2 "mok run: --limit: " run --preset olmoe-1b-7b --scale 16 --limit -1 --backend cpu
expect lib-context-rows 2 "mok run: --context-rows: -1 " \
    run --preset olmoe-1b-7b --scale 16 --context-rows -1 --backend cpu
# No library field name is left in those messages.
named=0
for args in "--ranks 0" "--minibatch 100" "--ring 1536" "--threads 1" "--comm-threads 0" "--comm-sms -3" \
    "--limit -1" "--context-rows -1" "--tokens 20000000"; do
    # shellcheck disable=SC2086 # args is a flag and its value
    "$mok" run --preset olmoe-1b-7b --scale 16 --backend cpu $args >"$out" 2>&1
    if grep -qE "config\.|shape\.|nranks|_rows|_threads|_sms|_limit" "$out"; then
        echo "FAIL lib-fields-named-as-flags: mok run $args says: $(cat "$out")"
        named=$((named + 1))
    fi
done
if [ "$named" -eq 0 ]; then
    echo "PASS lib-fields-named-as-flags (9 flags)"
    passed=$((passed + 1))
else
    failed=$((failed + 1))
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
