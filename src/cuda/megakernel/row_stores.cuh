/* row_stores.cuh — how a compute task's tile leaves the consumers: its accumulators rounded to
 * bf16 (or kept fp32) into shared memory by stmatrix or paired stores, then out to global memory
 * in 16-byte chunks, each warp's store covering whole chunks of one row (the accumulator
 * fragment's own pattern would store 4 or 8 bytes into each of 8 rows per warp store); or, for
 * bf16 rows, straight from the registers after a transpose within each quad of lanes, 16 bytes a
 * lane (store_direct, tuning.h's direct_rows). The tile epilogues (swiglu.cuh, forward.cu,
 * backward.cu, wgrad.cuh) store through here. */
#ifndef MOK_CUDA_MEGAKERNEL_ROW_STORES_CUH
#define MOK_CUDA_MEGAKERNEL_ROW_STORES_CUH

#include "cuda/megakernel/compute_walk.cuh"

/* The two shared-memory layouts bf16 tiles are written in: the staging tile c[128][TILE_C_LD]
 * (rows padded against bank conflicts), and 128-row x 64-column boxes of 128-byte rows swizzled
 * by 16-byte chunk (the TMA stores' layout, swizzle() of tile_operands.cuh), box after box. */
#define STSM_PADDED 0
#define STSM_BOXES 1

/* The shared address of 8-column block `block` of row `row` in a LAYOUT tile at `base`. */
template <int LAYOUT>
static __device__ __forceinline__ uint32_t stsm_row_addr(uint32_t base, int row, int block) {
    if (LAYOUT == STSM_PADDED) return base + row * (TILE_C_LD * 2) + block * 16;
    return base + (block / 8) * STORE_BOX_BYTES + swizzle(row, block % 8);
}

/* A warp's bf16 pairs of column blocks b and b + 1 of its 16 rows from row0, already packed:
 * v0, v1 block b's rows 0-7 and 8-15, v2, v3 block b + 1's (stmatrix's matrices 0-3). */
template <int LAYOUT>
static __device__ __forceinline__ void stsm_pairs(uint32_t base, int row0, int b, uint32_t v0, uint32_t v1, uint32_t v2,
                                                  uint32_t v3) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    stsm_x4(stsm_row_addr<LAYOUT>(base, row0 + 8 * (m & 1) + (lane & 7), b + (m >> 1)), v0, v1, v2, v3);
}

/* A warp's bf16 of the accumulators' column blocks j and j + 1 (8 columns each: accumulators
 * 4 j .. 4 j + 7), its 16 rows from row0, by one stmatrix: matrix m is block j + m / 2, rows
 * 8 (m % 2) .. + 7. In the tile, block j lands at block j - block0. */
template <int LAYOUT>
static __device__ __forceinline__ void stsm_blocks(const float (&acc)[TILE_ACC], int j, uint32_t base, int row0,
                                                   int block0) {
    stsm_pairs<LAYOUT>(base, row0, j - block0, bf16x2_from_f32(acc[4 * j], acc[4 * j + 1]),
                       bf16x2_from_f32(acc[4 * j + 2], acc[4 * j + 3]), bf16x2_from_f32(acc[4 * j + 4], acc[4 * j + 5]),
                       bf16x2_from_f32(acc[4 * j + 6], acc[4 * j + 7]));
}

/* A consumer thread's 16-byte chunks of the staging tile: chunk i is row chunk_row(i), columns
 * chunk_col(i) .. + 7, so that each warp's store covers whole chunks of one row. */
#define STAGED_CHUNKS (TILE_BM * (TILE_C_COLS / 8) / CONSUMER_THREADS)
static_assert(TILE_BM * (TILE_C_COLS / 8) % CONSUMER_THREADS == 0, "the consumers share the tile's chunks evenly");
static __device__ __forceinline__ int chunk_row(int i) {
    return ((threadIdx.x - PRODUCER_THREADS) + i * CONSUMER_THREADS) / (TILE_C_COLS / 8);
}
static __device__ __forceinline__ int chunk_col(int i) {
    return ((threadIdx.x - PRODUCER_THREADS) + i * CONSUMER_THREADS) % (TILE_C_COLS / 8) * 8;
}

/* The output rows of a thread's chunks under a row map (row r goes to rowmap[r]), read once per
 * tile with every load in flight together: a map entry read beside its chunk's store is a load
 * the compiler may not move above the stores before it (they might alias the map), so each chunk
 * would wait a global load's latency. Rows >= rows get 0 (their chunks are not stored). */
static __device__ __forceinline__ void load_row_map(const int32_t *rowmap, int rows, long long (&orow)[STAGED_CHUNKS]) {
#pragma unroll
    for (int i = 0; i < STAGED_CHUNKS; ++i) orow[i] = chunk_row(i) < rows ? (long long)rowmap[chunk_row(i)] : 0;
}

