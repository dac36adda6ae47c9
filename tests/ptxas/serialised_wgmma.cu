/* For tests/ptxas_guard.sh: must NOT build. The accumulators of a pipelined wgmma loop (a stage
 * still in flight at each wait) get two definitions, zeros on one branch and plain loads on the
 * other: ptxas serialises the wgmmas and says so (C751x "Potential Performance Loss"), which the
 * Makefile turns into a build failure. Never linked into anything. */
#include <stdint.h>

#include "cuda/wgmma_tile.cuh"

__global__ void serialised_wgmma(float *out, const float *in, int zero, uint64_t da, uint64_t db, int ktiles) {
    float acc[WS_ACC];
    if (zero) {
#pragma unroll
        for (int i = 0; i < WS_ACC; ++i) acc[i] = 0.0f;
    } else {
#pragma unroll
        for (int i = 0; i < WS_ACC; ++i) acc[i] = in[i * 128 + threadIdx.x];
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n256k16<0, 0>(acc, da + 4 * kt + k, db + 4 * kt + k, 1);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < WS_ACC; ++i) out[i * 128 + threadIdx.x] = acc[i];
}
