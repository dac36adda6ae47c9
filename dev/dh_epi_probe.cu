/* dh_epi_probe.cu — experiment: where the SwiGLU-backward epilogue of a dh task spends its time.
 *
 * The question (docs/perf.md, 2026-11-30 sixth session): the dh epilogue (backward.cu,
 * swiglu_backward_epilogue) takes ~33 µs of a 115 µs DeepSeek-V3 dh task (128 x 256 tile) and
 * ~16–19 µs of a 38–42 µs Qwen3 one, for 128 KB of g|u read and 192 KB of h, dg|du written: ~10
 * GB/s per SM, where the store probe measured 31.7 GB/s per SM for the same store pattern with
 * every SM storing. Two rewrites that staged the stores through shared memory made it slower.
 * Is it the per-chunk g|u round trips, the row loop's dependent chain (shared loads, the
 * sigmoid, a five-level shuffle tree per row pair, two warps per scheduler), or the stores?
 *
 * The probe runs the epilogue alone: one CTA per SM (and one CTA alone), 256 threads as the
 * kernel's two consumer warpgroups, TASKS epilogues each on fresh accumulators, each timed with
 * %globaltimer between two barriers. The epilogue here is a copy of the library's loop (same
 * layouts: 64-column chunks through a 128 x 136 bf16 staging tile and a 128 x 68 fp32 scratch),
 * in variants that each take one part away:
 *   lib        the library's loop;
 *   nostore    h, dg and du are not stored (their values feed a checksum instead);
 *   noload     g|u are not loaded per chunk (the staging tile keeps what it was given once);
 *   noshfl     no shuffle tree (each lane keeps its own partial);
 *   rows4      four rows per iteration instead of two: the same per-row math and the same tree
 *              (the same bits as lib), twice the independent chains.
 * lib and rows4 are checked against a host replay of the arithmetic (h, dg, du within one bf16
 * step; the router-weight partials, over the device's h, within 1e-6 of their scale) and against
 * each other (bitwise).
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a dev/dh_epi_probe.cu \
 *        -o build/dh_epi_probe && ./build/dh_epi_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/portable.h"
#include "try.h"

#define ROWS 128
#define THREADS 256
#define BN 256
#define C_LD 136
#define DH_LD 68
#define ACC 128
#define TASKS 48
#define INTER 2048 /* DeepSeek-V3's I: g|u rows of 2 I, h rows of I */

enum { LIB, NOSTORE, NOLOAD, NOSHFL, ROWS4, NUM_MODES };
static const char *mode_name[NUM_MODES] = {"lib", "nostore", "noload", "noshfl", "rows4"};

