/* fp8_rows.cuh — quantization Q of bf16 values into E4M3 codes and power-of-two scales on the
 * device (include/mok.h, FP8 section; the scalar rules are core/fp8.h's, shared with the cpu):
 * one warp quantizes one block of 128 values, four per lane. The block's amax is a warp maximum
 * (exact and order-free, so every run and every backend picks the same scale). */
#ifndef MOK_CUDA_FP8_ROWS_CUH
#define MOK_CUDA_FP8_ROWS_CUH

#include <stdint.h>

#include "core/fp8.h"

/* The scale exponent of the block whose lanes hold these four values each (every lane gets it). */
static __device__ __forceinline__ int fp8_warp_scale_exp(const float (&v)[4]) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = mok__fp8_amax(amax, v[i]);
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    return mok__fp8_scale_exp(amax);
}

/* Four values' codes (value · 2^-e each), packed little-endian in value order. */
static __device__ __forceinline__ uint32_t fp8_codes4(const float (&v)[4], int e) {
    const float inverse = mok__fp8_pow2(-e);
    uint32_t out = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) out |= (uint32_t)mok__fp8_quantize(v[i], inverse) << (8 * i);
    return out;
}

/* One warp: the 128 bf16 values at src (8-byte aligned) into 128 codes at dst (4-byte aligned)
 * and their scale into *scale. */
static __device__ __forceinline__ void fp8_quantize_block(const uint16_t *src, uint8_t *dst, float *scale) {
    const int lane = threadIdx.x & 31;
    const uint2 raw = *(const uint2 *)(src + 4 * lane);
    const float v[4] = {mok__bf16_to_f32((uint16_t)(raw.x & 0xffffu)), mok__bf16_to_f32((uint16_t)(raw.x >> 16)),
                        mok__bf16_to_f32((uint16_t)(raw.y & 0xffffu)), mok__bf16_to_f32((uint16_t)(raw.y >> 16))};
    const int e = fp8_warp_scale_exp(v);
    *(uint32_t *)(dst + 4 * lane) = fp8_codes4(v, e);
    if (lane == 0) *scale = mok__fp8_pow2(e);
}

#endif
