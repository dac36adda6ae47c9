/* fwd_epi_probe.cu — experiment: what the forward's tile epilogues cost on the consumers, alone.
 *
 * The question (docs/log.md): in the FP8 forward's traces the gate|up tiles spend 8.6-9.2 µs
 * after their main loop and the down tiles 5-6 µs, against 17-51 µs of main loop; handing h^ to
 * the producer warpgroup's warps slowed the FP8 main loops, and storing the context by TMA took
 * only ~1.3 µs off. Which part of an epilogue is the time: the SwiGLU and quantization, the
 * staging barriers, or the stores, and how much of it is the SM's own work rather than waiting on
 * the rest of the GPU?
 *
 * The probe runs the library's epilogues (its headers, included) alone: one CTA per SM (and one
 * CTA alone) with the compute CTA's layout (a producer warpgroup, idle here, and the two consumer
 * warpgroups), TASKS epilogues each on fresh accumulators, each timed with %globaltimer between
 * two barriers. DeepSeek-V3's widths: I = 2048 (gate|up tiles of 128 + 128 columns, the context
 * rows 2 I long), H = 7168 (down tiles of 256 columns). Modes:
 *   gateup_fp8        swiglu_staged<128, true>: g|u into the context, h^'s codes and scales;
 *   gateup_fp8_noctx  the same with no context kept (its two 32 KB copies left out);
 *   gateup_bf16       swiglu_staged<128>: g|u into the context, h as bf16 (the bf16 forward's form
 *                     with MOK_CUDA_HANDOFF=0);
 *   down_mapped       store_staged<true>: a down tile's 128 x 256 bf16 rows to the rows a row map
 *                     names (one rank's down tiles, straight into their (token, slot) rows);
 *   down_plain        store_staged: the same rows in order (the ring's rows, across ranks).
 * Checks, on CTA 0's last task of the every-SM run: the context of both gate|up forms against the
 * host's bf16 of the accumulators (bitwise), h against the host's SwiGLU of them (within a bf16
 * step: the device's sigmoid divides by rcp.approx), h^'s codes and scales against core/fp8.h's
 * quantization of the device's bf16 h (bitwise: the same h, the same rule), and both down forms
 * against the host's bf16 of the accumulators at their rows.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a dev/fwd_epi_probe.cu \
 *        -o build/fwd_epi_probe && ./build/fwd_epi_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/megakernel/swiglu.cuh" /* the library's tile epilogues and the compute CTA's layout */
#include "try.h"

#define ROWS TILE_BM
#define TASKS 48
#define INTER 2048  /* DeepSeek-V3's I */
#define HIDDEN 7168 /* and H */
#define NT 128      /* gate|up columns of each of g and u per tile */
#define DOWN_COLS 256
#define OUT_ROWS (2 * ROWS) /* a CTA's region of the down tiles' output rows */

enum { GATEUP_FP8, GATEUP_FP8_NOCTX, GATEUP_BF16, DOWN_MAPPED, DOWN_PLAIN, NUM_MODES };
static const char *mode_name[NUM_MODES] = {"gateup_fp8", "gateup_fp8_noctx", "gateup_bf16", "down_mapped", "down_plain"};

/* The accumulators of task `task`, thread t: multiples of 2^-9 in [-4, 4), 12 significant bits
 * (more than bf16 keeps), each exact in fp32, so that host and device agree on them whatever
 * either contracts into an fma. */
__host__ __device__ static inline float acc_value(int cta, int task, int t, int i) {
    uint32_t x = (uint32_t)(cta * 7919 + task * 104729 + t * 131 + i) * 2654435761u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    return (float)((int)(x >> 20) - 2048) * (1.0f / 512.0f);
}

/* A CTA's row map: its tile's row r goes to row rowmap[r] of its OUT_ROWS-row region, scattered
 * as (token, slot) rows are. */
__host__ __device__ static inline int32_t map_row(int cta, int r) { return cta * OUT_ROWS + (r * 37 % ROWS) * 2 + 1; }

