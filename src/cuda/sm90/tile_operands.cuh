/* tile_operands.cuh — what a GEMM tile of the cuda backend is asked to compute: C[128 x 256]
 * (+)= A[128 x K] · B[K x 256] in fp32, each operand either K-contiguous (rows of x, nn.Linear
 * weights) or M/N-contiguous (a weight read transposed in the dgrad, the row-major activations
 * of the weight gradients). K runs in steps of 64; rows of A past a_rows, B halves with no
 * pointer and k rows past k_valid read as zeros, so a tile may be partial. Shared memory holds
 * 128-byte rows swizzled by 16-byte chunk (chunk ^ row % 8): the 128B pattern of wgmma.
 *
 * This is the replaceable unit of DESIGN 2.5; gemm_tile.cuh computes it on sm_90a. */
#ifndef MOK_CUDA_TILE_OPERANDS_CUH
#define MOK_CUDA_TILE_OPERANDS_CUH

#include <stdint.h>

#define TILE_BM 128
#define TILE_BN 256
#define TILE_BK 64
#define TILE_C_COLS 128                /* the staging tile holds 128 columns of a 128-row tile */
#define TILE_C_LD (TILE_C_COLS + 8)    /* its row length in bf16 (padding breaks bank conflicts) */

typedef struct tile_operands {
    const uint16_t *a;     /* K-major: A(m, k) = a[m * lda + k], m < a_rows.
                              M-major: A(m, k) = a[k * lda + m], m < a_rows (64 or 128) */
    long long lda;
    int a_rows;
    const uint16_t *b_lo;  /* K-major: B rows n < 64 b_split are b_lo[n * ldb + k], the rest
                              b_hi[(n - 64 b_split) * ldb + k] (NULL: zeros); rows n >= n_valid read
                              as zeros. N-major: B(k, n) = b_lo[k * ldb + n] for k < k_split,
                              b_hi[(k - k_split) * ldb + n] after; n < n_valid (a multiple of 64, at
                              most TILE_BN) */
    const uint16_t *b_hi;
    long long ldb;
    int n_valid;
    int b_split;           /* K-major B: 64-row blocks taken from b_lo (TMA: from b_map[0]) */
    long long k_split;
    long long k;           /* the K loop runs over ceil(k / 64) steps */
    long long k_valid;     /* rows k >= k_valid read as zero (M/N-major operands) */
    /* TMA instead (tma.cuh; every box is 64 x 64). A, K-major (a_mmajor 0): rows a_row .. + 127
       of map a_map (rows past a_rows hold whatever the matrix has there: their outputs must be
       discarded). A, M-major (a_mmajor 1): k rows from a_row, half h is columns a_col + 64 h.
       B, K-major (b_nmajor 0): block h < b_split is rows b_row[0] + 64 h .. + 63 of map
       b_map[0], block h >= b_split rows b_row[1] + 64 (h - b_split) of b_map[1]. B, N-major
       (b_nmajor 1): k rows from b_row[0] of b_map[0] while k < k_split, from b_row[1] of
       b_map[1] after; block h is columns b_col + 64 h. Blocks h >= a_halves (b_halves) are left
       as they were: their output rows (columns) must then be discarded. Along k a box reads
       whole 64-row slices: rows past k_valid must read as zeros in the matrix itself. */
    int tma, a_map, a_row, a_mmajor, a_halves, a_col, b_nmajor, b_halves, b_col;
    int b_map[2], b_row[2];
    /* FP8 GEMMs (fp8_tile.cuh): both operands K-major E4M3 codes, addressed as pairs of codes
       (uint16_t) so that the loaders above move them unchanged: a, b_lo, b_hi, lda, ldb and k count
       pairs, and one 64-step stage is 128 codes of K, one scale block. The block scales: A's row m
       < a_rows, K block kb at sa[m * sa_ld + kb]; B's rows 128 c .. 128 c + 127 (the tile's columns
       of chunk c) lie in one 128 x 128 weight block, whose scales along K are sb[c][kb] (NULL for a
       chunk past n_valid).
       A K split of K-major B (bk_split > 0, FP8 only: a dx tile's [W_gate_T | W_up_T]): k <
       bk_split as above, k >= bk_split from b_hi, every row, at k - bk_split (TMA: b_map[1] from
       b_row[1]), with the scales sb2[c][kb - bk_split / 64] for those K blocks. */
    const float *sa;
    long long sa_ld;
    const float *sb[TILE_BN / 128];
    long long bk_split;
    const float *sb2[TILE_BN / 128];
} tile_operands;

/* A 128-row x 64-column bf16 box in the 128B swizzle: the unit of the TMA stores. */
#define STORE_BOX_BYTES (TILE_BM * 128)

static __device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
    return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

#endif
