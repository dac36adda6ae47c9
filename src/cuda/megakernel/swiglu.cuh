/* swiglu.cuh — the SwiGLU tile epilogues: the forward's (a gate|up tile's g and u into the
 * context, h = bf16(silu(g) * u) into the ring) and the backward's (a dh tile's h, dg|du and the
 * router weight's partial dot product), with the rounding points of core/portable.h. */
#ifndef MOK_CUDA_MEGAKERNEL_SWIGLU_CUH
#define MOK_CUDA_MEGAKERNEL_SWIGLU_CUH

#include "cuda/fp8_rows.cuh"
#include "cuda/megakernel/row_stores.cuh"

/* A consumer thread's g and u of column blocks j and j + 1 (k = 0..3: block j + k / 2, row row0 +
 * 8 (k % 2)), rounded to bf16 pairs; rows from nreal on (padding) as zeros. The accumulators hold
 * g in blocks 0 .. NT / 8 - 1 and u in the next NT / 8. */
template <int NT>
static __device__ __forceinline__ void gu_pairs(const float (&acc)[TILE_ACC], int j, int row0, int nreal, uint32_t (&g)[4],
                                                uint32_t (&u)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int a = 4 * j + 2 * k, b = 4 * (j + NT / 8) + 2 * k;
        const bool real = row0 + 8 * (k & 1) < nreal;
        g[k] = real ? bf16x2_from_f32(acc[a], acc[a + 1]) : 0u;
        u[k] = real ? bf16x2_from_f32(acc[b], acc[b + 1]) : 0u;
    }
}

/* A gate|up tile's epilogue: a thread's columns 8j + 2(lane % 4) (+1) hold g for j < NT / 8 and
 * u, the same columns + NT, for the next NT / 8 (NT = n_tile: the accumulators are indexed by
 * constants only). g and u rounded to bf16 go into the context rows (padding rows as zeros; rows
 * from ctx_rows on are not kept), h = bf16(silu(g) * u) into h_out for real rows. They go out
 * through shared memory (stmatrix in, 16-byte chunks out: copy_staged): g into the staging tile c
 * and u into the one beside it (the backward's dh scratch, the same size and unused in the
 * forward), then h into c. The fragment's own pattern stored 16 bytes into each of 8 rows per
 * warp store. */
/* FP8 (NT = 128, one quantization block per row): h_out is h^'s codes (h_ld of them per row) and
 * h^ = Q(h) goes there, its scales to h_scales (hs_ld per row), instead of h. Q runs on the
 * registers: a row's 128 values of h are 32 in each of the four lanes that share lane / 4, so its
 * amax is theirs by two shuffles of the magnitudes' bit patterns (exact and order-free, as
 * fp8_rows.cuh's blocks); the codes go out through the staging tile as rows of FP8_CODES_LD bytes. */
#define FP8_CODES_LD 144 /* bytes: 128 codes, padded so that the 8 rows of a warp's store hit other banks */
template <int NT, bool FP8 = false>
static __device__ __forceinline__ void swiglu_staged(const float (&acc)[TILE_ACC], int nreal, long long ctx_row0,
                                                     long long ctx_rows, uint16_t *ctx, long long ctx_ld, long long inter,
                                                     long long n0, void *h_out, long long h_ld, float limit,
                                                     uint16_t *c, float *h_scales = nullptr, long long hs_ld = 0) {
    static_assert(!FP8 || NT == MOK_FP8_BLOCK, "an FP8 gate|up tile covers whole blocks of h");
    static_assert(DH_SCRATCH_BYTES >= TILE_BM * TILE_C_LD * 2, "a second staging tile fits the dh scratch");
    const int t = threadIdx.x - PRODUCER_THREADS, w16 = (t >> 5) * 16, row0 = w16 + ((t & 31) >> 2);
    uint16_t *c2 = c + TILE_BM * TILE_C_LD;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c), base2 = (uint32_t)__cvta_generic_to_shared(c2);
    uint32_t h[NT / 4]; /* pair 2 j + half: block j, row row0 + 8 half */
