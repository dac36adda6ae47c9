/* fp8_rows.cuh — quantization Q of bf16 values into E4M3 codes and power-of-two scales on the
 * device (include/mok.h, FP8 section; the scalar rules are core/fp8.h's, shared with the cpu):
 * one warp quantizes a block of 128 values, four per lane, several blocks at once. A block's amax
 * is a warp maximum (exact and order-free, so every run and every backend picks the same scale). */
#ifndef MOK_CUDA_FP8_ROWS_CUH
#define MOK_CUDA_FP8_ROWS_CUH

#include <stdint.h>

#include "core/fp8.h"
#include "cuda/device.cuh"

/* The maximum over a warp of the lanes' amax values (mok__fp8_amax's: finite and >= +0). For such
 * floats the order of the bit patterns as unsigned integers is the order of the values, so one
 * integer reduction (redux.sync) gives the maximum: exact and order-free, as a butterfly of
 * shuffles and fmaxf would be, in one instruction instead of ten. */
static __device__ __forceinline__ float warp_amax(float amax) {
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(amax)));
}

/* The scale exponent of the block whose lanes hold these four values each (every lane gets it). */
static __device__ __forceinline__ int fp8_warp_scale_exp(const float (&v)[4]) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = mok__fp8_amax(amax, v[i]);
    return mok__fp8_scale_exp(warp_amax(amax));
}

/* The codes mok__e4m3_from_f32 gives two fp32 values, lo in the low byte: one
 * cvt.rn.satfinite.e4m3x2.f32 (round to nearest, ties to even, as there), then what the
 * instruction does otherwise: it saturates ±Inf and magnitudes past 464 to ±448, where the
 * portable rule gives the NaN code with the input's sign. dev/e4m3_probe.cu checks every fp32
 * pattern against mok__e4m3_from_f32. */
static __device__ __forceinline__ uint32_t e4m3x2_cvt(float lo, float hi) {
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
}
static __device__ __forceinline__ uint32_t e4m3x2_from_f32(float lo, float hi) {
    uint32_t out = e4m3x2_cvt(lo, hi);
    const uint32_t l = __float_as_uint(lo), h = __float_as_uint(hi);
    if ((l & 0x7fffffffu) > 0x43e80000u) out = (out & 0xff00u) | ((l >> 24) & 0x80u) | MOK_E4M3_NAN;
    if ((h & 0x7fffffffu) > 0x43e80000u) out = (out & 0x00ffu) | ((((h >> 24) & 0x80u) | MOK_E4M3_NAN) << 8);
    return out;
}

/* Blocks of bf16 values held as packed pairs. A bf16 magnitude's bit pattern (v & 0x7fff) orders
 * as its value, and the finite ones are those up to BF16_FINITE_MAX_BITS (Inf is 0x7f80, NaNs lie
 * above), so a block's amax is an integer maximum of its pairs' magnitudes: an AND and a u16x2
 * max (one VIMNMX) per pair. When that maximum is finite it is mok__fp8_amax's, and every value
 * of the block times 2^-e (e from that amax) lies within ±448: cvt.rn.satfinite.e4m3x2 alone
 * (e4m3x2_cvt) gives mok__e4m3_from_f32's codes. A block that holds an Inf or a NaN takes
 * bf16x2_finite_abs_max and e4m3x2_from_f32 instead. */
#define BF16_FINITE_MAX_BITS 0x7f7fu
static __device__ __forceinline__ uint32_t bf16x2_abs_max(uint32_t m, uint32_t pair) {
    return __vmaxu2(m, pair & 0x7fff7fffu);
}
/* The same over finite magnitudes only (a non-finite one counts as 0, as in mok__fp8_amax). */
static __device__ __forceinline__ uint32_t bf16x2_finite_abs_max(uint32_t m, uint32_t pair) {
    const uint32_t a = pair & 0x7fff7fffu;
    return __vmaxu2(m, a & __vcmpleu2(a, BF16_FINITE_MAX_BITS * 0x10001u));
}
/* The larger of a packed pair of maxima, as the bit pattern of a bf16 magnitude. */
static __device__ __forceinline__ uint32_t bf16x2_fold(uint32_t m) { return __vmaxu2(m, m >> 16) & 0xffffu; }
/* The warp's maximum of the lanes' packed maxima, as the bit pattern of a bf16 magnitude. */
static __device__ __forceinline__ uint32_t bf16x2_warp_max(uint32_t m) {
    return __reduce_max_sync(0xffffffffu, bf16x2_fold(m));
}
/* The amax that a magnitude's bit pattern stands for. */
static __device__ __forceinline__ float bf16_bits_f32(uint32_t bits) { return __uint_as_float(bits << 16); }
/* Two values' codes in a block known finite (FIX false: the conversion alone) or not. */
template <bool FIX>
static __device__ __forceinline__ uint32_t e4m3x2_codes(float lo, float hi) {
    if constexpr (FIX) return e4m3x2_from_f32(lo, hi);
    else return e4m3x2_cvt(lo, hi);
}
/* A compile-time FIX for a generic lambda: body(e4m3_fix<true>{}) */
template <bool FIX>
struct e4m3_fix {
    static constexpr bool value = FIX;
};

