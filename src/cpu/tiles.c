/* tiles.c — the cpu backend's GEMM tile: operands widened to fp32, then out-of-product
 * accumulation acc[r][n] += a[r][k] * bt[k][n] with k running 0..K-1 for every element. The
 * inner loop is over n (contiguous), so it vectorises without reassociating any sum. */
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
