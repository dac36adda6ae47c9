/* fp8_weights.h — one rank's FP8 weights in caller memory (mok_quantize_weights writes them, the
 * passes read them): the buffer's layout and header, and the quantization of one 128 x 128 block
 * of a bf16 weight matrix into both orientations. Portable C for host and device, no allocation.
 *
 * The one idea: a block's 128 x 128 values share one scale whichever way the matrix is read, so
 * the transposed copy the backward's K-major GEMMs need is the same codes and scales, moved. */
#ifndef MOK_CORE_FP8_WEIGHTS_H
#define MOK_CORE_FP8_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#include "fp8.h"
#include "mok.h"
#include "portable.h"

#define MOK_FP8_WEIGHTS_MAGIC 0x3157384b4f4d5746ll /* "FWMOK8W1" */
#define MOK_FP8_HEADER_BYTES 256

/* The buffer's first bytes: what it was written for, checked by the passes. */
typedef struct mok_fp8_header {
    int64_t magic;
    int64_t hidden, intermediate, shared_intermediate, num_local_experts;
} mok_fp8_header;

/* The [rows, cols] of matrix m (per expert for the routed ones) and how many of them there are. */
MOK_INLINE void mok__fp8_matrix_shape(const mok_shape *shape, int64_t num_local_experts, int m, int64_t *rows,
                                      int64_t *cols, int64_t *count) {
    const int shared = m >= MOK_FP8_S_GATE, base = shared ? m - MOK_FP8_S_GATE : m;
    const int64_t H = shape->hidden, I = shared ? shape->shared_intermediate : shape->intermediate;
    /* [out, in]: gate and up [I, H], down [H, I]; the transposed copies the other way round */
    const int i_rows = base == MOK_FP8_W_GATE || base == MOK_FP8_W_UP || base == MOK_FP8_W_DOWN_T;
    *rows = i_rows ? I : H;
    *cols = i_rows ? H : I;
    *count = shared ? (I > 0 ? 1 : 0) : num_local_experts;
}

MOK_INLINE size_t mok__fp8_align(size_t bytes) { return (bytes + 255u) & ~(size_t)255u; }

/* The layout of one rank's buffer: the header, then each matrix's codes and scales in enum order. */
MOK_INLINE void mok__fp8_layout(const mok_shape *shape, int64_t num_local_experts, mok_fp8_layout *layout) {
    size_t offset = MOK_FP8_HEADER_BYTES;
    for (int m = 0; m < MOK_FP8_NUM_MATRICES; ++m) {
        int64_t rows, cols, count;
        mok__fp8_matrix_shape(shape, num_local_experts, m, &rows, &cols, &count);
        layout->codes[m] = offset;
        offset = mok__fp8_align(offset + (size_t)(count * rows * cols));
        layout->scales[m] = offset;
        offset = mok__fp8_align(offset + (size_t)(count * (rows / MOK_FP8_BLOCK) * (cols / MOK_FP8_BLOCK)) * 4u);
    }
    layout->bytes = offset;
}

MOK_INLINE void mok__fp8_header_make(mok_fp8_header *header, const mok_shape *shape, int64_t num_local_experts) {
    header->magic = MOK_FP8_WEIGHTS_MAGIC;
    header->hidden = shape->hidden;
    header->intermediate = shape->intermediate;
    header->shared_intermediate = shape->shared_intermediate;
    header->num_local_experts = num_local_experts;
}

/* Whether a buffer's header says it was written for this shape (host memory). */
MOK_INLINE int mok__fp8_header_matches(const void *buffer, const mok_shape *shape, int64_t num_local_experts) {
    mok_fp8_header want, have;
    mok__fp8_header_make(&want, shape, num_local_experts);
    memcpy(&have, buffer, sizeof have);
    return memcmp(&want, &have, sizeof want) == 0;
}

/* Block (block_row, block_col) of the bf16 matrix w [rows, cols]: its scale into
 * scales[block_row][block_col] and scales_t[block_col][block_row], its codes into q [rows, cols]
 * and q_t [cols, rows] (the transposed copy). */
MOK_INLINE void mok__fp8_quantize_weight_block(const uint16_t *w, int64_t rows, int64_t cols, int64_t block_row,
                                               int64_t block_col, uint8_t *q, uint8_t *q_t, float *scales,
                                               float *scales_t) {
    const int64_t r0 = block_row * MOK_FP8_BLOCK, c0 = block_col * MOK_FP8_BLOCK;
    float amax = 0.0f;
    for (int64_t r = r0; r < r0 + MOK_FP8_BLOCK; ++r)
        for (int64_t c = c0; c < c0 + MOK_FP8_BLOCK; ++c) amax = mok__fp8_amax(amax, mok__bf16_to_f32(w[r * cols + c]));
    const int e = mok__fp8_scale_exp(amax);
    const float inverse = mok__fp8_pow2(-e);
    scales[block_row * (cols / MOK_FP8_BLOCK) + block_col] = mok__fp8_pow2(e);
    scales_t[block_col * (rows / MOK_FP8_BLOCK) + block_row] = mok__fp8_pow2(e);
    for (int64_t r = r0; r < r0 + MOK_FP8_BLOCK; ++r)
        for (int64_t c = c0; c < c0 + MOK_FP8_BLOCK; ++c) {
            const uint8_t code = mok__fp8_quantize(mok__bf16_to_f32(w[r * cols + c]), inverse);
            q[r * cols + c] = code;
            q_t[c * rows + r] = code;
        }
}

#endif
