/* mma_tile.cuh — the GEMM tile of the cuda backend: C[128 x 128] += A[128 x K] · B[K x 128]
 * in fp32 on tensor cores (mma.sync m16n8k16 bf16). Each operand is either K-contiguous (rows of
 * x, nn.Linear weights) or M/N-contiguous (a weight read transposed in the dgrad, the row-major
 * activations of the weight gradients, loaded with ldmatrix.trans): template flags A_MN, B_MN.
 * K runs in steps of 64; rows past k_valid read as zeros. A 4-stage cp.async pipeline feeds
 * 128-byte rows of shared memory swizzled by 16-byte chunk (chunk ^ row % 8), conflict-free.
 * 8 warps in a 2 x 4 grid; each warp owns 64 x 32 of C (4 x 4 mma tiles, 64 fp32 registers).
 * Rows of A past a_rows and B halves with no pointer are zero-filled, so a tile may be
 * partial. The reduction order over K is fixed by the code, so results are deterministic.
 *
 * This is the replaceable unit of DESIGN 2.5: a wgmma + TMA version keeps this interface. */
#ifndef MOK_CUDA_MMA_TILE_CUH
#define MOK_CUDA_MMA_TILE_CUH

#include <stdint.h>

#define TILE_BM 128
#define TILE_BN 128
#define TILE_BK 64
#define TILE_STAGES 4
#define TILE_STAGE_ELEMS ((TILE_BM + TILE_BN) * TILE_BK)
#define TILE_SMEM_BYTES (TILE_STAGES * TILE_STAGE_ELEMS * 2)
#define TILE_C_LD (TILE_BN + 8) /* staging row length of C in bf16 (padding breaks bank conflicts) */

typedef struct tile_operands {
    const uint16_t *a;     /* K-major: A(m, k) = a[m * lda + k], m < a_rows.
                              M-major: A(m, k) = a[k * lda + m], m < a_rows (64 or 128) */
    long long lda;
    int a_rows;
    const uint16_t *b_lo;  /* K-major: B rows n 0..63 (b_lo[n * ldb + k]) and 64..127 (b_hi, or
                              NULL for zeros). N-major: B(k, n) = b_lo[k * ldb + n] for k < k_split,
                              b_hi[(k - k_split) * ldb + n] after; n < n_valid (64 or 128) */
    const uint16_t *b_hi;
    long long ldb;
    int n_valid;
    long long k_split;
    long long k;           /* the K loop runs over ceil(k / 64) steps */
    long long k_valid;     /* rows k >= k_valid read as zero (M/N-major operands) */
} tile_operands;

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool valid) {
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

static __device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
    return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

/* An M/N-major operand tile: 64 k rows x 128 m (or n) columns, kept as two 64-column halves of
 * [64 k][64] (128-byte rows, swizzled). */
static __device__ __forceinline__ void load_mn_major(uint32_t base, const uint16_t *lo, const uint16_t *hi,
                                                     long long split, long long ld, int valid_cols, long long k0,
                                                     long long k_valid) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int idx = threadIdx.x + i * 256, krow = idx >> 4, c = idx & 15, half = c >> 3, chunk = c & 7;
        long long k = k0 + krow;
        bool valid = k < k_valid && half * 64 < valid_cols;
        const uint16_t *src = lo;
        if (valid) src = (k < split ? lo + k * ld : hi + (k - split) * ld) + half * 64 + chunk * 8;
        cp_async_16(base + half * 64 * 128 + swizzle(krow, chunk), src, valid);
    }
}

template <bool A_MN, bool B_MN>
static __device__ __forceinline__ void tile_load_stage(uint16_t *smem, const tile_operands &op, int stage, long long k0) {
    uint16_t *sa = smem + stage * TILE_STAGE_ELEMS;
    uint16_t *sb = sa + TILE_BM * TILE_BK;
    const uint32_t a_base = smem_addr(sa), b_base = smem_addr(sb);
    if (A_MN) {
        load_mn_major(a_base, op.a, op.a, 1ll << 62, op.lda, op.a_rows, k0, op.k_valid);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int idx = threadIdx.x + i * 256, row = idx >> 3, chunk = idx & 7;
            bool valid = row < op.a_rows;
            const uint16_t *src = op.a + (valid ? row * op.lda : 0) + k0 + chunk * 8;
            cp_async_16(a_base + swizzle(row, chunk), src, valid);
        }
    }
    if (B_MN) {
        load_mn_major(b_base, op.b_lo, op.b_hi, op.k_split, op.ldb, op.n_valid, k0, op.k_valid);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int idx = threadIdx.x + i * 256, row = idx >> 3, chunk = idx & 7;
            const uint16_t *half = row < 64 ? op.b_lo : op.b_hi;
            bool valid = half != nullptr;
            const uint16_t *src = valid ? half + (long long)(row & 63) * op.ldb + k0 + chunk * 8 : op.b_lo;
            cp_async_16(b_base + swizzle(row, chunk), src, valid);
        }
    }
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
static __device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                                         uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

