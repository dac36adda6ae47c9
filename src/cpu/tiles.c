/* tiles.c — the cpu backend's GEMM tile: operands widened to fp32, then out-of-product
 * accumulation acc[r][n] += a[r][k] * bt[k][n] with k running 0..K-1 for every element. The
 * inner loop is over n (contiguous), so it vectorises without reassociating any sum. The FP8 tile
 * does the same inside each 128-wide block of K on the E4M3 values, then adds the block's partial
 * sum, scaled, into the accumulator. */
#include "cpu.h"

void mok__cpu_rows_to_f32(float *dst, const uint16_t *src, int64_t ld, int rows, int64_t cols) {
    for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = mok__bf16_to_f32(src[r * ld + c]);
}

/* w is [N, K] row-major (an nn.Linear weight [out, in]); bt[k][n] = w[n0 + n][k]. */
void mok__cpu_bt_from_nk(float *bt, const uint16_t *w, int64_t ldw, int64_t n0, int nt, int64_t k) {
    for (int n = 0; n < nt; ++n) {
        const uint16_t *row = w + (n0 + n) * ldw;
        for (int64_t i = 0; i < k; ++i) bt[i * nt + n] = mok__bf16_to_f32(row[i]);
    }
}

/* w is [K, N] row-major; bt[k][n] = w[k][n0 + n]. */
void mok__cpu_bt_from_kn(float *bt, const uint16_t *w, int64_t ldw, int64_t n0, int nt, int64_t k) {
    for (int64_t i = 0; i < k; ++i)
        for (int n = 0; n < nt; ++n) bt[i * nt + n] = mok__bf16_to_f32(w[i * ldw + n0 + n]);
}

void mok__cpu_gemm(float *restrict acc, const float *restrict a, int rows, int64_t k, const float *restrict bt,
                   int nt) {
    for (int r = 0; r < rows; ++r) {
        float *restrict out = acc + (int64_t)r * nt;
        for (int n = 0; n < nt; ++n) out[n] = 0.0f;
        const float *restrict ar = a + (int64_t)r * k;
        for (int64_t i = 0; i < k; ++i) {
            const float v = ar[i];
            const float *restrict b = bt + i * nt;
            for (int n = 0; n < nt; ++n) out[n] += v * b[n];
        }
    }
}

/* ---- FP8 operands (include/mok.h, FP8 section) ---------------------------------------------- */

void mok__cpu_rows_quantize(float *a, float *a_scale, const uint16_t *src, int rows, int64_t cols) {
    const int64_t blocks = cols / MOK_FP8_BLOCK;
    for (int r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t *v = src + r * cols + b * MOK_FP8_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < MOK_FP8_BLOCK; ++i) amax = mok__fp8_amax(amax, mok__bf16_to_f32(v[i]));
            const int e = mok__fp8_scale_exp(amax);
            const float inverse = mok__fp8_pow2(-e);
            float *q = a + r * cols + b * MOK_FP8_BLOCK;
            for (int i = 0; i < MOK_FP8_BLOCK; ++i)
                q[i] = mok__e4m3_to_f32(mok__fp8_quantize(mok__bf16_to_f32(v[i]), inverse));
            a_scale[r * blocks + b] = mok__fp8_pow2(e);
        }
}

void mok__cpu_rows_from_e4m3(float *a, float *a_scale, const uint8_t *codes, const float *scales, int rows,
                             int64_t cols) {
    const int64_t blocks = cols / MOK_FP8_BLOCK;
    for (int r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) a[r * cols + c] = mok__e4m3_to_f32(codes[r * cols + c]);
        for (int64_t b = 0; b < blocks; ++b) a_scale[r * blocks + b] = scales[r * blocks + b];
    }
}

void mok__cpu_bt_from_e4m3(float *bt, float *b_scale, const uint8_t *w, const float *w_scale, int64_t n0, int nt,
                           int64_t k) {
    for (int n = 0; n < nt; ++n) {
        const uint8_t *row = w + (n0 + n) * k;
        for (int64_t i = 0; i < k; ++i) bt[i * nt + n] = mok__e4m3_to_f32(row[i]);
    }
    const int64_t blocks = k / MOK_FP8_BLOCK;
    for (int64_t b = 0; b < blocks; ++b) b_scale[b] = w_scale[n0 / MOK_FP8_BLOCK * blocks + b];
}

void mok__cpu_gemm_fp8(float *restrict acc, const float *restrict a, const float *restrict a_scale, int rows,
                       int64_t k, const float *restrict bt, const float *restrict b_scale, int nt) {
    const int64_t blocks = k / MOK_FP8_BLOCK;
    float partial[CPU_N_TILE];
    for (int r = 0; r < rows; ++r) {
        float *restrict out = acc + (int64_t)r * nt;
        for (int n = 0; n < nt; ++n) out[n] = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            for (int n = 0; n < nt; ++n) partial[n] = 0.0f;
            const float *restrict ar = a + (int64_t)r * k + b * MOK_FP8_BLOCK;
            for (int i = 0; i < MOK_FP8_BLOCK; ++i) {
                const float v = ar[i];
                const float *restrict bk = bt + (b * MOK_FP8_BLOCK + i) * nt;
                for (int n = 0; n < nt; ++n) partial[n] += v * bk[n];
            }
            /* a power of two: exact, so this is the same with or without a fused multiply-add */
            const float scale = a_scale[r * blocks + b] * b_scale[b];
            for (int n = 0; n < nt; ++n) out[n] += partial[n] * scale;
        }
    }
}