/* Rows < rows, columns < cols (a multiple of 8) of the staging tile c[128][TILE_C_LD] to out
 * (row stride ld; out and ld 16-byte aligned), in 16-byte chunks: each warp's store covers whole
 * chunks of one row. With a row map (load_row_map's orow), row r goes to row rowmap[r] of out
 * instead of row r. */
template <bool MAPPED = false>
static __device__ __forceinline__ void copy_staged(const uint16_t *c, int rows, int cols, uint16_t *out, long long ld,
                                                   const long long *orow = nullptr) {
    int4 v[STAGED_CHUNKS]; /* every load before the first store, which they might alias */
#pragma unroll
    for (int i = 0; i < STAGED_CHUNKS; ++i) v[i] = *(const int4 *)(c + chunk_row(i) * TILE_C_LD + chunk_col(i));
#pragma unroll
    for (int i = 0; i < STAGED_CHUNKS; ++i) {
        const int r = chunk_row(i), c8 = chunk_col(i);
        if (r < rows && c8 < cols) *(int4 *)(out + (MAPPED ? orow[i] : r) * ld + c8) = v[i];
    }
}

/* Rounds the accumulators of columns 0 .. TILE_C_COLS - 1 to bf16 into the staging tile
 * c[128][TILE_C_LD], then syncs the consumers. */
static __device__ __forceinline__ void stage_bf16(uint16_t *c, const float (&acc)[TILE_ACC]) {
    const int t = threadIdx.x - PRODUCER_THREADS;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
#pragma unroll
    for (int j = 0; j < TILE_C_COLS / 8; j += 2) stsm_blocks<STSM_PADDED>(acc, j, base, (t >> 5) * 16, 0);
    consumer_sync();
}

/* A tile's bf16 through the staging tile c[128][TILE_C_LD], TILE_C_COLS columns at a time:
 * rows < rows, columns < cols (a multiple of 8) of out + n0, row stride ld (out + n0 and ld
 * 16-byte aligned). Each warp's global store then covers whole 16-byte chunks of one row
 * rather than 4 bytes of 8 rows. The consumers sync before each round's copy and after it, so
 * c is free again on return. */
template <bool MAPPED = false>
static __device__ __forceinline__ void store_staged(const float (&acc)[TILE_ACC], int rows, int cols, uint16_t *out,
                                                    long long ld, long long n0, uint16_t *c,
                                                    const int32_t *rowmap = nullptr) {
    const int t = threadIdx.x - PRODUCER_THREADS;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
    long long orow[STAGED_CHUNKS];
    if constexpr (MAPPED) load_row_map(rowmap, rows, orow); /* the same rows for every round */
#pragma unroll
    for (int h = 0; h < TILE_ACC / 4 / (TILE_C_COLS / 8); ++h) {
        if (h * TILE_C_COLS >= cols) break;
#pragma unroll
        for (int j = 0; j < TILE_C_COLS / 8; j += 2)
            stsm_blocks<STSM_PADDED>(acc, j + h * (TILE_C_COLS / 8), base, (t >> 5) * 16, h * (TILE_C_COLS / 8));
        consumer_sync();
        copy_staged<MAPPED>(c, rows, cols - h * TILE_C_COLS, out + n0 + h * TILE_C_COLS, ld, orow);
        consumer_sync();
    }
}

/* One exchange with lane q ^ mask: a lane with `upper` set trades its v[a0], v[a1], the others
 * their v[b0], v[b1], each receiving into the slots it sent from. */
static __device__ __forceinline__ void quad_swap(uint32_t (&v)[4], int mask, bool upper, int a0, int a1, int b0,
                                                 int b1) {
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, upper ? v[a0] : v[b0], mask);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, upper ? v[a1] : v[b1], mask);
    if (upper) { /* constant slots once inlined: registers, no indexed (local) memory */
        v[a0] = r0;
        v[a1] = r1;
    } else {
        v[b0] = r0;
        v[b1] = r1;
    }
}

/* A 4 x 4 transpose of 32-bit values across the four lanes of a quad (lanes 4k .. 4k + 3), q the
 * lane's index in it: lane q's v[j] becomes lane j's v[q]. Two exchanges: the off-diagonal 2 x 2
 * blocks (lanes q, q ^ 2), then the off-diagonal values inside each block (lanes q, q ^ 1).
 * Every lane of the warp takes part. */
static __device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int q) {
    quad_swap(v, 2, q & 2, 0, 1, 2, 3);
    quad_swap(v, 1, q & 1, 0, 2, 1, 3);
}

