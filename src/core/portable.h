/* portable.h — what host C and CUDA device code share: the host/device marker, bf16 rounding,
 * and the SwiGLU pointwise math. One definition of each rounding point for every backend. */
#ifndef MOK_CORE_PORTABLE_H
#define MOK_CORE_PORTABLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__
#define MOK_INLINE static __host__ __device__ __forceinline__
/* MOK_CORE marks the core's portable definitions (the .inc files beside this one). The host
 * library compiles each once (tasks.c, schedule.c) with external linkage; the cuda backend
 * compiles them into each translation unit that needs them (cuda/core.cuh), where they have
 * internal linkage and are compiled for host and device. */
#define MOK_CORE static __host__ __device__
#else
#define MOK_HD
#define MOK_INLINE static inline
#define MOK_CORE
#endif

/* Round to nearest even; NaN keeps a quiet NaN with its sign. */
MOK_INLINE uint16_t mok__bf16_from_f32(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

MOK_INLINE float mok__bf16_to_f32(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

MOK_INLINE float mok__round_bf16(float value) { return mok__bf16_to_f32(mok__bf16_from_f32(value)); }

/* The clamp of the SwiGLU limit. Written with comparisons so that NaN passes through as NaN
 * (fminf would turn it into the limit). limit <= 0 means no clamp. */
MOK_INLINE float mok__clamp_gate(float g, float limit) { return (limit > 0.0f && g > limit) ? limit : g; }
MOK_INLINE float mok__clamp_up(float u, float limit) {
    if (limit <= 0.0f) return u;
    return u > limit ? limit : (u < -limit ? -limit : u);
}

/* Pass-through masks of the clamp's gradient, inclusive at the limit (as torch.clamp). */
MOK_INLINE float mok__clamp_gate_mask(float g, float limit) { return (limit > 0.0f && g > limit) ? 0.0f : 1.0f; }
MOK_INLINE float mok__clamp_up_mask(float u, float limit) {
    return (limit > 0.0f && (u > limit || u < -limit)) ? 0.0f : 1.0f;
}

/* The logistic 1 / (1 + e^-v). On the device the reciprocal is the SFU's rcp.approx.ftz (at most
 * one ulp off, flushing results below FLT_MIN to zero) instead of the IEEE division, which the
 * compiler expands into a Newton step and a slow-path branch: the sigmoid is the longest line of the
 * SwiGLU epilogues. expf stays the accurate one. dev/sigmoid_probe.cu bounds the device's result on
 * every fp32 input: within 8 ulps of the exact logistic, or zero where that is below FLT_MIN. The
 * host keeps the IEEE division. */
MOK_INLINE float mok__sigmoid(float v) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + expf(-v)));
    return r;
#else
    return 1.0f / (1.0f + expf(-v));
#endif
}

/* h = silu(clamp(g)) * clamp(u) in fp32; the caller rounds h to bf16. */
MOK_INLINE float mok__swiglu(float g, float u, float limit) {
    float gc = mok__clamp_gate(g, limit), uc = mok__clamp_up(u, limit);
    return gc * mok__sigmoid(gc) * uc;
}

/* SwiGLU backward: given dh (fp32) and the forward's bf16 g, u, the gradients of g and u. */
MOK_INLINE void mok__swiglu_backward(float dh, float g, float u, float limit, float *dg, float *du) {
    float gc = mok__clamp_gate(g, limit), uc = mok__clamp_up(u, limit);
    float s = mok__sigmoid(gc);
    float silu = gc * s;
    float dsilu = s * (1.0f + gc * (1.0f - s));
    *dg = dh * uc * dsilu * mok__clamp_gate_mask(g, limit);
    *du = dh * silu * mok__clamp_up_mask(u, limit);
}

/* h and the SwiGLU backward from one sigmoid: the values of mok__swiglu and
 * mok__swiglu_backward called apart (the same expressions), for the tiles that need both. */
MOK_INLINE void mok__swiglu_with_backward(float dh, float g, float u, float limit, float *h, float *dg, float *du) {
    float gc = mok__clamp_gate(g, limit), uc = mok__clamp_up(u, limit);
    float s = mok__sigmoid(gc);
    float silu = gc * s;
    *h = silu * uc;
    float dsilu = s * (1.0f + gc * (1.0f - s));
    *dg = dh * uc * dsilu * mok__clamp_gate_mask(g, limit);
    *du = dh * silu * mok__clamp_up_mask(u, limit);
}

#endif
