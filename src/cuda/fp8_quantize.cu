/* fp8_quantize.cu — the cuda backend's quantization kernels (include/mok.h, FP8 section): a pass's
 * x^ = Q(x), per token per 128 of H, before its dispatch (mok__cuda_fp8_quantize_rows; the
 * backward's dy^ for the shared expert likewise), bf16(x^) from its codes
 * (mok__cuda_fp8_dequantize_rows), and
 * mok_quantize_weights on the device: each 128 x 128 block of every bf16 weight into its codes, in
 * both orientations, and its scale (mok__cuda_quantize_weights). Both deterministic: a block's
 * scale is a maximum, every code a function of its value and that scale. */
#include <string.h>

#include "core/fp8_weights.h"
#include "cuda/backend.cuh"
#include "cuda/fp8_rows.cuh"

#define QUANT_THREADS 256

/* One warp per FP8_ROWS_ILP (row, 128-column block)s of x [rows, cols] at a time: codes q (row r's
 * at q + r * q_ld bytes), scales s (row r's at s + r * s_ld floats). */
__global__ void quantize_rows_kernel(const uint16_t *x, long long rows, long long cols, uint8_t *q, long long q_ld,
                                     float *s, long long s_ld) {
    const long long blocks_per_row = cols / MOK_FP8_BLOCK, total = rows * blocks_per_row;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long b0 = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; b0 < total;
         b0 += FP8_ROWS_ILP * warps) {
        const uint16_t *src[FP8_ROWS_ILP];
        uint8_t *dst[FP8_ROWS_ILP];
        float *scale[FP8_ROWS_ILP];
        bool valid[FP8_ROWS_ILP];
#pragma unroll
        for (int i = 0; i < FP8_ROWS_ILP; ++i) {
            const long long b = b0 + i * warps, row = b / blocks_per_row, blk = b % blocks_per_row;
            valid[i] = b < total;
            src[i] = x + row * cols + blk * MOK_FP8_BLOCK;
            dst[i] = q + row * q_ld + blk * MOK_FP8_BLOCK;
            scale[i] = s + row * s_ld + blk;
        }
        fp8_quantize_blocks(src, dst, scale, valid);
    }
}

mok_status mok__cuda_fp8_quantize_rows(const uint16_t *x, long long rows, long long cols, uint8_t *q, long long q_ld,
                                       float *s, long long s_ld, int num_sms, cudaStream_t stream) {
    if (rows <= 0) return MOK_OK;
    const long long warps = rows * (cols / MOK_FP8_BLOCK), per_cta = QUANT_THREADS / 32;
    long long grid = (warps + per_cta - 1) / per_cta;
    if (grid > 8ll * num_sms) grid = 8ll * num_sms;
    LAUNCH_TRY(quantize_rows_kernel<<<(unsigned)grid, QUANT_THREADS, 0, stream>>>(x, rows, cols, q, q_ld, s, s_ld));
    return MOK_OK;
}

/* bf16(v^) [rows, cols] of codes q [rows, cols] and scales s [rows, cols / 128] (exact: mok.h),
 * eight values a thread. */
__global__ void dequantize_rows_kernel(const uint8_t *q, const float *s, long long rows, long long cols, uint16_t *out) {
    const long long total = rows * cols / 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long row = i * 8 / cols, col = i * 8 % cols;
        const uint2 codes = *(const uint2 *)(q + i * 8);
        *(int4 *)(out + i * 8) = bf16x8_from_e4m3x8(codes, s[row * (cols / MOK_FP8_BLOCK) + col / MOK_FP8_BLOCK]);
    }
}

mok_status mok__cuda_fp8_dequantize_rows(const uint8_t *q, const float *s, long long rows, long long cols, uint16_t *out,
                                         int num_sms, cudaStream_t stream) {
    if (rows <= 0) return MOK_OK;
    long long grid = (rows * cols / 8 + QUANT_THREADS - 1) / QUANT_THREADS;
    if (grid > 8ll * num_sms) grid = 8ll * num_sms;
    LAUNCH_TRY(dequantize_rows_kernel<<<(unsigned)grid, QUANT_THREADS, 0, stream>>>(q, s, rows, cols, out));
    return MOK_OK;
}

/* One CTA per 128 x 128 block (blockIdx.x: the block's index over count matrices [rows, cols]):
 * warp w holds the block's rows w, w + 8, ..., four values a lane, read once; their amax, then
 * their codes into q [rows, cols] and, through shared memory so that both stores are whole rows,
 * into q_t [cols, rows]; the scale into both scale arrays. */