struct buffers {
    uint16_t *ctx;    /* [sms][ROWS][2 I] */
    uint8_t *codes;   /* [sms][ROWS][I] */
    float *scales;    /* [sms][ROWS][I / 128] */
    uint16_t *h;      /* [sms][ROWS][I] */
    uint16_t *out;    /* [sms][OUT_ROWS][H] */
    int32_t *rowmap;  /* [sms][ROWS] */
    long long *times; /* [sms][TASKS] */
};

/* COMPUTE_THREADS threads, as a compute CTA: the producer warpgroup only keeps the barriers. */
template <int MODE>
__global__ void __launch_bounds__(COMPUTE_THREADS, 1) epi_kernel(buffers B) {
    extern __shared__ __align__(1024) unsigned char smem[];
    uint16_t *c = (uint16_t *)smem;
    const int b = blockIdx.x, t = threadIdx.x - PRODUCER_THREADS; /* t < 0: the producer warpgroup */
    uint16_t *ctx = B.ctx + (long long)b * ROWS * 2 * INTER, *h = B.h + (long long)b * ROWS * INTER;
    uint8_t *codes = B.codes + (long long)b * ROWS * INTER;
    float *scales = B.scales + (long long)b * ROWS * (INTER / MOK_FP8_BLOCK);
    uint16_t *out = B.out + (long long)b * OUT_ROWS * HIDDEN;
    for (int task = 0; task < TASKS; ++task) {
        float acc[TILE_ACC];
#pragma unroll
        for (int i = 0; i < TILE_ACC; ++i) acc[i] = t >= 0 ? acc_value(b, task, t, i) : 0.0f;
        __syncthreads();
        const long long t0 = globaltimer_ns();
        if (t >= 0) {
            const long long n0 = (long long)(task % (INTER / NT)) * NT, h0 = (long long)(task % (HIDDEN / DOWN_COLS)) * DOWN_COLS;
            if (MODE == GATEUP_FP8 || MODE == GATEUP_FP8_NOCTX)
                swiglu_staged<NT, true>(acc, ROWS, 0, MODE == GATEUP_FP8 ? ROWS : 0, MODE == GATEUP_FP8 ? ctx : nullptr,
                                        2 * INTER, INTER, n0, codes, INTER, 0.0f, c, scales, INTER / MOK_FP8_BLOCK);
            else if (MODE == GATEUP_BF16)
                swiglu_staged<NT>(acc, ROWS, 0, ROWS, ctx, 2 * INTER, INTER, n0, h, INTER, 0.0f, c);
            else if (MODE == DOWN_MAPPED)
                store_staged<true>(acc, ROWS, DOWN_COLS, B.out, HIDDEN, h0, c, B.rowmap + b * ROWS);
            else
                store_staged(acc, ROWS, DOWN_COLS, out, HIDDEN, h0, c);
        }
        __syncthreads();
        if (t == 0) B.times[(long long)b * TASKS + task] = globaltimer_ns() - t0;
    }
}

static float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The tile C[128][256] task `task` of CTA b holds (the accumulator fragment, as acc_position). */
static void tile_of(int b, int task, float (*C)[TILE_BN]) {
    for (int t = 0; t < CONSUMER_THREADS; ++t) {
        const int warp = t >> 5, lane = t & 31, row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
        for (int i = 0; i < TILE_ACC; ++i)
            C[row0 + ((i & 2) ? 8 : 0)][(i >> 2) * 8 + col0 + (i & 1)] = acc_value(b, task, t, i);
    }
}

static int passed = 0, failed = 0;
static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    ok ? ++passed : ++failed;
}