static __device__ __forceinline__ uint32_t to_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
static __device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
static __device__ __forceinline__ long long gtimer() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* The accumulators of task `task`, thread t: values in [-2, 2), the same on the host. */
__host__ __device__ static inline float acc_value(int cta, int task, int t, int i) {
    uint32_t x = (uint32_t)(cta * 7919 + task * 104729 + t * 131 + i) * 2654435761u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    return (float)(x >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
}

/* One 256-column dh tile's epilogue, 64 columns at a time (backward.cu's loop, in variants). */
template <int MODE>
static __device__ __forceinline__ void epilogue(const float (&acc)[ACC], const uint16_t *gu, long long n0, const float *w,
                                                uint16_t *h_out, uint16_t *dgu_out, float *rdot, uint16_t *c,
                                                float *dsm, float *rsum, float *wsm, float *keep) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
    const long long gu_ld = 2 * INTER, h_ld = INTER, dgu_ld = 2 * INTER, inter = INTER;
    if (t < ROWS) {
        rsum[t] = 0.0f;
        wsm[t] = w[t];
    }
#pragma unroll
    for (int hc = 0; hc < BN / 64; ++hc) {
        if (MODE != NOLOAD)
            for (int idx = t; idx < ROWS * 16; idx += THREADS) {
                const int r = idx >> 4, c8 = (idx & 15) * 8;
                cp_async16(c + r * C_LD + c8, gu + r * gu_ld + (c8 < 64 ? n0 + 64 * hc + c8 : inter + n0 + 64 * hc + c8 - 64));
            }
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int a = 4 * (8 * hc + j) + 2 * half;
                *(float2 *)(dsm + (row0 + 8 * half) * DH_LD + 8 * j + col0) = make_float2(acc[a], acc[a + 1]);
            }
        if (MODE != NOLOAD) asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        const long long col = n0 + 64 * hc + 2 * lane;
        constexpr int R = MODE == ROWS4 ? 4 : 2; /* rows per iteration: rp + 8 k */
#pragma unroll 1
        for (int rp = warp; rp < ROWS; rp += R * 8) {
            uint32_t gpair[R], upair[R];
            float2 d[R];
            float wr[R];
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const int row = rp + 8 * k;
                gpair[k] = *(const uint32_t *)(c + row * C_LD + 2 * lane);
                upair[k] = *(const uint32_t *)(c + row * C_LD + 64 + 2 * lane);
                d[k] = *(const float2 *)(dsm + row * DH_LD + 2 * lane);
                wr[k] = wsm[row];
            }
            float part[R];
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const int row = rp + 8 * k;
                float h[2], dg[2], du[2];
#pragma unroll
                for (int q = 0; q < 2; ++q)
                    mok__swiglu_with_backward(wr[k] * (q ? d[k].y : d[k].x),
                                              __uint_as_float(q ? gpair[k] & 0xffff0000u : gpair[k] << 16),
                                              __uint_as_float(q ? upair[k] & 0xffff0000u : upair[k] << 16), 0.0f, &h[q],
                                              &dg[q], &du[q]);
                const uint32_t hb = to_bf16x2(h[0], h[1]);
                part[k] = 0.0f;
                part[k] += d[k].x * __uint_as_float(hb << 16);
                part[k] += d[k].y * __uint_as_float(hb & 0xffff0000u);
                const uint32_t gb = to_bf16x2(dg[0], dg[1]), ub = to_bf16x2(du[0], du[1]);
                if (MODE == NOSTORE) {
                    *keep += __uint_as_float(hb) + __uint_as_float(gb) + __uint_as_float(ub);
                } else {
                    uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                    *(uint32_t *)hp = hb;
                    *(uint32_t *)gp = gb;
                    *(uint32_t *)up = ub;
                }
            }
            if (MODE != NOSHFL) {
#pragma unroll
                for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
                    for (int k = 0; k < R; ++k) part[k] += __shfl_xor_sync(0xffffffffu, part[k], m);
            }
            if (lane == 0)
#pragma unroll
                for (int k = 0; k < R; ++k) rsum[rp + 8 * k] += part[k];
        }
        __syncthreads();
    }
    if (t < ROWS) rdot[t] = rsum[t];
}

template <int MODE>
__global__ void __launch_bounds__(THREADS, 1) epi_kernel(const uint16_t *gu_all, const float *w_all, uint16_t *h_all,
                                                         uint16_t *dgu_all, float *rdot_all, long long *times,
                                                         float *sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t *c = (uint16_t *)smem;
    float *dsm = (float *)(smem + ROWS * C_LD * 2), *rsum = dsm + ROWS * DH_LD, *wsm = rsum + ROWS;
    const int b = blockIdx.x, t = threadIdx.x;
    const uint16_t *gu = gu_all + (long long)b * ROWS * 2 * INTER;
    uint16_t *h = h_all + (long long)b * ROWS * INTER, *dgu = dgu_all + (long long)b * ROWS * 2 * INTER;
    if (MODE == NOLOAD) /* what the staging tile keeps: chunk 0 of the first tile */
        for (int idx = t; idx < ROWS * 16; idx += THREADS) {
            const int r = idx >> 4, c8 = (idx & 15) * 8;
            *(int4 *)(c + r * C_LD + c8) = *(const int4 *)(gu + r * 2 * INTER + (c8 < 64 ? c8 : INTER + c8 - 64));
        }
    float keep = 0.0f;
    for (int task = 0; task < TASKS; ++task) {
        float acc[ACC];
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = acc_value(b, task, t, i);
        const long long n0 = (long long)(task % (INTER / BN)) * BN;
        __syncthreads();
        const long long t0 = gtimer();
        epilogue<MODE>(acc, gu, n0, w_all + (long long)b * ROWS, h, dgu, rdot_all + ((long long)b * TASKS + task) * ROWS,
                       c, dsm, rsum, wsm, &keep);
        __syncthreads();
        if (t == 0) times[(long long)b * TASKS + task] = gtimer() - t0;
    }
    if (MODE == NOSTORE) sink[b * THREADS + t] = keep;
}

