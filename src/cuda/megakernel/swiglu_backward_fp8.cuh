/* swiglu_backward_fp8.cuh — the SwiGLU backward of an FP8 dh tile (include/mok.h, FP8 section):
 * acc holds dh0 = dy^ · W^_down (fp32) for `cols` columns (128 or 256: one or two 128-column
 * blocks) [n0, n0 + cols) of the intermediate dim. From g|u it forms h = bf16(silu(g) · u) and each
 * block's h^ = Q(h), the router weight's partial <dh0, h^> per block (rdot[b] for block b, may be
 * NULL), dh = w · dh0 (w NULL: 1), dg, du in bf16 and dg^ = Q(dg), du^ = Q(du). Out: bf16(h^) into
 * h_out (exact: the down projection's weight gradient takes it), bf16 dg|du into dgu_out (the gate
 * and up weight gradients take them unquantized), and dg^|du^ into the code row gq_out (row r at
 * gq_out + r * gq_ld bytes: 2·inter codes, dg's then du's, then their 2·inter / 128 scales), which
 * the dx tiles read. A partial per 128-block, whatever the tile's width, gives d_router_w the same
 * bits at either width (the dx side sums inter / 128 of them in column order).
 *
 * A quantization block is a row's 128 columns, so each needs its row's maximum over both 64-column
 * chunks before any code: the epilogue sweeps a block's chunks twice, block by block. Sweep 1 (per
 * chunk, as the bf16 epilogue of swiglu.cuh: g|u into the staging tile, dh0 into the dh scratch, a
 * warp per row of 64 columns) computes h, dg, du, stores them in bf16 (h until sweep 2 puts
 * bf16(h^) in its place) and folds each row's maxima of |h|, |dg|, |du| into the dh scratch's
 * padding columns. Sweep 2 reads its own bf16 values back, quantizes them with the rows' scales,
 * replaces h by bf16(h^), writes the codes, and sums the router dot over h^ in the bf16
 * epilogue's order (a lane's two columns, the warp's lanes by xor 16 .. 1, the chunks in order).
 * With a replay, g|u and dg|du share their columns (gu == dgu_out): a chunk's g|u are in shared
 * memory before any of its dg|du are written. */
#ifndef MOK_CUDA_MEGAKERNEL_SWIGLU_BACKWARD_FP8_CUH
#define MOK_CUDA_MEGAKERNEL_SWIGLU_BACKWARD_FP8_CUH

#include "cuda/fp8_rows.cuh"
#include "cuda/megakernel/row_stores.cuh"
#include "cuda/megakernel/swiglu.cuh" /* add_row_partials */

/* The dh scratch's per-row padding (DH_SCRATCH_LD - 64 floats past the chunk's 64): the row's maxima. */
#define FP8_AMAX_H 64
#define FP8_AMAX_DG 65
#define FP8_AMAX_DU 66
static_assert(DH_SCRATCH_LD >= 67, "the rows' maxima fit the dh scratch's padding");

/* The maximum of a finite-magnitude over a warp (order-free, so every run gets the same). */
static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

/* Two bf16 values (a packed pair) quantized with scale 2^e: their codes, and bf16 of v^. */
static __device__ __forceinline__ uint32_t fp8_pair(uint32_t pair, int e, uint32_t *dequantized) {
    const float inverse = mok__fp8_pow2(-e), scale = mok__fp8_pow2(e);
    const uint32_t codes = e4m3x2_from_f32(__uint_as_float(pair << 16) * inverse,
                                           __uint_as_float(pair & 0xffff0000u) * inverse);
    float lo, hi;
    f32x2_from_e4m3x2(codes, &lo, &hi);
    *dequantized = bf16x2_from_f32(lo * scale, hi * scale);
    return codes;
}