int main(void) {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t smem = SMEM_STAGING_BYTES + DH_SCRATCH_BYTES;
    const size_t n_ctx = (size_t)sms * ROWS * 2 * INTER, n_h = (size_t)sms * ROWS * INTER;
    const size_t n_sc = (size_t)sms * ROWS * (INTER / MOK_FP8_BLOCK), n_out = (size_t)sms * OUT_ROWS * HIDDEN;
    buffers B;
    TRY(cudaMalloc(&B.ctx, n_ctx * 2));
    TRY(cudaMalloc(&B.codes, n_h));
    TRY(cudaMalloc(&B.scales, n_sc * 4));
    TRY(cudaMalloc(&B.h, n_h * 2));
    TRY(cudaMalloc(&B.out, n_out * 2));
    TRY(cudaMalloc(&B.rowmap, (size_t)sms * ROWS * 4));
    TRY(cudaMalloc(&B.times, (size_t)sms * TASKS * 8));
    int32_t *map_h = (int32_t *)malloc((size_t)sms * ROWS * 4);
    for (int b = 0; b < sms; ++b)
        for (int r = 0; r < ROWS; ++r) map_h[b * ROWS + r] = map_row(b, r);
    TRY(cudaMemcpy(B.rowmap, map_h, (size_t)sms * ROWS * 4, cudaMemcpyHostToDevice));

    void (*kernels[NUM_MODES])(buffers) = {epi_kernel<GATEUP_FP8>, epi_kernel<GATEUP_FP8_NOCTX>, epi_kernel<GATEUP_BF16>,
                                           epi_kernel<DOWN_MAPPED>, epi_kernel<DOWN_PLAIN>};
    long long *times_h = (long long *)malloc((size_t)sms * TASKS * 8);
    const size_t ctx_tile = ROWS * 2 * INTER, h_tile = ROWS * INTER, sc_tile = ROWS * (INTER / MOK_FP8_BLOCK);
    uint16_t *ctx_fp8 = (uint16_t *)malloc(ctx_tile * 2), *ctx_bf16 = (uint16_t *)malloc(ctx_tile * 2);
    uint16_t *h_dev = (uint16_t *)malloc(h_tile * 2), *out_dev[2];
    uint8_t *codes_dev = (uint8_t *)malloc(h_tile);
    float *scales_dev = (float *)malloc(sc_tile * 4);
    printf("%-17s %10s %14s   (µs per tile: median of tasks 8.. over CTAs)\n", "epilogue", "1 CTA", "1 CTA per SM");
    for (int m = 0; m < NUM_MODES; ++m) {
        TRY(cudaFuncSetAttribute(kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        double med[2];
        for (int pass = 0; pass < 2; ++pass) {
            const int grid = pass == 0 ? 1 : sms;
            TRY(cudaMemset(B.out, 0xff, n_out * 2)); /* unwritten rows read as NaN */
            kernels[m]<<<grid, COMPUTE_THREADS, smem>>>(B);
            TRY(cudaGetLastError());
            TRY(cudaDeviceSynchronize());
            TRY(cudaMemcpy(times_h, B.times, (size_t)grid * TASKS * 8, cudaMemcpyDeviceToHost));
            int n = 0;
            static double v[1 << 16];
            for (int b = 0; b < grid; ++b)
                for (int task = 8; task < TASKS; ++task) v[n++] = times_h[(long long)b * TASKS + task] / 1e3;
            for (int i = 1; i < n; ++i) /* insertion sort: a few thousand values */
                for (int j = i; j > 0 && v[j - 1] > v[j]; --j) {
                    const double tmp = v[j];
                    v[j] = v[j - 1];
                    v[j - 1] = tmp;
                }
            med[pass] = v[n / 2];
        }
        printf("%-17s %10.2f %14.2f\n", mode_name[m], med[0], med[1]);
        /* the every-SM run's outputs of CTA 0 */
        if (m == GATEUP_FP8) {
            TRY(cudaMemcpy(ctx_fp8, B.ctx, ctx_tile * 2, cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(codes_dev, B.codes, h_tile, cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(scales_dev, B.scales, sc_tile * 4, cudaMemcpyDeviceToHost));
        } else if (m == GATEUP_BF16) {
            TRY(cudaMemcpy(ctx_bf16, B.ctx, ctx_tile * 2, cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(h_dev, B.h, h_tile * 2, cudaMemcpyDeviceToHost));
        } else if (m == DOWN_MAPPED || m == DOWN_PLAIN) {
            const int k = m == DOWN_PLAIN;
            out_dev[k] = (uint16_t *)malloc((size_t)OUT_ROWS * HIDDEN * 2);
            TRY(cudaMemcpy(out_dev[k], B.out, (size_t)OUT_ROWS * HIDDEN * 2, cudaMemcpyDeviceToHost));
        }
    }

    /* CTA 0's last task: its tile, and where its columns went */
    static float C[ROWS][TILE_BN];
    const int last = TASKS - 1, n0 = (last % (INTER / NT)) * NT, h0 = (last % (HIDDEN / DOWN_COLS)) * DOWN_COLS;
    tile_of(0, last, C);
    int bad_ctx = 0, bad_h = 0;
    for (int r = 0; r < ROWS; ++r)
        for (int cc = 0; cc < NT; ++cc) {
            const uint16_t g = mok__bf16_from_f32(C[r][cc]), u = mok__bf16_from_f32(C[r][NT + cc]);
            const long long gi = (long long)r * 2 * INTER + n0 + cc;
            bad_ctx += ctx_bf16[gi] != g || ctx_bf16[gi + INTER] != u;
            const float want = mok__swiglu(bf16_to_f32(g), bf16_to_f32(u), 0.0f);
            const float got = bf16_to_f32(h_dev[(long long)r * INTER + n0 + cc]);
            bad_h += fabsf(got - want) > fabsf(want) * (1.0f / 128.0f) + 1e-30f;
        }
    char what[200];
    snprintf(what, sizeof what, "gateup_bf16: context g|u against the host's bf16 (%d of %d differ)", bad_ctx, 2 * ROWS * NT);
    check(bad_ctx == 0, what);
    snprintf(what, sizeof what, "gateup_bf16: h against the host's SwiGLU (%d of %d off by more than a bf16 step)", bad_h,
             ROWS * NT);
    check(bad_h == 0, what);
    check(memcmp(ctx_fp8, ctx_bf16, ctx_tile * 2) == 0, "gateup_fp8: the context bitwise gateup_bf16's");
    int bad_codes = 0, bad_scales = 0;
    for (int r = 0; r < ROWS; ++r) { /* core/fp8.h's quantization of the device's h, block n0 / 128 of row r */
        float amax = 0.0f;
        for (int cc = 0; cc < NT; ++cc) amax = mok__fp8_amax(amax, bf16_to_f32(h_dev[(long long)r * INTER + n0 + cc]));
        const int e = mok__fp8_scale_exp(amax);
        bad_scales += scales_dev[(long long)r * (INTER / MOK_FP8_BLOCK) + n0 / MOK_FP8_BLOCK] != mok__fp8_pow2(e);
        for (int cc = 0; cc < NT; ++cc) {
            const long long i = (long long)r * INTER + n0 + cc;
            bad_codes += codes_dev[i] != mok__fp8_quantize(bf16_to_f32(h_dev[i]), mok__fp8_pow2(-e));
        }
    }
    snprintf(what, sizeof what, "gateup_fp8: h^ is core/fp8.h's quantization of the device's h (%d codes, %d scales differ)",
             bad_codes, bad_scales);
    check(bad_codes == 0 && bad_scales == 0, what);
    for (int k = 0; k < 2; ++k) {
        int bad = 0;
        for (int r = 0; r < ROWS; ++r) {
            const long long row = k ? r : map_row(0, r);
            for (int cc = 0; cc < DOWN_COLS; ++cc)
                bad += out_dev[k][row * HIDDEN + h0 + cc] != mok__bf16_from_f32(C[r][cc]);
        }
        snprintf(what, sizeof what, "%s: the tile's rows against the host's bf16 (%d of %d differ)",
                 mode_name[k ? DOWN_PLAIN : DOWN_MAPPED], bad, ROWS * DOWN_COLS);
        check(bad == 0, what);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