/* Four values' codes (value · 2^-e each, mok__fp8_quantize), packed little-endian in value order. */
static __device__ __forceinline__ uint32_t fp8_codes4(const float (&v)[4], int e) {
    const float inverse = mok__fp8_pow2(-e);
    return e4m3x2_from_f32(v[0] * inverse, v[1] * inverse) | e4m3x2_from_f32(v[2] * inverse, v[3] * inverse) << 16;
}

/* A lane's four bf16 values of a 128-value block (8-byte aligned) as fp32. */
static __device__ __forceinline__ void fp8_load4(const uint16_t *block, float (&v)[4]) {
    const uint2 raw = *(const uint2 *)(block + 4 * (threadIdx.x & 31));
    v[0] = mok__bf16_to_f32((uint16_t)(raw.x & 0xffffu));
    v[1] = mok__bf16_to_f32((uint16_t)(raw.x >> 16));
    v[2] = mok__bf16_to_f32((uint16_t)(raw.y & 0xffffu));
    v[3] = mok__bf16_to_f32((uint16_t)(raw.y >> 16));
}

/* Two codes (lo in the low byte) as fp32: E4M3 widens exactly to f16 (cvt.rn.f16x2.e4m3x2), f16 to
 * fp32; the NaN code gives NaN. */
static __device__ __forceinline__ void f32x2_from_e4m3x2(uint32_t pair, float *lo, float *hi) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((uint16_t)pair));
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(*lo), "=f"(*hi) : "r"(h2));
}

/* Eight codes (little-endian in `codes`) dequantized with scale s, as bf16: exact (mok.h), a code
 * times a power of two, down to fp32's and bf16's subnormals. */
static __device__ __forceinline__ int4 bf16x8_from_e4m3x8(uint2 codes, float s) {
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lo, hi;
        f32x2_from_e4m3x2(((i < 2 ? codes.x : codes.y) >> (16 * (i & 1))) & 0xffffu, &lo, &hi);
        out[i] = bf16x2_from_f32(lo * s, hi * s);
    }
    return make_int4((int)out[0], (int)out[1], (int)out[2], (int)out[3]);
}

/* One warp, FP8_ROWS_ILP blocks at once (each block's own src, dst and scale; a block with
 * valid[i] false is read nowhere and written nowhere): the blocks' loads, then their maxima, then
 * their stores, so that the blocks' latencies overlap instead of adding up (the loads may alias
 * the stores of another block as far as the compiler knows, so it would not reorder them). */
#define FP8_ROWS_ILP 4
static __device__ __forceinline__ void fp8_quantize_blocks(const uint16_t *const (&src)[FP8_ROWS_ILP],
                                                           uint8_t *const (&dst)[FP8_ROWS_ILP],
                                                           float *const (&scale)[FP8_ROWS_ILP],
                                                           const bool (&valid)[FP8_ROWS_ILP]) {
    const int lane = threadIdx.x & 31;
    float v[FP8_ROWS_ILP][4];
#pragma unroll
    for (int i = 0; i < FP8_ROWS_ILP; ++i) {
        if (valid[i]) fp8_load4(src[i], v[i]);
        else v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.0f;
    }
    int e[FP8_ROWS_ILP];
#pragma unroll
    for (int i = 0; i < FP8_ROWS_ILP; ++i) e[i] = fp8_warp_scale_exp(v[i]);
#pragma unroll
    for (int i = 0; i < FP8_ROWS_ILP; ++i)
        if (valid[i]) {
            *(uint32_t *)(dst[i] + 4 * lane) = fp8_codes4(v[i], e[i]);
            if (lane == 0) *scale[i] = mok__fp8_pow2(e[i]);
        }
}

#endif
