/* The column widths of the GPU's compute tasks, picked per pass from the shape. Plain C, so the
 * tests count a pass's tasks by the same rule the kernels' host code uses.
 *
 * The tile is 128 rows by up to 256 columns (tile_operands.cuh); a task covers the widest of
 * 256, 128, 64 columns that divides its matrices' widths:
 *   gate|up  n_tile of I (and I_s) each of gate and up, so at most 128 (2 x 128 = 256);
 *   dh       n_tile of I (and I_s): the SwiGLU backward, 256 only where I >= 2048. Measured on
 *            2xH200 (docs/perf.md, 2026-11-30): DeepSeek-V3 (I = 2048) backward 32.4 ms at 256
 *            against 33.9 at 128; Qwen3-30B-A3B (I = 768) 13.9 at 256 against 11.5 at 128;
 *            its epilogue, 72 us of a 97 us task at 256, is what the wider task stretches;
 *   down, dx n_tile_h of H.
 * MOK_CUDA_COLS_DH and MOK_CUDA_COLS_H (experiments' switches, read at every pass) cap the
 * last two at 128 or 64 for A/B runs within one build. */
#ifndef MOK_CUDA_TASK_COLS_H
#define MOK_CUDA_TASK_COLS_H

#include <stdint.h>
#include <stdlib.h>

/* The widest of `widest`, its halves down to 64, that divides a and b (b = 0 divides). */
static inline int mok_cuda_cols(int64_t a, int64_t b, int widest) {
    int w = widest;
    while (w > 64 && (a % w != 0 || b % w != 0)) w /= 2;
    return w;
}

/* An experiment's cap from the environment: 256 (no cap) unless it names 128 or 64. */
static inline int mok_cuda_cols_cap(const char *var) {
    const char *v = getenv(var);
    int cap = v ? atoi(v) : 256;
    return cap == 128 || cap == 64 ? cap : 256;
}

static inline int mok_cuda_cols_gateup(int64_t I, int64_t Is) { return mok_cuda_cols(I, Is, 128); }
static inline int mok_cuda_cols_dh(int64_t I, int64_t Is) {
    const int cap = mok_cuda_cols_cap("MOK_CUDA_COLS_DH"), widest = I >= 2048 ? 256 : 128;
    return mok_cuda_cols(I, Is, cap < widest ? cap : widest);
}
static inline int mok_cuda_cols_h(int64_t H) { return mok_cuda_cols(H, 0, mok_cuda_cols_cap("MOK_CUDA_COLS_H")); }

#endif