static __device__ __forceinline__ void swiglu_backward_fp8(const float (&acc)[TILE_ACC], int rows, int cols,
                                                           const uint16_t *gu, long long gu_ld, long long inter, long long n0,
                                                           const float *w, float limit, uint16_t *h_out,
                                                           long long h_ld, uint16_t *dgu_out, long long dgu_ld,
                                                           uint8_t *gq_out, long long gq_ld, float *rdot,
                                                           long long rdot_ld, uint16_t *c, bool zero_pad) {
    const int t = threadIdx.x - PRODUCER_THREADS, lane = t & 31, warp = t >> 5;
    const int row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
    float *dsm = (float *)(c + TILE_BM * TILE_C_LD), *rsum = dsm + TILE_BM * DH_SCRATCH_LD, *wsm = rsum + TILE_BM;
    constexpr int RPI = 4; /* rows per iteration, as swiglu.cuh's */
    if (t < TILE_BM) {
        rsum[t] = 0.0f;
        wsm[t] = w && t < rows ? w[t] : 1.0f;
    }
    /* this thread's dh0 of chunk hc into the scratch's 64 columns */
    auto scratch_chunk = [&](int hc) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int a = 4 * (8 * hc + j) + 2 * half;
                *(float2 *)(dsm + (row0 + 8 * half) * DH_SCRATCH_LD + 8 * j + col0) = make_float2(acc[a], acc[a + 1]);
            }
    };
