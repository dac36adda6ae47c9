/* mma_tile.cuh — the GEMM tile of the cuda backend: C[128 x 128] = A[128 x K] · B[128 x K]^T
 * in fp32 on tensor cores (mma.sync m16n8k16 bf16), both operands K-contiguous (x rows times
 * nn.Linear weights), K a multiple of 64. A 4-stage cp.async pipeline feeds 128-byte rows of
 * shared memory swizzled by 16-byte chunk (chunk ^ row % 8) so ldmatrix is conflict-free.
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
    const uint16_t *a;     /* [a_rows, K], row stride lda */
    long long lda;
    int a_rows;
    const uint16_t *b_lo;  /* rows 0..63 of B, row stride ldb */
    const uint16_t *b_hi;  /* rows 64..127 of B, or NULL (zeros) */
    long long ldb;
    long long k;
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

static __device__ __forceinline__ void tile_load_stage(uint16_t *smem, const tile_operands &op, int stage, long long k0) {
    uint16_t *sa = smem + stage * TILE_STAGE_ELEMS;
    uint16_t *sb = sa + TILE_BM * TILE_BK;
    const uint32_t a_base = smem_addr(sa), b_base = smem_addr(sb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int idx = threadIdx.x + i * 256, row = idx >> 3, chunk = idx & 7;
        bool valid = row < op.a_rows;
        const uint16_t *src = op.a + (valid ? row * op.lda : 0) + k0 + chunk * 8;
        cp_async_16(a_base + swizzle(row, chunk), src, valid);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int idx = threadIdx.x + i * 256, row = idx >> 3, chunk = idx & 7;
        const uint16_t *half = row < 64 ? op.b_lo : op.b_hi;
        bool valid = half != nullptr;
        const uint16_t *src = valid ? half + (long long)(row & 63) * op.ldb + k0 + chunk * 8 : op.b_lo;
        cp_async_16(b_base + swizzle(row, chunk), src, valid);
    }
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
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
 * 2*(lane%4) (+1). Ends with a __syncthreads: the pipeline's shared memory is free again. */
static __device__ __forceinline__ void tile_mma(uint16_t *smem, const tile_operands &op, float (&acc)[4][4][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp_m = warp >> 2, warp_n = warp & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;
    const int ktiles = (int)(op.k / TILE_BK);
#pragma unroll
    for (int s = 0; s < TILE_STAGES - 1; ++s) {
        if (s < ktiles) tile_load_stage(smem, op, s, (long long)s * TILE_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<TILE_STAGES - 2>();
        __syncthreads();
        int next = kt + TILE_STAGES - 1;
        if (next < ktiles) tile_load_stage(smem, op, next % TILE_STAGES, (long long)next * TILE_BK);
        cp_async_commit();
        const uint16_t *sa = smem + (kt % TILE_STAGES) * TILE_STAGE_ELEMS;
        const uint32_t a_base = smem_addr(sa), b_base = smem_addr(sa + TILE_BM * TILE_BK);
#pragma unroll
        for (int kk = 0; kk < TILE_BK / 16; ++kk) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                int row = warp_m * 64 + mi * 16 + (lane & 15), chunk = kk * 2 + (lane >> 4);
                ldmatrix_x4(a_base + swizzle(row, chunk), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                int row = warp_n * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3), chunk = kk * 2 + ((lane >> 3) & 1);
                ldmatrix_x4(b_base + swizzle(row, chunk), bf[2 * nj][0], bf[2 * nj][1], bf[2 * nj + 1][0],
                            bf[2 * nj + 1][1]);
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
