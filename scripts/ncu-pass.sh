#!/usr/bin/env bash
# ncu-pass.sh [forward|backward] [mok run options...] — on a GPU machine whose runtime lets ncu read
# the hardware counters (Firecracker; ../shared/H200.md): profiles the first launch of the pass's
# kernel in `mok run` with Nsight Compute, clocks left alone (--clock-control none), with
# source-level warp-stall sampling, and prints the source lines with the most stall samples
# (scripts/ncu_lines.py). Default layer: Qwen3-30B-A3B, 16384 tokens, one GPU. Writes to $OUT (or
# build/ncu): the report, its details page, the SASS-view CSV, the
# cubins' listing and the per-line table; with NCU_ONLY=TEXT (e.g. swiglu.cuh) also the table of
# the source lines containing TEXT with their stall reasons (scripts/ncu_lines.py --only). Build
# first (make CUDA=1 all).
set -u
cd "$(dirname "$0")/.."
kind=${1:-backward}
[ $# -gt 0 ] && shift
case $kind in forward | backward) ;; *) echo "ncu-pass: forward or backward, not '$kind'" >&2; exit 2 ;; esac
out=${OUT:-build/ncu}
mkdir -p "$out"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--preset qwen3-30b-a3b --tokens 16384)
rep=$out/ncu-$kind
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 400 ncu --clock-control none --kernel-name-base function -k "${kind}_kernel" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
    --import-source yes -f -o "$rep" ./build/mok run --backend cuda --repeat 1 "${args[@]}" >"$rep-run.txt" 2>&1
echo "ncu exit $? (log: $rep-run.txt)"
[ -f "$rep.ncu-rep" ] || { tail -20 "$rep-run.txt"; exit 1; }
ncu -i "$rep.ncu-rep" --page details >"$rep-details.txt" 2>&1
grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Compute \(SM\) Throughput|Memory Throughput" "$rep-details.txt"
# the SASS view carries the per-instruction samples (the CUDA view of this ncu printed the source
# text alone); the listing of the library's cubins gives each instruction's source line and the
# lines it was inlined at (-gi), so --only counts an inlined helper at its caller's line
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep-sass.csv" 2>&1
tmp=$(mktemp -d)
lib=$PWD/build/libmok.so
(cd "$tmp" && cuobjdump -xelf all "$lib" >/dev/null 2>&1)
for f in "$tmp"/*.cubin; do [ -f "$f" ] && nvdisasm -gi -c "$f"; done >"$rep-listing.sass" 2>/dev/null
rm -rf "$tmp"
python3 scripts/ncu_lines.py "$rep-sass.csv" 40 --lines "$rep-listing.sass" --kernel "${kind}_kernel" | tee "$rep-lines.txt"
if [ -n "${NCU_ONLY:-}" ]; then
    python3 scripts/ncu_lines.py "$rep-sass.csv" 40 --lines "$rep-listing.sass" --kernel "${kind}_kernel" \
        --only "$NCU_ONLY" | tee "$rep-only.txt"
fi
gzip -f "$rep-sass.csv" "$rep-listing.sass"