__global__ void __launch_bounds__(QUANT_THREADS) quantize_weight_kernel(const uint16_t *w, long long rows, long long cols,
                                                                        uint8_t *q, uint8_t *q_t, float *scales,
                                                                        float *scales_t) {
    constexpr int WARPS = QUANT_THREADS / 32, ROWS = MOK_FP8_BLOCK / WARPS;
    __shared__ __align__(16) uint8_t tile[MOK_FP8_BLOCK][MOK_FP8_BLOCK + 4];
    __shared__ float warp_max[WARPS];
    const long long br = rows / MOK_FP8_BLOCK, bc = cols / MOK_FP8_BLOCK, per = br * bc;
    const long long m = blockIdx.x / per, block_row = blockIdx.x % per / bc, block_col = blockIdx.x % bc;
    const uint16_t *src = w + m * rows * cols + block_row * MOK_FP8_BLOCK * cols + block_col * MOK_FP8_BLOCK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v[ROWS][4];
    float amax = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        fp8_load4(src + (warp + WARPS * r) * cols, v[r]);
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = mok__fp8_amax(amax, v[r][i]);
    }
    for (int s = 16; s >= 1; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int i = 0; i < WARPS; ++i) amax = fmaxf(amax, warp_max[i]);
    const int e = mok__fp8_scale_exp(amax);
    uint8_t *dst = q + m * rows * cols + block_row * MOK_FP8_BLOCK * cols + block_col * MOK_FP8_BLOCK;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = warp + WARPS * r;
        const uint32_t codes = fp8_codes4(v[r], e);
        *(uint32_t *)(dst + row * cols + 4 * lane) = codes;
#pragma unroll
        for (int i = 0; i < 4; ++i) tile[4 * lane + i][row] = (uint8_t)(codes >> (8 * i));
    }
    __syncthreads();
    uint8_t *dst_t = q_t + m * rows * cols + block_col * MOK_FP8_BLOCK * rows + block_row * MOK_FP8_BLOCK;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = warp + WARPS * r;
        *(uint32_t *)(dst_t + row * rows + 4 * lane) = *(const uint32_t *)&tile[row][4 * lane];
    }
    if (threadIdx.x == 0) {
        scales[m * per + block_row * bc + block_col] = mok__fp8_pow2(e);
        scales_t[m * per + block_col * br + block_row] = mok__fp8_pow2(e);
    }
}

/* Every local rank's FP8 weights (mok_quantize_weights has checked the arguments): the buffer
 * cleared, each bf16 weight into its matrix and its transposed copy, then the header, on each
 * rank's stream (as the cpu backend writes them: the same bytes). */
extern "C" mok_status mok__cuda_quantize_weights(mok_workspace *ws, const mok_quantize_args *args) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    mok_fp8_layout layout;
    mok__fp8_layout(&ws->shape, ws->num_local_experts, &layout);
    mok_fp8_header header;
    memset(&header, 0, sizeof header);
    mok__fp8_header_make(&header, &ws->shape, ws->num_local_experts);
    int previous = 0;
    cudaGetDevice(&previous);
    for (int lr = 0; lr < cw->num_local; ++lr) {
        const mok_quantize_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cudaSetDevice(cw->ranks[lr].device));
        char *out = (char *)a->fp8_weights;
        /* the padding between arrays too: the whole buffer is defined, the cpu's bytes */
        CUDA_TRY(cudaMemsetAsync(out, 0, layout.bytes, stream));
        /* each source with the matrix it fills and that matrix's transposed copy */
        const struct {
            const void *w;
            int m, m_t;
        } jobs[] = {{a->w_gate, MOK_FP8_W_GATE, MOK_FP8_W_GATE_T}, {a->w_up, MOK_FP8_W_UP, MOK_FP8_W_UP_T},
                    {a->w_down, MOK_FP8_W_DOWN, MOK_FP8_W_DOWN_T}, {a->s_gate, MOK_FP8_S_GATE, MOK_FP8_S_GATE_T},
                    {a->s_up, MOK_FP8_S_UP, MOK_FP8_S_UP_T},       {a->s_down, MOK_FP8_S_DOWN, MOK_FP8_S_DOWN_T}};
        for (size_t j = 0; j < sizeof jobs / sizeof jobs[0]; ++j) {
            int64_t rows, cols, count;
            mok__fp8_matrix_shape(&ws->shape, ws->num_local_experts, jobs[j].m, &rows, &cols, &count);
            const long long blocks = count * (rows / MOK_FP8_BLOCK) * (cols / MOK_FP8_BLOCK);
            if (blocks == 0 || !jobs[j].w) continue;
            LAUNCH_TRY(quantize_weight_kernel<<<(unsigned)blocks, QUANT_THREADS, 0, stream>>>(
                (const uint16_t *)jobs[j].w, rows, cols, (uint8_t *)out + layout.codes[jobs[j].m],
                (uint8_t *)out + layout.codes[jobs[j].m_t], (float *)(out + layout.scales[jobs[j].m]),
                (float *)(out + layout.scales[jobs[j].m_t])));
        }
        /* the header last: a pass ordered after a quantization that failed finds no whole buffer */
        CUDA_TRY(cudaMemcpyAsync(out, &header, sizeof header, cudaMemcpyHostToDevice, stream));
    }
    cudaSetDevice(previous);
    return MOK_OK;
}
