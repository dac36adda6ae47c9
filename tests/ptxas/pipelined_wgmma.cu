/* For tests/ptxas_guard.sh: must build. serialised_wgmma.cu's loop with one straight path into
 * the accumulators (f32-typed loads), as the kernels' presets do: ptxas keeps the wgmmas
 * pipelined. Never linked into anything. */
#include "wgmma_loop.cuh"

__global__ void pipelined_wgmma(float *out, const float *in, uint64_t da, uint64_t db, int ktiles) {
    float acc[WGMMA_N256_ACC];
#pragma unroll
    for (int i = 0; i < WGMMA_N256_ACC; ++i) asm("ld.global.f32 %0, [%1];" : "=f"(acc[i]) : "l"(in + i * 128 + threadIdx.x));
    pipelined_loop(acc, out, da, db, ktiles);
}
