#!/usr/bin/env bash
# ptxas_guard.sh — the build's refusal of serialised wgmmas (Makefile's CUDA rule): a kernel
# whose pipelined wgmma loop starts from accumulators defined on two branches must fail to build
# with ptxas's "Potential Performance Loss" and leave no object; the same loop with one straight
# path must build. Both through the Makefile's own rule. Skipped where nvcc is missing. Ends with
# `N passed, N failed`.
set -u
cd "$(dirname "$0")/.."
if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    echo "SKIP ptxas guard: no nvcc"
    echo "0 passed, 0 failed, 2 skipped"
    exit 0
fi
b=$(mktemp -d)
trap 'rm -rf "$b"' EXIT
pass=0
fail=0
ok=$b/obj/tests/ptxas/pipelined_wgmma.o
bad=$b/obj/tests/ptxas/serialised_wgmma.o
if make -s CUDA=1 BUILD="$b" "$ok" >"$b/ok.log" 2>&1 && [ -f "$ok" ]; then
    echo "PASS ptxas guard: the pipelined loop builds"
    pass=$((pass + 1))
else
    echo "FAIL ptxas guard: the pipelined loop did not build"
    cat "$b/ok.log"
    fail=$((fail + 1))
fi
if make -s CUDA=1 BUILD="$b" "$bad" >"$b/bad.log" 2>&1; then
    echo "FAIL ptxas guard: the serialised loop built"
    fail=$((fail + 1))
elif grep -q "Potential Performance Loss" "$b/bad.log" && [ ! -f "$bad" ]; then
    echo "PASS ptxas guard: the serialised loop is refused ($(grep -o 'C75[0-9]*' "$b/bad.log" | head -1))"
    pass=$((pass + 1))
else
    echo "FAIL ptxas guard: the serialised loop failed for another reason"
    cat "$b/bad.log"
    fail=$((fail + 1))
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
