/* fp8.h — E4M3 and its block scales, for host C and CUDA device code alike: the conversion both
 * ways, the scale rule and the quantization of one value (include/mok.h, FP8 section). One
 * definition for every backend; the reference has its own (src/ref/ref.c).
 *
 * The one idea: a block's scale is a power of two chosen so that amax / scale <= 448, so the
 * division is exact, the conversion never overflows, and a dequantized value q · scale is exact. */
#ifndef MOK_CORE_FP8_H
#define MOK_CORE_FP8_H

#include <stdint.h>

#include "mok.h"
#include "portable.h"

#define MOK_E4M3_MAX 448.0f
#define MOK_E4M3_NAN 0x7fu
/* The smallest scale exponent: from 2^-124 on, the smallest E4M3 subnormal times the scale
 * (2^-133) is still a bf16 value, so every dequantized value is exact in bf16. */
#define MOK_FP8_SCALE_EXP_MIN (-124)

/* E4M3 of an fp32 value: round to nearest, ties to the even mantissa, in one step. NaN and ±Inf
 * give the NaN code with the input's sign bit; so do magnitudes above 464 (they would round to
 * 480, past the largest finite 448; 464 itself ties to 448). */
MOK_INLINE uint8_t mok__e4m3_from_f32(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const uint32_t mag = bits & 0x7fffffffu;
    if (mag > 0x43e80000u) return (uint8_t)(sign | MOK_E4M3_NAN); /* NaN, ±Inf, > 464 */
    if (mag < 0x3c800000u) {                                      /* below 2^-6: m · 2^-9 */
        if (mag < 0x00800000u) return sign;                       /* below 2^-126: 0 */
        /* |v| · 2^9 = M · 2^-shift with M the 24-bit significand; round M >> shift to even */
        const int shift = 141 - (int)(mag >> 23);
        if (shift > 24) return sign; /* below 2^-10, half the smallest subnormal */
        const uint32_t M = (mag & 0x7fffffu) | 0x800000u;
        uint32_t q = M >> shift;
        const uint32_t rem = M & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q; /* q = 8 is the smallest normal, 0x08 */
        return (uint8_t)(sign | q);
    }
    /* Normal: keep 3 of fp32's 23 fraction bits, rounding the other 20 to even; a carry moves
     * into the exponent on its own. Exponent bias: fp32 127, E4M3 7. */
    const uint32_t rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
    return (uint8_t)(sign | (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u));
}

MOK_INLINE float mok__e4m3_to_f32(uint8_t code) {
    const uint32_t sign = (uint32_t)(code & 0x80u) << 24, exponent = (code >> 3) & 15u, mantissa = code & 7u;
    uint32_t bits;
    if (exponent == 15u && mantissa == 7u) {
        bits = sign | 0x7fc00000u;
    } else if (exponent == 0u) {
        const float sub = (float)mantissa * 0x1p-9f;
        memcpy(&bits, &sub, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((exponent + 120u) << 23) | (mantissa << 20);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The running amax of a block: the largest finite |v| (NaN and ±Inf are skipped, so a non-finite
 * value never sets the scale). */
MOK_INLINE float mok__fp8_amax(float amax, float value) {
    const float magnitude = fabsf(value);
    return (magnitude <= 0x1.fffffep127f && magnitude > amax) ? magnitude : amax;
}

/* The scale exponent of a block with this amax (finite, >= 0): the smallest e >= -124 with
 * amax <= 448 · 2^e; 0 for amax = 0. 448 = 1.75 · 2^8, so with amax = f · 2^E, f in [1, 2):
 * e = E - 8 when f <= 1.75 (fraction bits <= 0x600000), else E - 7. */
MOK_INLINE int mok__fp8_scale_exp(float amax) {
    uint32_t bits;
    memcpy(&bits, &amax, sizeof bits);
    if (bits == 0u) return 0;
    if (bits < 0x00800000u) return MOK_FP8_SCALE_EXP_MIN; /* fp32 subnormal: far below the floor */
    const int e = (int)(bits >> 23) - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
    return e < MOK_FP8_SCALE_EXP_MIN ? MOK_FP8_SCALE_EXP_MIN : e;
}

/* 2^e as fp32, for e in [-126, 127] (scale exponents and their negations). */
MOK_INLINE float mok__fp8_pow2(int e) {
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One value of a block whose scale is 2^e: its code. v · 2^-e is exact (or, below fp32's normal
 * range, so small that its E4M3 value is 0 either way), so this is E4M3(v / scale). */
MOK_INLINE uint8_t mok__fp8_quantize(float value, float inverse_scale) {
    return mok__e4m3_from_f32(value * inverse_scale);
}

/* The dequantized value q · scale of value v: what every GEMM operand of the FP8 function is. */
MOK_INLINE float mok__fp8_round(float value, float scale, float inverse_scale) {
    return mok__e4m3_to_f32(mok__fp8_quantize(value, inverse_scale)) * scale;
}

#endif
