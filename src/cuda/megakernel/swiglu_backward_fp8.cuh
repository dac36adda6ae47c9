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
 * A quantization block is a row's 128 columns, so a warp takes whole rows of a block: a lane holds
 * columns 2·lane, 2·lane + 1 of both 64-column halves, the row's maxima are warp maxima, and every
 * value is quantized in the registers it was computed in, in one pass (a pass per half block that
 * stored h, dg, du and read them back for their codes spent half the epilogue waiting on those
 * reads: docs/log.md). A block's g|u and dh0 for all 128 rows do not fit the staging region, so it
 * runs in two phases of 64 rows, each consumer warpgroup's own (its accumulator rows): phase h
 * loads g|u of rows 64h .. 64h + 63 (16-byte cp.async), warpgroup h puts its dh0 of the block in
 * the scratch, and all eight warps take the phase's rows, RPI at a time: the values and the
 * lanes' maxima of every row first, then the warp maxima, then codes, stores and the router dot.
 * The maxima are of the values' bit patterns (fp8_rows.cuh); an iteration whose blocks are all
 * finite converts without e4m3x2_from_f32's fix-up, one that holds an Inf or a NaN takes the
 * maxima of finite values and the fix-up, so both give mok__fp8_quantize's codes.
 * The router dot sums a lane's two columns, the warp's lanes by xor 16 .. 1, then the block's two
 * halves in order. With a replay, g|u and dg|du share their columns (gu == dgu_out): a phase's g|u
 * are in shared memory before any of its dg|du are written. */
#ifndef MOK_CUDA_MEGAKERNEL_SWIGLU_BACKWARD_FP8_CUH
#define MOK_CUDA_MEGAKERNEL_SWIGLU_BACKWARD_FP8_CUH

#include "cuda/fp8_rows.cuh"
#include "cuda/megakernel/row_stores.cuh"
#include "cuda/megakernel/swiglu.cuh"

/* The phase's tiles in the staging region (compute_walk.cuh): g|u of 64 rows (a row's 128 g, then
 * its 128 u, bf16) in the staging tile, then dh0 of those rows (fp32) and the 128 rows' router
 * weights in the dh scratch. */
#define FP8_GU_LD (2 * MOK_FP8_BLOCK + 8)
#define FP8_DH_LD (MOK_FP8_BLOCK + 4)
static_assert(64 * FP8_GU_LD * 2 <= SMEM_STAGING_BYTES, "a phase's g|u fit the staging tile");
static_assert((64 * FP8_DH_LD + TILE_BM) * 4 <= DH_SCRATCH_BYTES, "a phase's dh0 and the weights fit the dh scratch");

/* Two bf16 values (a packed pair) quantized with scale 2^e: their codes, and bf16 of v^ (FIX:
 * fp8_rows.cuh's e4m3x2_codes). */
template <bool FIX>
static __device__ __forceinline__ uint32_t fp8_pair(uint32_t pair, int e, uint32_t *dequantized) {
    const float inverse = mok__fp8_pow2(-e), scale = mok__fp8_pow2(e);
    const uint32_t codes = e4m3x2_codes<FIX>(__uint_as_float(pair << 16) * inverse,
                                             __uint_as_float(pair & 0xffff0000u) * inverse);
    float lo, hi;
    f32x2_from_e4m3x2(codes, &lo, &hi);
    *dequantized = bf16x2_from_f32(lo * scale, hi * scale);
    return codes;
}

