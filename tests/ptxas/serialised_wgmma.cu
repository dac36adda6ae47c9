/* For tests/ptxas_guard.sh: must NOT build. The accumulators of a pipelined wgmma loop (a stage
 * still in flight at each wait) get two definitions, zeros on one branch and plain loads on the
 * other: ptxas serialises the wgmmas and says so (C751x "Potential Performance Loss"), which the
 * Makefile turns into a build failure. Never linked into anything. */
#include "wgmma_loop.cuh"

__global__ void serialised_wgmma(float *out, const float *in, int zero, uint64_t da, uint64_t db, int ktiles) {
    float acc[WGMMA_N256_ACC];
    if (zero) {
#pragma unroll
        for (int i = 0; i < WGMMA_N256_ACC; ++i) acc[i] = 0.0f;
    } else {
#pragma unroll
        for (int i = 0; i < WGMMA_N256_ACC; ++i) acc[i] = in[i * 128 + threadIdx.x];
    }
    pipelined_loop(acc, out, da, db, ktiles);
}