static __device__ __forceinline__ void mma_bf16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* acc[mi][ni][4]: rows warp_m*64 + mi*16 + lane/4 (+8 for [2],[3]), cols warp_n*32 + ni*8 +
 * 2*(lane%4) (+1). Adds to acc (tile_mma zeroes it first). Ends with a __syncthreads: the
 * pipeline's shared memory is free again. */
template <bool A_MN, bool B_MN>
static __device__ __forceinline__ void tile_mma_acc(uint16_t *smem, const tile_operands &op, float (&acc)[4][4][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp_m = warp >> 2, warp_n = warp & 3;
    const int ktiles = (int)((op.k + TILE_BK - 1) / TILE_BK);
#pragma unroll
    for (int s = 0; s < TILE_STAGES - 1; ++s) {
        if (s < ktiles) tile_load_stage<A_MN, B_MN>(smem, op, s, (long long)s * TILE_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<TILE_STAGES - 2>();
        __syncthreads();
        int next = kt + TILE_STAGES - 1;
        if (next < ktiles) tile_load_stage<A_MN, B_MN>(smem, op, next % TILE_STAGES, (long long)next * TILE_BK);
        cp_async_commit();
        const uint16_t *sa = smem + (kt % TILE_STAGES) * TILE_STAGE_ELEMS;
        const uint32_t a_base = smem_addr(sa), b_base = smem_addr(sa + TILE_BM * TILE_BK);
#pragma unroll
        for (int kk = 0; kk < TILE_BK / 16; ++kk) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                if (A_MN) {
                    int m = warp_m * 64 + mi * 16, idx = lane >> 3;
                    int krow = kk * 16 + (idx >> 1) * 8 + (lane & 7), chunk = ((m & 63) + (idx & 1) * 8) >> 3;
                    ldmatrix_x4_trans(a_base + (m >> 6) * 64 * 128 + swizzle(krow, chunk), af[mi][0], af[mi][1],
                                      af[mi][2], af[mi][3]);
                } else {
                    int row = warp_m * 64 + mi * 16 + (lane & 15), chunk = kk * 2 + (lane >> 4);
                    ldmatrix_x4(a_base + swizzle(row, chunk), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
                }
            }
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                if (B_MN) {
                    int n = warp_n * 32 + nj * 16, idx = lane >> 3;
                    int krow = kk * 16 + (idx & 1) * 8 + (lane & 7), chunk = ((n & 63) + (idx >> 1) * 8) >> 3;
                    ldmatrix_x4_trans(b_base + (n >> 6) * 64 * 128 + swizzle(krow, chunk), bf[2 * nj][0],
                                      bf[2 * nj][1], bf[2 * nj + 1][0], bf[2 * nj + 1][1]);
                } else {
                    int row = warp_n * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3),
                        chunk = kk * 2 + ((lane >> 3) & 1);
                    ldmatrix_x4(b_base + swizzle(row, chunk), bf[2 * nj][0], bf[2 * nj][1], bf[2 * nj + 1][0],
                                bf[2 * nj + 1][1]);
                }
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
}

template <bool A_MN = false, bool B_MN = false>
static __device__ __forceinline__ void tile_mma(uint16_t *smem, const tile_operands &op, float (&acc)[4][4][4]) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;
    tile_mma_acc<A_MN, B_MN>(smem, op, acc);
}

/* The (row, col) of accumulator register r of acc[mi][ni] in this thread. */
static __device__ __forceinline__ void acc_position(int mi, int ni, int r, int *row, int *col) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    *row = (warp >> 2) * 64 + mi * 16 + (lane >> 2) + (r >= 2 ? 8 : 0);
    *col = (warp & 3) * 32 + ni * 8 + 2 * (lane & 3) + (r & 1);
}

/* Rounds the accumulators to bf16 into the staging tile c[128][TILE_C_LD] (shared memory). */
static __device__ __forceinline__ void tile_stage_bf16(uint16_t *c, const float (&acc)[4][4][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp_m = warp >> 2, warp_n = warp & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            int row = warp_m * 64 + mi * 16 + (lane >> 2), col = warp_n * 32 + ni * 8 + 2 * (lane & 3);
            uint32_t lo = (uint32_t)mok__bf16_from_f32(acc[mi][ni][0]) | ((uint32_t)mok__bf16_from_f32(acc[mi][ni][1]) << 16);
            uint32_t hi = (uint32_t)mok__bf16_from_f32(acc[mi][ni][2]) | ((uint32_t)mok__bf16_from_f32(acc[mi][ni][3]) << 16);
            *(uint32_t *)(c + row * TILE_C_LD + col) = lo;
            *(uint32_t *)(c + (row + 8) * TILE_C_LD + col) = hi;
        }
    __syncthreads();
}

#endif
