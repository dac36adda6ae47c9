/* For tests/ptxas_guard.sh: must build. serialised_wgmma.cu's loop with one straight path into
 * the accumulators (f32-typed loads), as the kernels' presets do: ptxas keeps the wgmmas
 * pipelined. Never linked into anything. */
#include <stdint.h>

#include "cuda/wgmma_tile.cuh"

__global__ void pipelined_wgmma(float *out, const float *in, uint64_t da, uint64_t db, int ktiles) {
    float acc[WS_ACC];
#pragma unroll
    for (int i = 0; i < WS_ACC; ++i) asm("ld.global.f32 %0, [%1];" : "=f"(acc[i]) : "l"(in + i * 128 + threadIdx.x));
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
