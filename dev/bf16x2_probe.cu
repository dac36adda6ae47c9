/* bf16x2_probe.cu — check: does cvt.rn.bf16x2.f32 round every fp32 value to the same bf16 bits as
 * the portable rounding of src/core/portable.h (mok__bf16_from_f32), NaNs aside?
 *
 * The library rounds every epilogue through the instruction (bf16x2_from_f32, src/cuda/device.cuh);
 * its outputs must keep the bits of the portable rounding. This walks all 2^32 bit patterns on the GPU as
 * the low half of the pair (the high half gets a pseudo-random partner pattern, checked too)
 * and counts the patterns where the two disagree: subnormals, ties, the values that overflow to Inf and the
 * largest finite ones included. For NaN inputs it only checks that the result is a NaN (the
 * instruction returns the canonical 0x7fff; the portable code keeps the sign and payload).
 *
 * Build and run from the repository root (sm_80 or newer; sm_90a here):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a dev/bf16x2_probe.cu \
 *        -o build/bf16x2_probe && ./build/bf16x2_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "every_pattern.cuh"

#include "core/portable.h"

__device__ static inline uint32_t cvt_pair(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ static inline bool bf16_is_nan(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }

/* counts[0]: non-NaN patterns whose bits differ; counts[1]: NaN patterns not giving a NaN;
 * first[0]: one differing pattern (for the report). */
__global__ void check(uint64_t base, unsigned long long *counts, unsigned int *first) {
    const uint64_t i = base + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t a = (uint32_t)i, b = pattern_partner(i);
    float fa, fb;
    memcpy(&fa, &a, 4);
    memcpy(&fb, &b, 4);
    const uint32_t r = cvt_pair(fa, fb);
    const uint16_t lo = (uint16_t)r, hi = (uint16_t)(r >> 16);
    unsigned long long bad = 0, bad_nan = 0;
    if (fa != fa) bad_nan += !bf16_is_nan(lo);
    else if (lo != mok__bf16_from_f32(fa)) {
        ++bad;
        atomicCAS(first, 0u, a);
    }
    if (fb != fb) bad_nan += !bf16_is_nan(hi);
    else if (hi != mok__bf16_from_f32(fb)) ++bad;
    if (bad) atomicAdd(&counts[0], bad);
    if (bad_nan) atomicAdd(&counts[1], bad_nan);
}

int main(void) {
    const pattern_result r = every_pattern(check);
    const unsigned long long *c = r.counts;
    int passed = 0, failed = 0;
    printf("bf16x2 probe: all 2^32 fp32 patterns as the low half, and a spread of partners as the high half\n");
    printf("non-NaN values rounded to other bits than mok__bf16_from_f32: %llu%s", c[0], c[0] ? "" : "\n");
    if (c[0]) printf(" (e.g. 0x%08x)\n", r.first);
    c[0] ? ++failed : ++passed;
    printf("NaN values not rounded to a NaN: %llu\n", c[1]);
    c[1] ? ++failed : ++passed;
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
