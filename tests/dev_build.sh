#!/usr/bin/env bash
# dev_build.sh — every kernel experiment of dev/ still compiles for sm_90a (dev/README.md's
# command line: -Isrc -Iinclude for the probes that include the library's headers), so that a change to
# dev/gemm_common.cuh or to src/ does not leave one of them broken unseen until it runs on a GPU.
# Compiles in parallel; one PASS/FAIL line per file; skipped where nvcc is missing. Ends with
# `N passed, N failed`.
set -u
cd "$(dirname "$0")/.."
nvcc=${NVCC:-nvcc}
files=(dev/*.cu)
if ! command -v "$nvcc" >/dev/null 2>&1; then
    echo "SKIP dev build: no nvcc"
    echo "0 passed, 0 failed, ${#files[@]} skipped"
    exit 0
fi
b=$(mktemp -d)
trap 'rm -rf "$b"' EXIT
for f in "${files[@]}"; do
    n=$(basename "$f" .cu)
    "$nvcc" -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a -c "$f" -o "$b/$n.o" >"$b/$n.log" 2>&1 &
done
wait
pass=0
fail=0
for f in "${files[@]}"; do
    n=$(basename "$f" .cu)
    if [ -s "$b/$n.o" ]; then
        echo "PASS dev build: $f"
        pass=$((pass + 1))
    else
        echo "FAIL dev build: $f"
        cat "$b/$n.log"
        fail=$((fail + 1))
    fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
