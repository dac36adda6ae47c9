/* fp8_tile.cuh — the consumer side of a block-scaled FP8 GEMM on the stage ring of gemm_tile.cuh
 * (include/mok.h, FP8 section): C[128 x 256] = sum over the 128-wide K blocks kb, in kb order, of
 *   acc = fma(partial_kb, s_A[m, kb] · s_B[kb, n], acc),   partial_kb = sum over k in kb of q_A · q_B
 * with the partial sums on the tensor cores and the promotion in fp32 (s_A · s_B is a power of two:
 * the product is exact, and the fma rounds once, as acc + partial · s would).
 *
 * The producer is the bf16 one, plus the scales: an E4M3 row of 128 codes is 128 bytes, one row
 * of the 128B swizzle, so a stage holds A's 128 rows and B's 256 rows of one K block in the very layout
 * (and bytes: 48 KB) of a bf16 stage of 64 K, and the loaders move it as pairs of codes
 * (tile_operands.cuh). Consumer warpgroup c owns rows 64c .. 64c + 63. Per stage it runs the tile's
 * columns in chunks of 128 (one when n_valid <= 128): four m64n128k32 wgmmas into 64 partial sums
 * (the first with scale-d 0), a wait, and the promotion into the chunk's 64 of its 128
 * accumulators; the stage is released after its last chunk's wait. The two warpgroups run apart,
 * so one's promotion overlaps the other's wgmmas (dev/fp8_tile_probe.cu: this "free" arrangement
 * measured fastest for the 128 x 256 tile). A whole n256 partial would need 256 registers.
 *
 * The scales travel with the stage (gemm_tile.cuh: load_scales): the consumers read four floats
 * of shared memory per stage. Rows past a_rows promote with scale 0 (their outputs are
 * discarded). */
#ifndef MOK_CUDA_SM90_FP8_TILE_CUH
#define MOK_CUDA_SM90_FP8_TILE_CUH

#include "cuda/sm90/fp8_wgmma.cuh"
#include "cuda/sm90/gemm_tile.cuh"

/* The FP8 consumers hold 128 accumulators and 64 partial sums; with gemm_tile.cuh's 208 registers
 * the rest of their loop spilled accumulators around every promotion. So the FP8 kernels split the
 * CTA's 64,512 registers 128 * 56 + 256 * 224: the consumers' loop keeps its accumulators and
 * partial sums in registers (at 216 it spilled 19-21 values a stage), but still reloads the ring's
 * phase and two scale addresses each stage; the producer (addresses, counters, the schedule's
 * cursor) reloads for every task the loop invariants it hoisted. The FP8 backward executes about
 * six times the bf16 one's local-memory instructions (docs/log.md). */
#define FP8_PRODUCER_REGS 56
#define FP8_CONSUMER_REGS 224
static_assert(PRODUCER_THREADS * FP8_PRODUCER_REGS + CONSUMER_THREADS * FP8_CONSUMER_REGS <= 168 * COMPUTE_THREADS,
              "the roles share at most what the launch gives the CTA");

/* acc[64 c + i] = fma(part[i], row scale · the chunk's weight-block scale, acc[64 c + i]) for chunk c:
 * partial register 4i + {0, 1} is row row0, 4i + {2, 3} row row0 + 8. */
template <int C>
static __device__ __forceinline__ void fp8_promote(float (&acc)[TILE_ACC], const float (&part)[WGMMA_N128_ACC],
                                                   float sa_lo, float sa_hi, float sb) {
    const float lo = sa_lo * sb, hi = sa_hi * sb;
#pragma unroll
    for (int i = 0; i < WGMMA_N128_ACC / 4; ++i) {
        float *a = acc + C * WGMMA_N128_ACC + 4 * i;
        a[0] = __fmaf_rn(part[4 * i + 0], lo, a[0]);
        a[1] = __fmaf_rn(part[4 * i + 1], lo, a[1]);
        a[2] = __fmaf_rn(part[4 * i + 2], hi, a[2]);
        a[3] = __fmaf_rn(part[4 * i + 3], hi, a[3]);
    }
}