#pragma unroll
    for (int b = 0; b < TILE_BN / MOK_FP8_BLOCK; ++b) {
        if (b * MOK_FP8_BLOCK >= cols) break;
        /* sweep 1: h, dg, du in bf16 and the rows' maxima */
#pragma unroll
        for (int bc = 0; bc < MOK_FP8_BLOCK / 64; ++bc) {
            const int hc = b * (MOK_FP8_BLOCK / 64) + bc;
            for (int idx = t; idx < rows * 16; idx += CONSUMER_THREADS) {
                const int r = idx >> 4, c8 = (idx & 15) * 8;
                const uint16_t *src = gu + r * gu_ld + (c8 < 64 ? n0 + 64 * hc + c8 : inter + n0 + 64 * hc + c8 - 64);
                cp_async_16((uint32_t)__cvta_generic_to_shared(c + r * TILE_C_LD + c8), src, true);
            }
            scratch_chunk(hc);
            cp_async_wait_all();
            consumer_sync();
            const long long col = n0 + 64 * hc + 2 * lane;
#pragma unroll 1
            for (int rp = warp; rp < TILE_BM; rp += RPI * (CONSUMER_THREADS / 32)) {
#pragma unroll
                for (int k = 0; k < RPI; ++k) {
                    const int row = rp + 8 * k;
                    uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                    if (row >= rows) { /* warp-uniform */
                        if (zero_pad) *(uint32_t *)hp = *(uint32_t *)gp = *(uint32_t *)up = 0u;
                        continue;
                    }
                    const uint32_t gpair = *(const uint32_t *)(c + row * TILE_C_LD + 2 * lane);
                    const uint32_t upair = *(const uint32_t *)(c + row * TILE_C_LD + 64 + 2 * lane);
                    const float2 d = *(const float2 *)(dsm + row * DH_SCRATCH_LD + 2 * lane);
                    const float wr = wsm[row];
                    float h[2], dg[2], du[2];
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        mok__swiglu_with_backward(wr * (q ? d.y : d.x),
                                                  __uint_as_float(q ? gpair & 0xffff0000u : gpair << 16),
                                                  __uint_as_float(q ? upair & 0xffff0000u : upair << 16), limit,
                                                  &h[q], &dg[q], &du[q]);
                    const uint32_t hb = bf16x2_from_f32(h[0], h[1]), gb = bf16x2_from_f32(dg[0], dg[1]);
                    const uint32_t ub = bf16x2_from_f32(du[0], du[1]);
                    *(uint32_t *)hp = hb;
                    *(uint32_t *)gp = gb;
                    *(uint32_t *)up = ub;
                    float m[3] = {0.0f, 0.0f, 0.0f};
                    const uint32_t v[3] = {hb, gb, ub};
#pragma unroll
                    for (int i = 0; i < 3; ++i) {
                        m[i] = mok__fp8_amax(m[i], __uint_as_float(v[i] << 16));
                        m[i] = warp_max(mok__fp8_amax(m[i], __uint_as_float(v[i] & 0xffff0000u)));
                    }
                    if (lane == 0) {
                        float *pad = dsm + row * DH_SCRATCH_LD;
                        pad[FP8_AMAX_H] = bc ? fmaxf(pad[FP8_AMAX_H], m[0]) : m[0];
                        pad[FP8_AMAX_DG] = bc ? fmaxf(pad[FP8_AMAX_DG], m[1]) : m[1];
                        pad[FP8_AMAX_DU] = bc ? fmaxf(pad[FP8_AMAX_DU], m[2]) : m[2];
                    }
                }
            }
            consumer_sync(); /* c and the scratch are read; the next chunk may write them */
        }
        /* sweep 2: h^ in place of h, the codes of dg and du, the router dot over h^ */
#pragma unroll
        for (int bc = 0; bc < MOK_FP8_BLOCK / 64; ++bc) {
            const int hc = b * (MOK_FP8_BLOCK / 64) + bc;
            scratch_chunk(hc);
            consumer_sync();
            const long long col = n0 + 64 * hc + 2 * lane;
#pragma unroll 1
            for (int rp = warp; rp < TILE_BM; rp += RPI * (CONSUMER_THREADS / 32)) {
                float part[RPI];
#pragma unroll
                for (int k = 0; k < RPI; ++k) {
                    part[k] = 0.0f;
                    const int row = rp + 8 * k;
                    if (row >= rows) continue;
                    const float *pad = dsm + row * DH_SCRATCH_LD;
                    const float2 d = *(const float2 *)(pad + 2 * lane);
                    uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                    uint32_t hq, unused;
                    fp8_pair(*(const uint32_t *)hp, mok__fp8_scale_exp(pad[FP8_AMAX_H]), &hq);
                    const uint32_t gcodes =
                        fp8_pair(*(const uint32_t *)gp, mok__fp8_scale_exp(pad[FP8_AMAX_DG]), &unused);
                    const uint32_t ucodes =
                        fp8_pair(*(const uint32_t *)up, mok__fp8_scale_exp(pad[FP8_AMAX_DU]), &unused);
                    *(uint32_t *)hp = hq;
                    uint8_t *q = gq_out + row * gq_ld + col; /* dg^'s code; du^'s inter further */
                    *(uint16_t *)q = (uint16_t)gcodes;
                    *(uint16_t *)(q + inter) = (uint16_t)ucodes;
                    part[k] += d.x * __uint_as_float(hq << 16);
                    part[k] += d.y * __uint_as_float(hq & 0xffff0000u);
                }
                add_row_partials(part, rp, rows, rsum);
            }
            consumer_sync();
        }
        /* the block's scales and router partial, from the maxima the next block overwrites (the
           barrier above orders these reads before them) */
        if (t < rows) {
            const float *pad = dsm + t * DH_SCRATCH_LD;
            float *scales = (float *)(gq_out + t * gq_ld + 2 * inter);
            const long long blk = n0 / MOK_FP8_BLOCK + b;
            scales[blk] = mok__fp8_pow2(mok__fp8_scale_exp(pad[FP8_AMAX_DG]));
            scales[inter / MOK_FP8_BLOCK + blk] = mok__fp8_pow2(mok__fp8_scale_exp(pad[FP8_AMAX_DU]));
            if (rdot) rdot[t * rdot_ld + b] = rsum[t];
            rsum[t] = 0.0f;
        }
        consumer_sync(); /* the maxima and rsum are read before the next block writes them */
    }
}

#endif
