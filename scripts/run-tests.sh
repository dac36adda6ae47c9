#!/usr/bin/env bash
# run-tests.sh BUILD_DIR — the whole suite: the C tests, the `mok` command's checks, the build's
# refusal of serialised wgmmas and the build of every dev/ experiment (both where nvcc is), and
# the Python binding's tests when numpy and pytest are importable. Each part ends with its own
# `N passed, N failed`; this script adds them up and ends with the total in the same form.
set -u
build=${1:-build}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
total_pass=0
total_fail=0
total_skip=0
log=$(mktemp)

count() { # count LOG: add the last "N passed, N failed" (pytest's "N passed" / "N failed" too)
    local line p f
    line=$(grep -E '[0-9]+ (passed|failed)' "$1" | tail -n 1)
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || true)
    f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+' || true)
    total_pass=$((total_pass + ${p:-0}))
    total_fail=$((total_fail + ${f:-0}))
    local k
    k=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || true)
    total_skip=$((total_skip + ${k:-0}))
}

part() { # part NAME CMD...: run one runner, show its output, count it; a runner that dies counts as a failure
    local name=$1
    shift
    echo "== $name"
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    count "$log"
    if [ "$rc" -ne 0 ] && ! grep -qE '[0-9]+ failed' "$log"; then
        echo "$name: exited with $rc before its closing line"
        total_fail=$((total_fail + 1))
    fi
}

part "C tests" "$build/mok_tests"
part "mok command" bash tests/cli.sh "$build"
part "build guard" bash tests/ptxas_guard.sh
part "dev experiments build" bash tests/dev_build.sh
if python3 -c 'import numpy, pytest' 2>/dev/null && [ -d python/tests ]; then
    part "Python binding" env MOK_LIBRARY="$here/$build/libmok.so" PYTHONPATH="$here/python" python3 -m pytest -q python/tests
else
    echo "== Python binding: skipped (numpy or pytest not importable)"
fi
rm -f "$log"
echo "$total_pass passed, $total_fail failed, $total_skip skipped"
[ "$total_fail" -eq 0 ]