#pragma unroll
    for (int j = 0; j < NT / 8; j += 2) {
        uint32_t g[4], u[4];
        gu_pairs<NT>(acc, j, row0, nreal, g, u);
#pragma unroll
        for (int k = 0; k < 4; ++k) /* blocks j, j + 1; rows row0, row0 + 8 */
            h[2 * j + k] = bf16x2_from_f32(mok__swiglu(__uint_as_float(g[k] << 16), __uint_as_float(u[k] << 16), limit),
                                           mok__swiglu(__uint_as_float(g[k] & 0xffff0000u),
                                                       __uint_as_float(u[k] & 0xffff0000u), limit));
        stsm_pairs<STSM_PADDED>(base, w16, j, g[0], g[1], g[2], g[3]);
        stsm_pairs<STSM_PADDED>(base2, w16, j, u[0], u[1], u[2], u[3]);
    }
    /* FP8: each of the thread's two rows' scale exponent (h[p] is block p / 2 of row row0 + 8 (p % 2)),
       from the rows' magnitude maxima (fp8_rows.cuh); `fix` when a row of the warp's holds an Inf
       or a NaN (warp-uniform) */
    int e[2] = {0, 0};
    bool fix = false;
    if constexpr (FP8) {
        uint32_t m[2] = {0u, 0u};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int b = 0; b < NT / 8; ++b) m[half] = bf16x2_abs_max(m[half], h[2 * b + half]);
            m[half] = bf16x2_fold(m[half]);
        }
        fix = __any_sync(0xffffffffu, max(m[0], m[1]) > BF16_FINITE_MAX_BITS);
        if (fix)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                m[half] = 0u;
#pragma unroll
                for (int b = 0; b < NT / 8; ++b) m[half] = bf16x2_finite_abs_max(m[half], h[2 * b + half]);
                m[half] = bf16x2_fold(m[half]);
            }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            m[half] = max(m[half], __shfl_xor_sync(0xffffffffu, m[half], 1));
            m[half] = max(m[half], __shfl_xor_sync(0xffffffffu, m[half], 2));
            e[half] = mok__fp8_scale_exp(bf16_bits_f32(m[half]));
        }
    }
    const long long left = ctx ? ctx_rows - ctx_row0 : 0;
    const int keep = (int)(left < 0 ? 0 : left > TILE_BM ? TILE_BM : left); /* context rows of this tile */
    consumer_sync();
    if (keep > 0) {
        copy_staged(c, keep, NT, ctx + ctx_row0 * ctx_ld + n0, ctx_ld);
        copy_staged(c2, keep, NT, ctx + ctx_row0 * ctx_ld + inter + n0, ctx_ld);
    }
    consumer_sync();
    if constexpr (FP8) {
        static_assert(TILE_BM * FP8_CODES_LD <= TILE_BM * TILE_C_LD * 2, "the codes fit the staging tile");
        uint8_t *codes = (uint8_t *)c;
        const int col = 2 * (t & 3);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + 8 * half;
            const float inverse = mok__fp8_pow2(-e[half]);
            auto store = [&](auto fix_flag) {
#pragma unroll
                for (int b = 0; b < NT / 8; ++b) {
                    const uint32_t pair = h[2 * b + half];
                    *(uint16_t *)(codes + row * FP8_CODES_LD + 8 * b + col) =
                        (uint16_t)e4m3x2_codes<decltype(fix_flag)::value>(__uint_as_float(pair << 16) * inverse,
                                                                         __uint_as_float(pair & 0xffff0000u) * inverse);
                }
            };
            if (fix) store(e4m3_fix<true>{});
            else store(e4m3_fix<false>{});
            if ((t & 3) == 0 && row < nreal) h_scales[row * hs_ld + n0 / MOK_FP8_BLOCK] = mok__fp8_pow2(e[half]);
        }
        consumer_sync();
        uint8_t *out = (uint8_t *)h_out + n0;
        for (int idx = t; idx < TILE_BM * (MOK_FP8_BLOCK / 16); idx += CONSUMER_THREADS) {
            const int r = idx / (MOK_FP8_BLOCK / 16), c16 = (idx % (MOK_FP8_BLOCK / 16)) * 16;
            if (r < nreal) *(int4 *)(out + r * h_ld + c16) = *(const int4 *)(codes + r * FP8_CODES_LD + c16);
        }
    } else {
#pragma unroll
        for (int j = 0; j < NT / 8; j += 2)
            stsm_pairs<STSM_PADDED>(base, w16, j, h[2 * j], h[2 * j + 1], h[2 * j + 2], h[2 * j + 3]);
        consumer_sync();
        copy_staged(c, nreal, NT, (uint16_t *)h_out + n0, h_ld);
    }
    consumer_sync();
}

