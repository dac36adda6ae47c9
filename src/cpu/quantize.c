/* quantize.c — mok_quantize_weights on the cpu backend: every 128 x 128 block of every weight
 * matrix of every local rank, through the portable block quantizer (core/fp8_weights.h), into
 * the caller's buffer. Each block is a pure function of its bf16 values, so the result is the
 * same on every call, whatever the order the blocks are visited in. */
#include "core/fp8_weights.h"
#include "cpu.h"

/* count matrices of [rows, cols] from src, quantized into matrix m and its transposed copy mt. */
static void quantize_matrices(char *buffer, const mok_fp8_layout *layout, int m, int mt, const uint16_t *src,
                              int64_t count, int64_t rows, int64_t cols) {
    const int64_t block_rows = rows / MOK_FP8_BLOCK, block_cols = cols / MOK_FP8_BLOCK;
    for (int64_t e = 0; e < count; ++e) {
        uint8_t *q = (uint8_t *)(buffer + layout->codes[m]) + e * rows * cols;
        uint8_t *q_t = (uint8_t *)(buffer + layout->codes[mt]) + e * rows * cols;
        float *scales = (float *)(buffer + layout->scales[m]) + e * block_rows * block_cols;
        float *scales_t = (float *)(buffer + layout->scales[mt]) + e * block_rows * block_cols;
        for (int64_t br = 0; br < block_rows; ++br)
            for (int64_t bc = 0; bc < block_cols; ++bc)
                mok__fp8_quantize_weight_block(src + e * rows * cols, rows, cols, br, bc, q, q_t, scales, scales_t);
    }
}

mok_status mok__cpu_quantize_weights(mok_workspace *ws, const mok_quantize_args *args) {
    const mok_shape *s = &ws->shape;
    const int64_t H = s->hidden, I = s->intermediate, Is = s->shared_intermediate, El = ws->num_local_experts;
    mok_fp8_layout layout;
    mok__fp8_layout(s, El, &layout);
    for (int r = 0; r < ws->group->num_local_ranks; ++r) {
        const mok_quantize_args *a = &args[r];
        char *buffer = a->fp8_weights;
        memset(buffer, 0, layout.bytes); /* the padding between arrays too: the whole buffer is defined */
        quantize_matrices(buffer, &layout, MOK_FP8_W_GATE, MOK_FP8_W_GATE_T, a->w_gate, El, I, H);
        quantize_matrices(buffer, &layout, MOK_FP8_W_UP, MOK_FP8_W_UP_T, a->w_up, El, I, H);
        quantize_matrices(buffer, &layout, MOK_FP8_W_DOWN, MOK_FP8_W_DOWN_T, a->w_down, El, H, I);
        if (Is > 0) {
            quantize_matrices(buffer, &layout, MOK_FP8_S_GATE, MOK_FP8_S_GATE_T, a->s_gate, 1, Is, H);
            quantize_matrices(buffer, &layout, MOK_FP8_S_UP, MOK_FP8_S_UP_T, a->s_up, 1, Is, H);
            quantize_matrices(buffer, &layout, MOK_FP8_S_DOWN, MOK_FP8_S_DOWN_T, a->s_down, 1, H, Is);
        }
        /* the header last: a buffer whose quantization did not finish is never taken for a whole one */
        mok_fp8_header header;
        mok__fp8_header_make(&header, s, El);
        memcpy(buffer, &header, sizeof header);
    }
    return MOK_OK;
}