static __device__ __forceinline__ void swiglu_backward_fp8(const float (&acc)[TILE_ACC], int rows, int cols,
                                                           const uint16_t *gu, long long gu_ld, long long inter,
                                                           long long n0, const float *w, float limit, uint16_t *h_out,
                                                           long long h_ld, uint16_t *dgu_out, long long dgu_ld,
                                                           uint8_t *gq_out, long long gq_ld, float *rdot,
                                                           long long rdot_ld, uint16_t *c, bool zero_pad) {
    const int t = threadIdx.x - PRODUCER_THREADS, lane = t & 31, warp = t >> 5;
    const int frow = (warp & 3) * 16 + (lane >> 2), col0 = 2 * (lane & 3); /* the fragment's rows in its half */
    float *dsm = (float *)(c + TILE_BM * TILE_C_LD), *wsm = dsm + 64 * FP8_DH_LD;
    constexpr int RPI = 2; /* rows per iteration (four spilled more and ran slower: docs/log.md); the
                              router dot's sums take RPI * 2 = 4 values (warp_sums4) */
    static_assert(RPI == 2, "warp_sums4 sums a row pair's two halves");
    if (t < TILE_BM) wsm[t] = w && t < rows ? w[t] : 1.0f;
#pragma unroll
    for (int b = 0; b < TILE_BN / MOK_FP8_BLOCK; ++b) {
        if (b * MOK_FP8_BLOCK >= cols) break;
        const long long cb = n0 + MOK_FP8_BLOCK * b;
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
            const int r0 = 64 * half, nr = rows - r0 < 0 ? 0 : (rows - r0 < 64 ? rows - r0 : 64);
            for (int idx = t; idx < nr * 32; idx += CONSUMER_THREADS) {
                const int r = idx >> 5, c8 = (idx & 31) * 8;
                const uint16_t *src =
                    gu + (r0 + r) * gu_ld + (c8 < MOK_FP8_BLOCK ? cb + c8 : inter + cb + c8 - MOK_FP8_BLOCK);
                cp_async_16((uint32_t)__cvta_generic_to_shared(c + r * FP8_GU_LD + c8), src, true);
            }
            if ((warp >> 2) == half) /* warp-uniform: this warpgroup's accumulators are the phase's rows */
#pragma unroll
                for (int bc = 0; bc < 2; ++bc)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const int a = 4 * (8 * (2 * b + bc) + j) + 2 * hf;
                            *(float2 *)(dsm + (frow + 8 * hf) * FP8_DH_LD + 64 * bc + 8 * j + col0) =
                                make_float2(acc[a], acc[a + 1]);
                        }
            cp_async_wait_all();
            consumer_sync();
#pragma unroll 1
            for (int rp = warp; rp < 64; rp += RPI * (CONSUMER_THREADS / 32)) {
                uint32_t hb[RPI][2], gb[RPI][2], ub[RPI][2];
                float2 d[RPI][2];
                uint32_t m[RPI][3]; /* the lanes' packed magnitude maxima of h, dg, du (fp8_rows.cuh) */
#pragma unroll
                for (int k = 0; k < RPI; ++k) { /* values and the lanes' maxima */
                    const int lr = rp + 8 * k;
                    m[k][0] = m[k][1] = m[k][2] = 0u;
#pragma unroll
                    for (int hc = 0; hc < 2; ++hc) {
                        hb[k][hc] = gb[k][hc] = ub[k][hc] = 0u;
                        d[k][hc] = make_float2(0.0f, 0.0f);
                        if (r0 + lr >= rows) continue; /* warp-uniform */
                        const uint32_t gpair = *(const uint32_t *)(c + lr * FP8_GU_LD + 64 * hc + 2 * lane);
                        const uint32_t upair =
                            *(const uint32_t *)(c + lr * FP8_GU_LD + MOK_FP8_BLOCK + 64 * hc + 2 * lane);
                        d[k][hc] = *(const float2 *)(dsm + lr * FP8_DH_LD + 64 * hc + 2 * lane);
                        const float wr = wsm[r0 + lr];
                        float h[2], dg[2], du[2];
#pragma unroll
                        for (int q = 0; q < 2; ++q)
                            mok__swiglu_with_backward(wr * (q ? d[k][hc].y : d[k][hc].x),
                                                      __uint_as_float(q ? gpair & 0xffff0000u : gpair << 16),
                                                      __uint_as_float(q ? upair & 0xffff0000u : upair << 16), limit,
                                                      &h[q], &dg[q], &du[q]);
                        hb[k][hc] = bf16x2_from_f32(h[0], h[1]);
                        gb[k][hc] = bf16x2_from_f32(dg[0], dg[1]);
                        ub[k][hc] = bf16x2_from_f32(du[0], du[1]);
                        m[k][0] = bf16x2_abs_max(m[k][0], hb[k][hc]);
                        m[k][1] = bf16x2_abs_max(m[k][1], gb[k][hc]);
                        m[k][2] = bf16x2_abs_max(m[k][2], ub[k][hc]);
                    }
                }
                uint32_t top = 0u; /* the largest magnitude of the iteration's blocks: warp-uniform */
#pragma unroll
                for (int k = 0; k < RPI; ++k)
#pragma unroll
                    for (int i = 0; i < 3; ++i) {
                        m[k][i] = bf16x2_warp_max(m[k][i]);
                        top = max(top, m[k][i]);
                    }
                float part[RPI][2];
                /* codes, stores, the router dot's lane partials; FIX: a block may hold an Inf or a NaN */
                auto quantize = [&](auto fix) {
                    constexpr bool FIX = decltype(fix)::value;
                    if constexpr (FIX) { /* the maxima of finite magnitudes only */
#pragma unroll
                        for (int k = 0; k < RPI; ++k) {
                            m[k][0] = m[k][1] = m[k][2] = 0u;
#pragma unroll
                            for (int hc = 0; hc < 2; ++hc) {
                                m[k][0] = bf16x2_finite_abs_max(m[k][0], hb[k][hc]);
                                m[k][1] = bf16x2_finite_abs_max(m[k][1], gb[k][hc]);
                                m[k][2] = bf16x2_finite_abs_max(m[k][2], ub[k][hc]);
                            }
#pragma unroll
                            for (int i = 0; i < 3; ++i) m[k][i] = bf16x2_warp_max(m[k][i]);
                        }
                    }
#pragma unroll
                    for (int k = 0; k < RPI; ++k) {
                        const int row = r0 + rp + 8 * k;
                        part[k][0] = part[k][1] = 0.0f;
                        const long long col = cb + 2 * lane;
                        uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                        if (row >= rows) { /* warp-uniform */
                            if (zero_pad)
#pragma unroll
                                for (int hc = 0; hc < 2; ++hc)
                                    *(uint32_t *)(hp + 64 * hc) = *(uint32_t *)(gp + 64 * hc) =
                                        *(uint32_t *)(up + 64 * hc) = 0u;
                            continue;
                        }
                        const int eh = mok__fp8_scale_exp(bf16_bits_f32(m[k][0]));
                        const int eg = mok__fp8_scale_exp(bf16_bits_f32(m[k][1]));
                        const int eu = mok__fp8_scale_exp(bf16_bits_f32(m[k][2]));
                        uint8_t *q = gq_out + row * gq_ld + col; /* dg^'s code; du^'s inter further */
#pragma unroll
                        for (int hc = 0; hc < 2; ++hc) {
                            uint32_t hq, unused;
                            fp8_pair<FIX>(hb[k][hc], eh, &hq);
                            const uint32_t gcodes = fp8_pair<FIX>(gb[k][hc], eg, &unused);
                            const uint32_t ucodes = fp8_pair<FIX>(ub[k][hc], eu, &unused);
                            *(uint32_t *)(hp + 64 * hc) = hq;
                            *(uint32_t *)(gp + 64 * hc) = gb[k][hc];
                            *(uint32_t *)(up + 64 * hc) = ub[k][hc];
                            *(uint16_t *)(q + 64 * hc) = (uint16_t)gcodes;
                            *(uint16_t *)(q + inter + 64 * hc) = (uint16_t)ucodes;
                            part[k][hc] += d[k][hc].x * __uint_as_float(hq << 16);
                            part[k][hc] += d[k][hc].y * __uint_as_float(hq & 0xffff0000u);
                        }
                        if (lane == 0) {
                            float *scales = (float *)(gq_out + row * gq_ld + 2 * inter);
                            scales[cb / MOK_FP8_BLOCK] = mok__fp8_pow2(eg);
                            scales[(inter + cb) / MOK_FP8_BLOCK] = mok__fp8_pow2(eu);
                        }
                    }
                };
                if (top <= BF16_FINITE_MAX_BITS) quantize(e4m3_fix<false>{});
                else quantize(e4m3_fix<true>{});
                /* the warp's sums of part[k][hc] into lanes 8 (2 k + hc) ..: each row's two halves
                   in lanes 16 k and 16 k + 8, added in lane 16 k */
                const float lanes4[4] = {part[0][0], part[0][1], part[1][0], part[1][1]};
                const float s = warp_sums4(lanes4), s_hi = __shfl_xor_sync(0xffffffffu, s, 8);
                if (rdot && (lane & 15) == 0) {
                    const int row = r0 + rp + 8 * (lane >> 4);
                    /* from 0.0f, as a sum over the halves would start: -0 becomes +0 */
                    if (row < rows) rdot[row * rdot_ld + b] = (0.0f + s) + s_hi;
                }
            }
            consumer_sync(); /* the phase's tiles are read: the next phase may write them */
        }
    }
}

#endif