/* A bf16 gate|up tile's epilogue with h left to warps 1-3 (compute_walk.cuh, NOTE (handoff)): the
 * consumers round g and u to bf16 (padding rows as zeros) into the staging region as TMA store
 * boxes (g in boxes 0 .. NT / 64 - 1, u in the next NT / 64; row_stores.cuh's STSM_BOXES), thread 0
 * stores them into the context rows ctx_row0.. by TMA through ctx_map (the map's rows bound what
 * is kept; none when ctx_map is NULL) and fills the handoff slot: nreal rows of NT values of h to
 * h_out (h_ld apart). Warps 1-3 then compute h from the same bf16 g and u with the same
 * mok__swiglu (swiglu_handed), so h is bit for bit swiglu_staged's. The caller waited on the
 * last handoff and on the last TMA stores' reads (fwd_epilogue). */
template <int NT>
static __device__ __forceinline__ void swiglu_handoff(const float (&acc)[TILE_ACC], int nreal, int ctx_row0,
                                                      const CUtensorMap *ctx_map, int inter, int n0, uint16_t *h_out,
                                                      long long h_ld, uint16_t *c, const handoff_view &hv) {
    static_assert(2 * NT / 64 * STORE_BOX_BYTES <= SMEM_STAGING_BYTES + DH_SCRATCH_BYTES, "the boxes fit");
    const int t = threadIdx.x - PRODUCER_THREADS, w16 = (t >> 5) * 16, row0 = w16 + ((t & 31) >> 2);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
#pragma unroll
    for (int j = 0; j < NT / 8; j += 2) {
        uint32_t g[4], u[4];
        gu_pairs<NT>(acc, j, row0, nreal, g, u);
        stsm_pairs<STSM_BOXES>(base, w16, j, g[0], g[1], g[2], g[3]);
        stsm_pairs<STSM_BOXES>(base, w16, j + NT / 8, u[0], u[1], u[2], u[3]);
    }
    fence_proxy_async(); /* the generic-proxy writes, before the TMA unit reads them */
    consumer_sync();
    if (t == 0) {
        if (ctx_map) {
#pragma unroll
            for (int b = 0; b < NT / 64; ++b) {
                tma_store_2d(ctx_map, n0 + 64 * b, ctx_row0, base + b * STORE_BOX_BYTES);
                tma_store_2d(ctx_map, inter + n0 + 64 * b, ctx_row0, base + (NT / 64 + b) * STORE_BOX_BYTES);
            }
            bulk_commit();
        }
        handoff_fill(hv, h_out + n0, h_ld, nreal, NT);
    }
    mbar_arrive(hv.ready); /* releases this thread's box writes (thread 0: and the slot) to warps 1-3 */
}

/* Warp `part` of `parts`' share of swiglu_handoff's h, every lane: h = bf16(mok__swiglu(g, u)) of
 * the boxes' rows into ho's rows, a 16-byte chunk (8 values) per lane at a time, a row's chunks
 * on adjacent lanes, the warps' chunks interleaved. */
