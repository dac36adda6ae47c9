/* For tests/ptxas/*.cu: the loop both kernels share, as the kernels' consumers run it (a stage
 * still in flight at each wait), then the accumulators out. Only how acc is defined before it
 * differs between the two files. */
#ifndef MOK_TESTS_PTXAS_WGMMA_LOOP_CUH
#define MOK_TESTS_PTXAS_WGMMA_LOOP_CUH

#include <stdint.h>

#include "cuda/sm90/ptx.cuh"

static __device__ __forceinline__ void pipelined_loop(float (&acc)[WGMMA_N256_ACC], float *out, uint64_t da, uint64_t db,
                                                      int ktiles) {
    for (int kt = 0; kt < ktiles; ++kt) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n256k16<0, 0>(acc, da + 4 * kt + k, db + 4 * kt + k, 1);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < WGMMA_N256_ACC; ++i) out[i * 128 + threadIdx.x] = acc[i];
}

#endif