/* A tile's bf16 rows straight from the accumulators, no shared memory: rows < rows, columns <
 * cols (a multiple of 8) of out + n0, row stride ld (out + n0 and ld 16-byte aligned); with a row
 * map, row r goes to row rowmap[r] of out. In the m64n256 fragment a quad's four lanes hold two
 * columns each of every 8-column block of two rows (acc_position); the quad_transpose of four
 * blocks gives each lane the whole 8 columns of one block, so each lane stores 16 bytes and each
 * warp store covers 64 contiguous bytes of each of 8 rows (as many 32-byte sectors per store as
 * copy_staged's). The same bf16 as the staged stores (bf16x2_from_f32 of the same pairs, in the
 * same places); no barrier, and the staging region is not touched, so a caller need not wait for
 * whatever still reads it. */
template <bool MAPPED = false>
static __device__ __forceinline__ void store_direct(const float (&acc)[TILE_ACC], int rows, int cols, uint16_t *out,
                                                    long long ld, long long n0, const int32_t *rowmap = nullptr) {
    const int t = threadIdx.x - PRODUCER_THREADS, lane = t & 31, q = lane & 3;
    const int row0 = (t >> 5) * 16 + (lane >> 2);
    long long orow[2]; /* both map entries read before the first store, which might alias the map */
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + 8 * h;
        orow[h] = MAPPED ? (r < rows ? (long long)rowmap[r] : 0) : r;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) { /* accumulators 4 b + 2 h, 4 b + 2 h + 1: block b's row row0 + 8 h */
        uint16_t *dst = out + orow[h] * ld + n0;
        const bool on = row0 + 8 * h < rows;
#pragma unroll
        for (int g = 0; g < TILE_ACC / 16; ++g) { /* blocks 4 g .. 4 g + 3 */
            uint32_t v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = bf16x2_from_f32(acc[4 * (4 * g + j) + 2 * h], acc[4 * (4 * g + j) + 2 * h + 1]);
            quad_transpose(v, q);
            const int col = (4 * g + q) * 8;
            if (on && col < cols) *(int4 *)(dst + col) = make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
        }
    }
}

/* A down (forward) or dx (backward) tile's bf16 rows: its p.n_tile_h columns from column
 * nt · p.n_tile_h of rows p.hidden wide, rows < rows (row r at row rowmap[r] of out with a map);
 * straight from the accumulators (p.direct_rows: no barrier, the staging region untouched) or
 * through the staging tile (store_staged syncs the consumers). */
template <bool MAPPED = false>
static __device__ __forceinline__ void hidden_rows(const pass_params &p, long long nt, const float (&acc)[TILE_ACC],
                                                   int rows, uint16_t *out, uint16_t *staging,
                                                   const int32_t *rowmap = nullptr) {
    const long long H = p.hidden, n0 = nt * p.n_tile_h;
    if (p.direct_rows) store_direct<MAPPED>(acc, rows, p.n_tile_h, out, H, n0, rowmap);
    else store_staged<MAPPED>(acc, rows, p.n_tile_h, out, H, n0, staging, rowmap);
}

/* An fp32 tile (a weight gradient's carry, or accumulate mode's destination) out through the
 * staging region (the staging tile and the dh scratch after it, 70 KB), 128 columns at a time:
 * each thread's column pairs into a [128][F32_STAGING_LD] fp32 tile, then one warp per row in 16-byte
 * chunks. From registers, the fragment's pattern wrote 32 bytes into each of 8 rows per warp store
 * (slow with every SM storing at once). Row
 * stride 136 floats: the 8-byte writes of a half-warp (rows r..r+3, 8 columns each) fall on
 * distinct banks. rows, cols: the valid part (cols a multiple of 64); out 16-byte aligned, ld a
 * multiple of 4. */
#define F32_STAGING_LD 136
static_assert(TILE_BM * F32_STAGING_LD * 4 <= SMEM_STAGING_BYTES + DH_SCRATCH_BYTES, "128 fp32 columns fit the staging region");
static __device__ __forceinline__ void store_staged_f32(const float (&acc)[TILE_ACC], int rows, int cols, float *out,
                                                        long long ld, float *c) {
    const int t = threadIdx.x - PRODUCER_THREADS;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (h * 128 >= cols) break;
#pragma unroll
        for (int r = 64 * h; r < 64 * h + 64; r += 2) { /* registers 64h.. hold columns 128h..128h+127 */
            int row, col;
            acc_position(r, &row, &col);
            *(float2 *)(c + row * F32_STAGING_LD + col - 128 * h) = make_float2(acc[r], acc[r + 1]);
        }
        consumer_sync();
        const int n = cols - 128 * h < 128 ? cols - 128 * h : 128;
        for (int idx = t; idx < TILE_BM * 32; idx += CONSUMER_THREADS) {
            const int row = idx >> 5, c4 = (idx & 31) * 4;
            if (row < rows && c4 < n)
                *(float4 *)(out + row * ld + 128 * h + c4) = *(const float4 *)(c + row * F32_STAGING_LD + c4);
        }
        consumer_sync();
    }
}

#endif