static __device__ __forceinline__ void swiglu_handed(const tile_handoff &ho, const uint16_t *c, float limit, int part,
                                                     int parts) {
    const uint8_t *boxes = (const uint8_t *)c;
    const int lane = threadIdx.x & 31, per_row = ho.cols / 8, u_box = ho.cols / 64;
#pragma unroll 4
    for (int idx = 32 * part + lane; idx < ho.rows * per_row; idx += 32 * parts) {
        const int r = idx / per_row, c8 = idx % per_row, box = c8 / 8;
        const int4 g = *(const int4 *)(boxes + box * STORE_BOX_BYTES + swizzle(r, c8 % 8));
        const int4 u = *(const int4 *)(boxes + (u_box + box) * STORE_BOX_BYTES + swizzle(r, c8 % 8));
        const uint32_t *gp = (const uint32_t *)&g, *up = (const uint32_t *)&u;
        int4 h;
        uint32_t *hp = (uint32_t *)&h;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            hp[k] = bf16x2_from_f32(mok__swiglu(__uint_as_float(gp[k] << 16), __uint_as_float(up[k] << 16), limit),
                                    mok__swiglu(__uint_as_float(gp[k] & 0xffff0000u),
                                                __uint_as_float(up[k] & 0xffff0000u), limit));
        *(int4 *)(ho.out + r * ho.ld + 8 * c8) = h;
    }
}

/* Four values' sums over the warp's lanes, v[i]'s in lanes 8 i .. 8 i + 7: the butterfly of xor
 * 16, 8, 4, 2, 1 transposed. At xor 16 a lane keeps two of the values and sends its partner the
 * other two, at xor 8 one, then each lane sums one value: 6 shuffles instead of 20. Every sum adds
 * the same two halves as the plain butterfly's (a + b is b + a), so the results have its bits. */
