#!/usr/bin/env bash
# ab-export.sh BRANCH... — on the machine with the repository: writes each branch's tree into
# ab/<branch>/ (untracked, not ignored, so it travels with the working tree to a GPU machine),
# for scripts/ab-run.sh to build and compare beside the checkout in one job. ab/ is removed
# with `rm -rf ab` afterwards; it is never committed.
set -eu
cd "$(dirname "$0")/.."
for b in "$@"; do
    git rev-parse --verify -q "$b" >/dev/null || { echo "ab-export: no branch '$b'" >&2; exit 2; }
    rm -rf "ab/$b"
    mkdir -p "ab/$b"
    git archive "$b" | tar -x -C "ab/$b"
    echo "ab/$b: $(git log -1 --format='%h %s' "$b" | cut -c1-100)"
done