/* Issues the four wgmmas of one chunk of a stage into part and waits for them. */
static __device__ __forceinline__ void fp8_chunk(float (&part)[WGMMA_N128_ACC], uint32_t a_half, uint32_t b_chunk) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 2 * TILE_BK / WGMMA_E4M3_K; ++k)
        wgmma_e4m3_n128(part, smem_desc(a_half + k * WGMMA_E4M3_K, 16), smem_desc(b_chunk + k * WGMMA_E4M3_K, 16), k);
    wgmma_commit();
    wgmma_wait<0>();
    pin_partial(part);
}

/* FP8: B's block scales (tile_operands.sb) per 128-column chunk c of the tile: the weight rows
 * behind the chunk's first 64-row block, rows lo_row + 64 j of the weight whose scales are lo for
 * block j < b_split, else rows hi_row + 64 (j - b_split) of hi; a weight's scales are [rows / 128,
 * kblocks] (fp8_weights' layout). Every chunk lies in one weight block: lo_row and hi_row are
 * multiples of 128 (or the tile has 64 columns) and b_split is even. */
static __device__ __forceinline__ void fp8_b_scales(tile_operands *op, const float *lo, long long lo_row,
                                                    const float *hi, long long hi_row, long long kblocks) {
#pragma unroll
    for (int c = 0; c < TILE_BN / 128; ++c) {
        const int j = 2 * c;
        const bool first = j < op->b_split;
        const long long row = first ? lo_row + 64 * j : hi_row + 64 * (j - op->b_split);
        op->sb[c] = 128 * c < op->n_valid ? (first ? lo : hi) + row / MOK_FP8_BLOCK * kblocks : nullptr;
    }
}

/* B's block scales for a K split (tile_operands.sb2): as fp8_b_scales for the matrix
 * after the split, whose rows are those of the one before it. */
static __device__ __forceinline__ void fp8_b_scales_split(tile_operands *op, const float *hi, long long row,
                                                          long long kblocks) {
#pragma unroll
    for (int c = 0; c < TILE_BN / 128; ++c)
        op->sb2[c] = 128 * c < op->n_valid ? hi + (row + 128 * c) / MOK_FP8_BLOCK * kblocks : nullptr;
}

/* Consumer: acc += the block-scaled product over the GEMM's stages (acc holds the starting values,
 * written on every path before: gemm_tile.cuh's NOTE on consume_gemm). The scales come from the
 * stage's slot (gemm_tile.cuh: load_scales), read before the stage is released. */
static __device__ __forceinline__ void consume_gemm_fp8(stage_ring &r, const tile_operands &op, float (&acc)[TILE_ACC]) {
    const int kblocks = k_steps(op), consumer = (threadIdx.x >> 7) - 1, lane = threadIdx.x & 31;
    if (kblocks == 0) return;
    const int t = threadIdx.x - PRODUCER_THREADS, row0 = (t >> 5) * 16 + (lane >> 2);
    const bool two = op.sb[1] != nullptr;
    float part[WGMMA_N128_ACC];
    for (int kb = 0; kb < kblocks; ++kb) {
        mbar_wait(r.full + 8 * r.stage, r.phase, r.abort, r.error, r.timeout_ns);
        __syncwarp();
        if (!op.tma) fence_proxy_async(); /* TMA writes through the async proxy already */
        const uint32_t a = r.stages + r.stage * STAGE_BYTES, b = a + STAGE_A_BYTES;
        const uint32_t a_half = a + consumer * SWIZZLE_BLOCK_BYTES, sc = r.scales + r.stage * STAGE_SCALE_BYTES;
        const float s_lo = lds_f32(sc + 4 * row0), s_hi = lds_f32(sc + 4 * (row0 + 8));
        const float w0 = lds_f32(sc + 4 * TILE_BM), w1 = lds_f32(sc + 4 * (TILE_BM + 1));
        fp8_chunk(part, a_half, b);
        if (!two && lane == 0) mbar_arrive(r.empty + 8 * r.stage);
        fp8_promote<0>(acc, part, s_lo, s_hi, w0);
        if (two) {
            fp8_chunk(part, a_half, b + 2 * SWIZZLE_BLOCK_BYTES);
            if (lane == 0) mbar_arrive(r.empty + 8 * r.stage);
            fp8_promote<1>(acc, part, s_lo, s_hi, w1);
        }
        ring_advance(r);
    }
}

#endif