static __device__ __forceinline__ float warp_sums4(const float (&v)[4]) {
    const int lane = threadIdx.x & 31;
    const bool b4 = lane & 16, b3 = lane & 8;
    const float a0 = (b4 ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, b4 ? v[0] : v[2], 16);
    const float a1 = (b4 ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, b4 ? v[1] : v[3], 16);
    float s = (b3 ? a1 : a0) + __shfl_xor_sync(0xffffffffu, b3 ? a0 : a1, 8);
#pragma unroll
    for (int m = 4; m >= 1; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    return s;
}

/* The router dot's partials of a warp's four rows rp + 8 k, one per lane, summed over the warp's
 * lanes (warp_sums4: the order of xor 16 .. 1) and added to the rows' sums (rows < `rows`) by
 * lane 8 k. */
static __device__ __forceinline__ void add_row_partials(const float (&part)[4], int rp, int rows, float *rsum) {
    const float s = warp_sums4(part);
    const int lane = threadIdx.x & 31, row = rp + 8 * (lane >> 3);
    if ((lane & 7) == 0 && row < rows) rsum[row] += s;
}

/* The SwiGLU backward of a dh tile (fp32 dh0 = dy·W_down in acc, columns [n0, n0 + n_valid) of the
 * intermediate dim): h from g|u, the row's router-weight partial <dh0, h> over these columns (rdot,
 * may be NULL), dh = w · dh0 (w NULL: 1), dg|du. zero_pad: rows rows .. 127 of h and dg|du get
 * zeros (the routed tiles' padding rows, read by the weight gradients).
 *
 * 64 columns at a time: g|u come into the staging tile `c` with 16-byte loads (cols 0..63 g,
 * 64..127 u) while each thread writes its dh0 of the chunk into the dh scratch (compute_walk.cuh);
 * then each warp takes two rows at a time, two columns per lane, so its stores are 128 contiguous
 * bytes and the loop's code is small (a copy per 16-column slice of the accumulators would make
 * this epilogue thousands of instructions of straight-line code). The rows' router weights come into the
 * scratch once per tile, with the first chunk: read from global memory in the row loop, each
 * row would wait a global load's latency. The partial of a
 * row sums its lane's two columns in order, then the warp's lanes (xor 16, 8, 4, 2, 1), then the
 * chunks in order, in the scratch's per-row sums: a fixed order. */
static __device__ __forceinline__ void swiglu_backward_epilogue(const float (&acc)[TILE_ACC], int rows, int n_valid, const uint16_t *gu,
                                                long long gu_ld, long long inter, long long n0, const float *w,
                                                float limit, uint16_t *h_out, long long h_ld, uint16_t *dgu_out,
                                                long long dgu_ld, float *rdot, long long rdot_ld, uint16_t *c,
                                                bool zero_pad) {
    const int t = threadIdx.x - PRODUCER_THREADS, lane = t & 31, warp = t >> 5;
    const int row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
    float *dsm = (float *)(c + TILE_BM * TILE_C_LD), *rsum = dsm + TILE_BM * DH_SCRATCH_LD, *wsm = rsum + TILE_BM;
    if (t < TILE_BM) { /* both read after the first chunk's barrier */
        rsum[t] = 0.0f;
        wsm[t] = w && t < rows ? w[t] : 1.0f;
    }
#pragma unroll
    for (int hc = 0; hc < TILE_BN / 64; ++hc) {
        if (hc * 64 >= n_valid) break;
        /* cp.async: a thread's 8 loads of g|u are in flight together */
        for (int idx = t; idx < rows * 16; idx += CONSUMER_THREADS) {
            const int r = idx >> 4, c8 = (idx & 15) * 8;
            const uint16_t *src = gu + r * gu_ld + (c8 < 64 ? n0 + 64 * hc + c8 : inter + n0 + 64 * hc + c8 - 64);
            cp_async_16((uint32_t)__cvta_generic_to_shared(c + r * TILE_C_LD + c8), src, true);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int a = 4 * (8 * hc + j) + 2 * half;
                *(float2 *)(dsm + (row0 + 8 * half) * DH_SCRATCH_LD + 8 * j + col0) = make_float2(acc[a], acc[a + 1]);
            }
        cp_async_wait_all();
        consumer_sync();
        const long long col = n0 + 64 * hc + 2 * lane;
        /* not unrolled further: the loop stays one small body per chunk (a runtime loop over the
           chunks instead, with the accumulators copied out through a switch, doubled the kernel's
           spills). Rows warp + 32 m + 8 k, k = 0..3: four independent chains per iteration, each
           row's sums in the same order as with two */
        constexpr int RPI = 4; /* rows per iteration (add_row_partials sums four) */
#pragma unroll 1
        for (int rp = warp; rp < TILE_BM; rp += RPI * (CONSUMER_THREADS / 32)) {
            uint32_t gpair[RPI], upair[RPI];
            float2 d[RPI];
            float wr[RPI];
#pragma unroll
            for (int k = 0; k < RPI; ++k) { /* every shared-memory load of the rows first */
                const int row = rp + 8 * k;
                gpair[k] = *(const uint32_t *)(c + row * TILE_C_LD + 2 * lane);
                upair[k] = *(const uint32_t *)(c + row * TILE_C_LD + 64 + 2 * lane);
                d[k] = *(const float2 *)(dsm + row * DH_SCRATCH_LD + 2 * lane);
                wr[k] = wsm[row];
            }
            float part[RPI];
#pragma unroll
            for (int k = 0; k < RPI; ++k) {
                part[k] = 0.0f;
                const int row = rp + 8 * k;
                uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                if (row >= rows) {
                    if (zero_pad) *(uint32_t *)hp = *(uint32_t *)gp = *(uint32_t *)up = 0u;
                    continue;
                }
                float h[2], dg[2], du[2];
#pragma unroll
                for (int q = 0; q < 2; ++q) /* one sigmoid for h and the gradients */
                    mok__swiglu_with_backward(wr[k] * (q ? d[k].y : d[k].x),
                                              __uint_as_float(q ? gpair[k] & 0xffff0000u : gpair[k] << 16),
                                              __uint_as_float(q ? upair[k] & 0xffff0000u : upair[k] << 16), limit, &h[q],
                                              &dg[q], &du[q]);
                const uint32_t hb = bf16x2_from_f32(h[0], h[1]);
                part[k] += d[k].x * __uint_as_float(hb << 16);
                part[k] += d[k].y * __uint_as_float(hb & 0xffff0000u);
                *(uint32_t *)hp = hb;
                *(uint32_t *)gp = bf16x2_from_f32(dg[0], dg[1]);
                *(uint32_t *)up = bf16x2_from_f32(du[0], du[1]);
            }
            add_row_partials(part, rp, rows, rsum);
        }
        consumer_sync(); /* c, the scratch and rsum are read; the next chunk may write them */
    }
    if (rdot && t < rows) rdot[t * rdot_ld] = rsum[t];
}

#endif