static float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) { /* round to nearest even; no NaNs here */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Host replay of CTA b's task `task` (the last one writes the outputs checked): h, dg|du of its
 * 256 columns and the rows' partial sums in the kernel's order, taken over the device's h
 * (h_dev) so that an expf a last bit apart, which the h check allows, does not move them. */
static void replay(int b, int task, const uint16_t *gu, const float *w, const uint16_t *h_dev, uint16_t *h,
                   uint16_t *dgu, float *rdot) {
    static float dh0[ROWS][BN];
    for (int t = 0; t < THREADS; ++t) {
        const int warp = t >> 5, lane = t & 31, row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
        for (int blk = 0; blk < 32; ++blk)
            for (int half = 0; half < 2; ++half)
                for (int e = 0; e < 2; ++e)
                    dh0[row0 + 8 * half][8 * blk + col0 + e] = acc_value(b, task, t, 4 * blk + 2 * half + e);
    }
    const int n0 = (task % (INTER / BN)) * BN;
    for (int r = 0; r < ROWS; ++r) {
        float sum = 0.0f;
        for (int hc = 0; hc < BN / 64; ++hc) {
            float lanes[32];
            for (int l = 0; l < 32; ++l) {
                float p = 0.0f;
                for (int e = 0; e < 2; ++e) {
                    const int cc = 64 * hc + 2 * l + e, col = n0 + cc;
                    const float g = bf16_to_f32(gu[(long long)r * 2 * INTER + col]);
                    const float u = bf16_to_f32(gu[(long long)r * 2 * INTER + INTER + col]);
                    float hv, dg, du;
                    mok__swiglu_with_backward(w[r] * dh0[r][cc], g, u, 0.0f, &hv, &dg, &du);
                    h[(long long)r * INTER + col] = f32_to_bf16(hv);
                    dgu[(long long)r * 2 * INTER + col] = f32_to_bf16(dg);
                    dgu[(long long)r * 2 * INTER + INTER + col] = f32_to_bf16(du);
                    p = fmaf(dh0[r][cc], bf16_to_f32(h_dev[(long long)r * INTER + col]), p);
                }
                lanes[l] = p;
            }
            for (int m = 16; m >= 1; m >>= 1) {
                float next[32];
                for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ m];
                memcpy(lanes, next, sizeof lanes);
            }
            sum += lanes[0];
        }
        rdot[r] = sum;
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
    const size_t smem = ROWS * C_LD * 2 + (ROWS * DH_LD + 2 * ROWS) * 4;
    const size_t n_gu = (size_t)sms * ROWS * 2 * INTER, n_h = (size_t)sms * ROWS * INTER;
    uint16_t *gu_h = (uint16_t *)malloc(n_gu * 2);
    float *w_h = (float *)malloc((size_t)sms * ROWS * 4);
    srand(12345);
    for (size_t i = 0; i < n_gu; ++i) gu_h[i] = f32_to_bf16(((float)rand() / RAND_MAX) * 6.0f - 3.0f);
    for (int i = 0; i < sms * ROWS; ++i) w_h[i] = (float)rand() / RAND_MAX;
    uint16_t *gu, *h, *dgu;
    float *w, *rdot, *sink;
    long long *times;
    TRY(cudaMalloc(&gu, n_gu * 2));
    TRY(cudaMalloc(&h, n_h * 2));
    TRY(cudaMalloc(&dgu, n_gu * 2));
    TRY(cudaMalloc(&w, (size_t)sms * ROWS * 4));
    TRY(cudaMalloc(&rdot, (size_t)sms * TASKS * ROWS * 4));
    TRY(cudaMalloc(&sink, (size_t)sms * THREADS * 4));
    TRY(cudaMalloc(&times, (size_t)sms * TASKS * 8));
    TRY(cudaMemcpy(gu, gu_h, n_gu * 2, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(w, w_h, (size_t)sms * ROWS * 4, cudaMemcpyHostToDevice));

    void (*kernels[NUM_MODES])(const uint16_t *, const float *, uint16_t *, uint16_t *, float *, long long *, float *) = {
        epi_kernel<LIB>, epi_kernel<NOSTORE>, epi_kernel<NOLOAD>, epi_kernel<NOSHFL>, epi_kernel<ROWS4>};
    long long *times_h = (long long *)malloc((size_t)sms * TASKS * 8);
    uint16_t *out_h[2], *out_dgu[2];
    float *out_rdot[2];
    printf("%-8s %12s %12s   (µs per 256-column tile: median of tasks 8.. over CTAs)\n", "variant", "1 CTA",
           "1 CTA per SM");
    for (int m = 0; m < NUM_MODES; ++m) {
        TRY(cudaFuncSetAttribute(kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        double med[2];
        for (int pass = 0; pass < 2; ++pass) {
            const int grid = pass == 0 ? 1 : sms;
            kernels[m]<<<grid, THREADS, smem>>>(gu, w, h, dgu, rdot, times, sink);
            TRY(cudaGetLastError());
            TRY(cudaDeviceSynchronize());
            TRY(cudaMemcpy(times_h, times, (size_t)grid * TASKS * 8, cudaMemcpyDeviceToHost));
            int n = 0;
            static double v[1 << 16];
            for (int b = 0; b < grid; ++b)
                for (int task = 8; task < TASKS; ++task) v[n++] = times_h[(long long)b * TASKS + task] / 1e3;
            for (int i = 1; i < n; ++i) /* insertion sort: a few thousand values */
                for (int j = i; j > 0 && v[j - 1] > v[j]; --j) {
                    double tmp = v[j];
                    v[j] = v[j - 1];
                    v[j - 1] = tmp;
                }
            med[pass] = v[n / 2];
        }
        printf("%-8s %12.2f %12.2f\n", mode_name[m], med[0], med[1]);
        if (m == LIB || m == ROWS4) { /* the full-grid run's outputs: CTA 0's last task */
            const int k = m == LIB ? 0 : 1;
            out_h[k] = (uint16_t *)malloc(ROWS * INTER * 2);
            out_dgu[k] = (uint16_t *)malloc(ROWS * 2 * INTER * 2);
            out_rdot[k] = (float *)malloc(ROWS * 4);
            TRY(cudaMemcpy(out_h[k], h, ROWS * INTER * 2, cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(out_dgu[k], dgu, ROWS * 2 * INTER * 2, cudaMemcpyDeviceToHost));
            TRY(cudaMemcpy(out_rdot[k], rdot + (size_t)(TASKS - 1) * ROWS, ROWS * 4, cudaMemcpyDeviceToHost));
        }
    }
    /* The host replay of CTA 0's last task, and lib against rows4 */
    uint16_t *ref_h = (uint16_t *)calloc(ROWS * INTER, 2), *ref_dgu = (uint16_t *)calloc(ROWS * 2 * INTER, 2);
    float ref_rdot[ROWS];
    const int n0 = ((TASKS - 1) % (INTER / BN)) * BN;
    for (int k = 0; k < 2; ++k) {
        replay(0, TASKS - 1, gu_h, w_h, out_h[k], ref_h, ref_dgu, ref_rdot);
        int bad = 0;
        double worst = 0.0, scale = 0.0;
        for (int r = 0; r < ROWS; ++r) {
            for (int cc = 0; cc < BN; ++cc) {
                const long long hi = (long long)r * INTER + n0 + cc, gi = (long long)r * 2 * INTER + n0 + cc;
                const uint16_t got[3] = {out_h[k][hi], out_dgu[k][gi], out_dgu[k][gi + INTER]};
                const uint16_t want[3] = {ref_h[hi], ref_dgu[gi], ref_dgu[gi + INTER]};
                for (int q = 0; q < 3; ++q) { /* one bf16 step: the device's expf may differ by an ulp */
                    const float a = bf16_to_f32(got[q]), e = bf16_to_f32(want[q]);
                    if (fabsf(a - e) > fabsf(e) * (1.0f / 128.0f) + 1e-30f) ++bad;
                }
            }
            scale = fmax(scale, fabs(ref_rdot[r]));
        }
        for (int r = 0; r < ROWS; ++r) worst = fmax(worst, fabs(out_rdot[k][r] - ref_rdot[r]));
        char what[160];
        snprintf(what, sizeof what, "%s: h, dg, du against the host (%d of %d values off by more than a bf16 step)",
                 k ? "rows4" : "lib", bad, ROWS * BN * 3);
        check(bad == 0, what);
        snprintf(what, sizeof what, "%s: router-weight partials against the host (worst %.2e of scale %.2e)",
                 k ? "rows4" : "lib", worst, scale);
        check(worst <= 1e-6 * scale, what);
    }
    check(memcmp(out_h[0], out_h[1], ROWS * INTER * 2) == 0 && memcmp(out_dgu[0], out_dgu[1], ROWS * 2 * INTER * 2) == 0 &&
              memcmp(out_rdot[0], out_rdot[1], ROWS * 4) == 0,
          "rows4 gives lib's bits");
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
