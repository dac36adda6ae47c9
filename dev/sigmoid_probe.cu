/* sigmoid_probe.cu — check: how far is the device's logistic (mok__sigmoid of src/core/portable.h,
 * accurate expf and the SFU's rcp.approx.ftz) from the exact 1 / (1 + e^-v), over every fp32 v?
 *
 * The exact value is taken in fp64 (exp of a double, then the division), which is exact to far
 * below an fp32 ulp. Where it is at least FLT_MIN the device's result must lie within 8 ulps of it
 * (an ulp being that of the exact value's binade); below FLT_MIN it must be 0 or within FLT_MIN
 * (rcp.approx.ftz flushes those results). A NaN input must give a NaN. The probe also reports the
 * largest error it saw, in ulps, and the same for the IEEE division the host uses.
 *
 * Build and run from the repository root (sm_90a here):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a dev/sigmoid_probe.cu \
 *        -o build/sigmoid_probe && ./build/sigmoid_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "every_pattern.cuh"

#include "core/portable.h"

#define BOUND_ULPS 8.0

/* |got - exact| in ulps of the exact value's binade (exact >= FLT_MIN). */
__device__ static inline double ulps(float got, double exact) {
    int e;
    frexp(exact, &e); /* exact = m 2^e, 0.5 <= m < 1: its fp32 ulp is 2^(e - 24) */
    return fabs((double)got - exact) / ldexp(1.0, e - 24);
}

/* The maximum of non-negative doubles through their bits (they order as unsigned integers). */
__device__ static inline void max_into(unsigned long long *slot, double v) {
    unsigned long long b;
    memcpy(&b, &v, 8);
    atomicMax(slot, b);
}

/* counts[0]: patterns outside the bound; counts[1]: NaN inputs not giving a NaN;
 * counts[2], counts[3]: the largest error in ulps (as double bits) of mok__sigmoid and of the IEEE
 * division; first: one pattern outside the bound. */
__global__ void check(uint64_t base, unsigned long long *counts, unsigned int *first) {
    const uint64_t i = base + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t a = (uint32_t)i;
    float v;
    memcpy(&v, &a, 4);
    const float got = mok__sigmoid(v);
    if (v != v) {
        if (got == got) atomicAdd(&counts[1], 1ull);
        return;
    }
    const float ieee = 1.0f / (1.0f + expf(-v));
    const double exact = 1.0 / (1.0 + exp(-(double)v));
    bool bad;
    if (exact >= (double)FLT_MIN) {
        const double e = ulps(got, exact);
        bad = !(e <= BOUND_ULPS);
        max_into(&counts[2], e);
        max_into(&counts[3], ulps(ieee, exact));
    } else {
        bad = !(got == 0.0f || fabs((double)got - exact) <= (double)FLT_MIN);
    }
    if (bad) {
        atomicAdd(&counts[0], 1ull);
        atomicCAS(first, 0u, a);
    }
}

int main(void) {
    const pattern_result r = every_pattern(check);
    const unsigned long long *c = r.counts;
    double worst, worst_ieee;
    memcpy(&worst, &c[2], 8);
    memcpy(&worst_ieee, &c[3], 8);
    int passed = 0, failed = 0;
    printf("sigmoid probe: all 2^32 fp32 inputs against the fp64 logistic\n");
    printf("largest error, mok__sigmoid on the device: %.3f ulps (IEEE division: %.3f ulps)\n", worst, worst_ieee);
    printf("inputs outside %.0f ulps (or not flushed below FLT_MIN): %llu", BOUND_ULPS, c[0]);
    if (c[0]) {
        float v;
        memcpy(&v, &r.first, 4);
        printf(" (e.g. 0x%08x = %.9g)", r.first, v);
    }
    printf("\n");
    c[0] ? ++failed : ++passed;
    printf("NaN inputs not giving a NaN: %llu\n", c[1]);
    c[1] ? ++failed : ++passed;
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
