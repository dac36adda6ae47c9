/* dh_epi_probe.cu — experiment: where the SwiGLU-backward epilogue of a dh task spends its time.
 *
 * The question (docs/log.md): the dh epilogue (megakernel/swiglu.cuh, swiglu_backward_epilogue)
 * takes a large share of a dh task and moves its bytes far slower than an SM can store them with
 * the same pattern (dev/store_probe.cu). Is it the per-chunk g|u round trips, the row loop's
 * dependent chain (shared loads, the sigmoid, a five-level shuffle tree per row group), or the
 * stores?
 *
 * The probe runs the epilogue alone: one CTA per SM (and one CTA alone) with the compute CTA's
 * layout (a producer warpgroup, idle here, and the two consumer warpgroups that run the
 * epilogue), TASKS epilogues each on fresh accumulators, each timed with %globaltimer and in SM
 * cycles (clock64) between two barriers: the cycles read the same at any clock, so they set the
 * probe, which runs from idle at the boost clock, beside a pass at another clock. The library's
 * epilogue itself (its header, included) runs beside variants of its loop (same layouts:
 * 64-column chunks through a 128 x 136 bf16 staging tile and a 128 x 68 fp32 scratch) that each
 * take one part away or change one thing:
 *   lib        the library's swiglu_backward_epilogue;
 *   nostore    h, dg and du are not stored (their values feed a checksum instead);
 *   noload     g|u are not loaded per chunk (the staging tile keeps what it was given once);
 *   noshfl     no shuffle tree (each lane keeps its own partial);
 *   rows2      two rows per iteration instead of the library's four: the same per-row math and
 *              the same tree (the same bits as lib), half the independent chains;
 *   tree6      the four rows' partials summed across the warp by a transposed tree: 6 shuffles
 *              instead of 20, each level adding the same two halves (the same bits);
 *   team11     the row loop run by 11 warps: the consumers and the producer warpgroup's warps 1-3
 *              (the consumers still load g|u and write dh0); team12 with all four; team11t
 *              team11 with tree6's sums.
 * Then lib on every other SM: with the others idle, reading a buffer that fits L2, or reading one
 * from memory (the pass runs the epilogue beside other SMs' main loops, where it takes about
 * twice its time alone).
 * lib is checked against a host replay of the arithmetic (h, dg, du within one bf16 step; the
 * router-weight partials, over the device's h, within 1e-6 of their scale), and rows2, tree6 and
 * the teams against lib (bitwise).
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a dev/dh_epi_probe.cu \
 *        -o build/dh_epi_probe && ./build/dh_epi_probe
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
#define CONSUMERS CONSUMER_THREADS
#define BN TILE_BN
#define C_LD TILE_C_LD
#define DH_LD DH_SCRATCH_LD
#define ACC TILE_ACC
#define TASKS 48
#define INTER 2048 /* DeepSeek-V3's I: g|u rows of 2 I, h rows of I */

enum { LIB, NOSTORE, NOLOAD, NOSHFL, ROWS2, TREE6, TEAM11, TEAM12, TEAM11T, NUM_MODES };
static const char *mode_name[NUM_MODES] = {"lib", "nostore", "noload", "noshfl", "rows2", "tree6", "team11", "team12", "team11t"};

/* The warps that run a mode's row loop: the 8 consumer warps, or they and the producer
 * warpgroup's last 3 (team11) or all 4 (team12): the CTA's warps 12 - team .. 11. */
template <int MODE> struct mode_of {
    static constexpr int team = MODE == TEAM12 ? 12 : MODE == TEAM11 || MODE == TEAM11T ? 11 : 8;
    static constexpr bool tree = MODE == TREE6 || MODE == TEAM11T;
};
template <int TEAM> static __device__ __forceinline__ void team_sync() {
    if (TEAM == 8)
        consumer_sync();
    else
        asm volatile("bar.sync 3, %0;" ::"n"(TEAM * 32) : "memory");
}

/* The accumulators of task `task`, thread t: values in [-2, 2), the same on the host. */
__host__ __device__ static inline float acc_value(int cta, int task, int t, int i) {
    uint32_t x = (uint32_t)(cta * 7919 + task * 104729 + t * 131 + i) * 2654435761u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    return (float)(x >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
}

/* One 256-column dh tile's epilogue, 64 columns at a time: the library's loop in the variants
 * that take a part away (lib itself runs the library's function). Consumer threads only. */
/* Every thread of the mode's team runs it; the consumers (t >= 0) alone load g|u and write dh0.
 * Row group g (0..31) is rows rp + 8 k, rp = 32 (g / 8) + g % 8: team warp i takes g = i + team m,
 * so with the 8 consumers alone warp w takes rows w + 32 m + 8 k, as the library's loop does, and
 * every row's sums run in the same order whatever the team (the same bits). tree: the 4 rows'
 * partials summed across the warp by the library's transposed tree (warp_sums4), else by the
 * plain xor 16 .. 1 butterfly. */
template <int MODE>
static __device__ __forceinline__ void variant(const float (&acc)[ACC], const uint16_t *gu, long long n0, const float *w,
                                               uint16_t *h_out, uint16_t *dgu_out, float *rdot, uint16_t *c, float *dsm,
                                               float *rsum, float *wsm, float *keep) {
    constexpr int TEAM = mode_of<MODE>::team;
    const int t = threadIdx.x - PRODUCER_THREADS, lane = threadIdx.x & 31, warp = t >> 5;
    const int wi = (int)(threadIdx.x >> 5) - (12 - TEAM);
    const int row0 = warp * 16 + (lane >> 2), col0 = 2 * (lane & 3);
    const long long gu_ld = 2 * INTER, h_ld = INTER, dgu_ld = 2 * INTER, inter = INTER;
    if (t >= 0 && t < ROWS) {
        rsum[t] = 0.0f;
        wsm[t] = w[t];
    }
#pragma unroll
    for (int hc = 0; hc < BN / 64; ++hc) {
        if (MODE != NOLOAD && t >= 0)
            for (int idx = t; idx < ROWS * 16; idx += CONSUMERS) {
                const int r = idx >> 4, c8 = (idx & 15) * 8;
                cp_async_16(smem_addr(c + r * C_LD + c8),
                            gu + r * gu_ld + (c8 < 64 ? n0 + 64 * hc + c8 : inter + n0 + 64 * hc + c8 - 64), true);
            }
        if (t >= 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int a = 4 * (8 * hc + j) + 2 * half;
                    *(float2 *)(dsm + (row0 + 8 * half) * DH_LD + 8 * j + col0) = make_float2(acc[a], acc[a + 1]);
                }
            if (MODE != NOLOAD) cp_async_wait_all();
        }
        team_sync<TEAM>();
        const long long col = n0 + 64 * hc + 2 * lane;
        constexpr int R = MODE == ROWS2 ? 2 : 4; /* rows per iteration: rp + 8 k */
#pragma unroll 1
        for (int gi = wi; gi < (MODE == ROWS2 ? 64 : 32); gi += TEAM) {
            const int rp = MODE == ROWS2 ? (gi >> 3) * 16 + (gi & 7) : (gi >> 3) * 32 + (gi & 7);
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
                const uint32_t hb = bf16x2_from_f32(h[0], h[1]);
                part[k] = 0.0f;
                part[k] += d[k].x * __uint_as_float(hb << 16);
                part[k] += d[k].y * __uint_as_float(hb & 0xffff0000u);
                const uint32_t gb = bf16x2_from_f32(dg[0], dg[1]), ub = bf16x2_from_f32(du[0], du[1]);
                if (MODE == NOSTORE) {
                    *keep += __uint_as_float(hb) + __uint_as_float(gb) + __uint_as_float(ub);
                } else {
                    uint16_t *hp = h_out + row * h_ld + col, *gp = dgu_out + row * dgu_ld + col, *up = gp + inter;
                    *(uint32_t *)hp = hb;
                    *(uint32_t *)gp = gb;
                    *(uint32_t *)up = ub;
                }
            }
            if constexpr (mode_of<MODE>::tree) { /* the library's transposed tree and row sums (swiglu.cuh) */
                add_row_partials(part, rp, ROWS, rsum);
            } else {
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
        }
        team_sync<TEAM>();
    }
    if (t >= 0 && t < ROWS) rdot[t] = rsum[t];
}

/* CTA b's TASKS epilogues in mode MODE, each timed between two barriers into times; smem is the
 * staging tile and the dh scratch. */
template <int MODE>
static __device__ __forceinline__ void epi_tasks(const uint16_t *gu_all, const float *w_all, uint16_t *h_all,
                                                 uint16_t *dgu_all, float *rdot_all, long long *times, float *sink,
                                                 unsigned char *smem) {
    uint16_t *c = (uint16_t *)smem;
    float *dsm = (float *)(smem + ROWS * C_LD * 2), *rsum = dsm + ROWS * DH_LD, *wsm = rsum + ROWS;
    const int b = blockIdx.x, t = threadIdx.x - PRODUCER_THREADS; /* t < 0: the producer warpgroup */
    const uint16_t *gu = gu_all + (long long)b * ROWS * 2 * INTER;
    uint16_t *h = h_all + (long long)b * ROWS * INTER, *dgu = dgu_all + (long long)b * ROWS * 2 * INTER;
    if (MODE == NOLOAD && t >= 0) /* what the staging tile keeps: chunk 0 of the first tile */
        for (int idx = t; idx < ROWS * 16; idx += CONSUMERS) {
            const int r = idx >> 4, c8 = (idx & 15) * 8;
            *(int4 *)(c + r * C_LD + c8) = *(const int4 *)(gu + r * 2 * INTER + (c8 < 64 ? c8 : INTER + c8 - 64));
        }
    float keep = 0.0f;
    for (int task = 0; task < TASKS; ++task) {
        const long long n0 = (long long)(task % (INTER / BN)) * BN;
        const float *w = w_all + (long long)b * ROWS;
        float *rdot = rdot_all + ((long long)b * TASKS + task) * ROWS;
        float acc[ACC];
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = t >= 0 ? acc_value(b, task, t, i) : 0.0f;
        __syncthreads();
        const long long t0 = globaltimer_ns(), c0 = clock64();
        if (MODE == LIB) {
            if (t >= 0)
                swiglu_backward_epilogue(acc, ROWS, BN, gu, 2 * INTER, INTER, n0, w, 0.0f, h, INTER, dgu, 2 * INTER, rdot,
                                         1, c, false);
        } else if ((int)(threadIdx.x >> 5) >= 12 - mode_of<MODE>::team) {
            variant<MODE>(acc, gu, n0, w, h, dgu, rdot, c, dsm, rsum, wsm, &keep);
        }
        __syncthreads();
        if (t == 0) {
            times[2 * ((long long)b * TASKS + task)] = globaltimer_ns() - t0;
            times[2 * ((long long)b * TASKS + task) + 1] = clock64() - c0;
        }
    }
    if (MODE == NOSTORE && t >= 0) sink[b * CONSUMERS + t] = keep;
}

/* COMPUTE_THREADS threads, as a compute CTA: the producer warpgroup only keeps the barriers. */
template <int MODE>
__global__ void __launch_bounds__(COMPUTE_THREADS, 1) epi_kernel(const uint16_t *gu_all, const float *w_all,
                                                                 uint16_t *h_all, uint16_t *dgu_all, float *rdot_all,
                                                                 long long *times, float *sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    epi_tasks<MODE>(gu_all, w_all, h_all, dgu_all, rdot_all, times, sink, smem);
}

/* The library's epilogue on the even CTAs while the odd ones (STREAM 1) read a buffer with 16-byte
 * loads that bypass L1 until every even CTA is done, or (STREAM 0) leave at once: how much of the
 * epilogue's time in the pass comes from what the SMs beside it draw from L2 or memory (a buffer
 * that fits L2 stands for the main loops' operands, a larger one for traffic to memory; n16, its
 * 16-byte words, a power of two). */
template <int STREAM>
__global__ void __launch_bounds__(COMPUTE_THREADS, 1) beside_kernel(const uint16_t *gu_all, const float *w_all,
                                                                    uint16_t *h_all, uint16_t *dgu_all, float *rdot_all,
                                                                    long long *times, const int4 *buf, long long n16,
                                                                    unsigned *done, float *sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int b = blockIdx.x, evens = (gridDim.x + 1) / 2;
    if (b & 1) {
        if (!STREAM) return;
        int4 x = make_int4(0, 0, 0, 0);
        long long i = ((long long)(b / 2) * COMPUTE_THREADS + threadIdx.x) * 4;
        const long long step = (long long)(gridDim.x / 2) * COMPUTE_THREADS * 4;
        for (unsigned k = 0;; ++k) {
#pragma unroll
            for (int u = 0; u < 4; ++u) { /* four loads in flight a thread */
                int4 v;
                asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                             : "l"(buf + ((i + u) & (n16 - 1))));
                x.x ^= v.x;
                x.y ^= v.y;
                x.z ^= v.z;
                x.w ^= v.w;
            }
            i = (i + step) & (n16 - 1);
            if ((k & 63) == 0 && *(volatile unsigned *)done >= (unsigned)evens) break;
        }
        sink[b * COMPUTE_THREADS + threadIdx.x] = (float)(x.x ^ x.y ^ x.z ^ x.w);
        return;
    }
    epi_tasks<LIB>(gu_all, w_all, h_all, dgu_all, rdot_all, times, sink, smem);
    if (threadIdx.x == 0) atomicAdd(done, 1u);
}

/* The median of tasks 8.. over CTAs 0, every, 2 every, .. below grid: of their times in µs
 * (what = 0) or of their SM cycles in thousands (what = 1). */
static double median_of(const long long *times_h, int grid, int every, int what) {
    static double v[1 << 16];
    int n = 0;
    for (int b = 0; b < grid; b += every)
        for (int task = 8; task < TASKS; ++task) v[n++] = times_h[2 * ((long long)b * TASKS + task) + what] / 1e3;
    for (int i = 1; i < n; ++i) /* insertion sort: a few thousand values */
        for (int j = i; j > 0 && v[j - 1] > v[j]; --j) {
            double tmp = v[j];
            v[j] = v[j - 1];
            v[j - 1] = tmp;
        }
    return v[n / 2];
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
    for (int t = 0; t < CONSUMERS; ++t) {
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
    TRY(cudaMalloc(&sink, (size_t)sms * CONSUMERS * 4));
    TRY(cudaMalloc(&times, (size_t)sms * TASKS * 16));
    TRY(cudaMemcpy(gu, gu_h, n_gu * 2, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(w, w_h, (size_t)sms * ROWS * 4, cudaMemcpyHostToDevice));

    void (*kernels[NUM_MODES])(const uint16_t *, const float *, uint16_t *, uint16_t *, float *, long long *, float *) = {
        epi_kernel<LIB>,   epi_kernel<NOSTORE>, epi_kernel<NOLOAD>, epi_kernel<NOSHFL>, epi_kernel<ROWS2>,
        epi_kernel<TREE6>, epi_kernel<TEAM11>,  epi_kernel<TEAM12>, epi_kernel<TEAM11T>};
    long long *times_h = (long long *)malloc((size_t)sms * TASKS * 16);
    /* the modes that compute the outputs (all but nostore, noload, noshfl) */
    const int exact[] = {LIB, ROWS2, TREE6, TEAM11, TEAM12, TEAM11T};
    const int n_exact = (int)(sizeof exact / sizeof exact[0]);
    uint16_t *out_h[NUM_MODES] = {0}, *out_dgu[NUM_MODES] = {0};
    float *out_rdot[NUM_MODES] = {0};
    printf("%-8s %12s %12s   %8s %8s   (µs, then thousands of SM cycles, per 256-column tile: median of tasks 8.. "
           "over CTAs)\n",
           "variant", "1 CTA", "1 CTA per SM", "1 CTA", "per SM");
    for (int m = 0; m < NUM_MODES; ++m) {
        TRY(cudaFuncSetAttribute(kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        double med[2], kcyc[2];
        for (int pass = 0; pass < 2; ++pass) {
            const int grid = pass == 0 ? 1 : sms;
            kernels[m]<<<grid, COMPUTE_THREADS, smem>>>(gu, w, h, dgu, rdot, times, sink);
            TRY(cudaGetLastError());
            TRY(cudaDeviceSynchronize());
            TRY(cudaMemcpy(times_h, times, (size_t)grid * TASKS * 16, cudaMemcpyDeviceToHost));
            med[pass] = median_of(times_h, grid, 1, 0);
            kcyc[pass] = median_of(times_h, grid, 1, 1);
        }
        printf("%-8s %12.2f %12.2f   %8.2f %8.2f\n", mode_name[m], med[0], med[1], kcyc[0], kcyc[1]);
        for (int e = 0; e < n_exact; ++e)
            if (exact[e] == m) { /* the full-grid run's outputs: CTA 0's last task */
                out_h[m] = (uint16_t *)malloc(ROWS * INTER * 2);
                out_dgu[m] = (uint16_t *)malloc(ROWS * 2 * INTER * 2);
                out_rdot[m] = (float *)malloc(ROWS * 4);
                TRY(cudaMemcpy(out_h[m], h, ROWS * INTER * 2, cudaMemcpyDeviceToHost));
                TRY(cudaMemcpy(out_dgu[m], dgu, ROWS * 2 * INTER * 2, cudaMemcpyDeviceToHost));
                TRY(cudaMemcpy(out_rdot[m], rdot + (size_t)(TASKS - 1) * ROWS, ROWS * 4, cudaMemcpyDeviceToHost));
            }
    }
    /* The library's epilogue on every other SM: alone, beside SMs reading a 16 MB buffer (L2), and
       beside SMs reading a 1 GB one (memory) */
    {
        const long long n16[2] = {(16ll << 20) / 16, (1ll << 30) / 16};
        int4 *buf;
        unsigned *done;
        TRY(cudaMalloc(&buf, (size_t)n16[1] * 16));
        TRY(cudaMemset(buf, 1, (size_t)n16[1] * 16));
        TRY(cudaMalloc(&done, 4));
        float *sink2;
        TRY(cudaMalloc(&sink2, (size_t)sms * COMPUTE_THREADS * 4));
        TRY(cudaFuncSetAttribute(beside_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        TRY(cudaFuncSetAttribute(beside_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        const char *what[3] = {"half: lib on every other SM, the rest idle", "beside L2: the rest read 16 MB",
                               "beside memory: the rest read 1 GB"};
        for (int k = 0; k < 3; ++k) {
            TRY(cudaMemset(done, 0, 4));
            if (k == 0) beside_kernel<0><<<sms, COMPUTE_THREADS, smem>>>(gu, w, h, dgu, rdot, times, buf, n16[0], done, sink2);
            else beside_kernel<1><<<sms, COMPUTE_THREADS, smem>>>(gu, w, h, dgu, rdot, times, buf, n16[k - 1], done, sink2);
            TRY(cudaGetLastError());
            TRY(cudaDeviceSynchronize());
            TRY(cudaMemcpy(times_h, times, (size_t)sms * TASKS * 16, cudaMemcpyDeviceToHost));
            printf("%-44s %8.2f   %8.2f\n", what[k], median_of(times_h, sms, 2, 0), median_of(times_h, sms, 2, 1));
        }
        TRY(cudaFree(buf));
        TRY(cudaFree(done));
        TRY(cudaFree(sink2));
    }
    /* The host replay of CTA 0's last task against lib; every other exact mode against lib's bits */
    uint16_t *ref_h = (uint16_t *)calloc(ROWS * INTER, 2), *ref_dgu = (uint16_t *)calloc(ROWS * 2 * INTER, 2);
    float ref_rdot[ROWS];
    const int n0 = ((TASKS - 1) % (INTER / BN)) * BN;
    {
        replay(0, TASKS - 1, gu_h, w_h, out_h[LIB], ref_h, ref_dgu, ref_rdot);
        int bad = 0;
        double worst = 0.0, scale = 0.0;
        for (int r = 0; r < ROWS; ++r) {
            for (int cc = 0; cc < BN; ++cc) {
                const long long hi = (long long)r * INTER + n0 + cc, gi = (long long)r * 2 * INTER + n0 + cc;
                const uint16_t got[3] = {out_h[LIB][hi], out_dgu[LIB][gi], out_dgu[LIB][gi + INTER]};
                const uint16_t want[3] = {ref_h[hi], ref_dgu[gi], ref_dgu[gi + INTER]};
                for (int q = 0; q < 3; ++q) { /* one bf16 step: the device's expf may differ by an ulp */
                    const float a = bf16_to_f32(got[q]), e = bf16_to_f32(want[q]);
                    if (fabsf(a - e) > fabsf(e) * (1.0f / 128.0f) + 1e-30f) ++bad;
                }
            }
            scale = fmax(scale, fabs(ref_rdot[r]));
        }
        for (int r = 0; r < ROWS; ++r) worst = fmax(worst, fabs(out_rdot[LIB][r] - ref_rdot[r]));
        char what[160];
        snprintf(what, sizeof what, "lib: h, dg, du against the host (%d of %d values off by more than a bf16 step)", bad,
                 ROWS * BN * 3);
        check(bad == 0, what);
        snprintf(what, sizeof what, "lib: router-weight partials against the host (worst %.2e of scale %.2e)", worst,
                 scale);
        check(worst <= 1e-6 * scale, what);
    }
    for (int e = 1; e < n_exact; ++e) {
        const int m = exact[e];
        char what[160];
        snprintf(what, sizeof what, "%s gives lib's bits", mode_name[m]);
        check(memcmp(out_h[LIB], out_h[m], ROWS * INTER * 2) == 0 &&
                  memcmp(out_dgu[LIB], out_dgu[m], ROWS * 2 * INTER * 2) == 0 &&
                  memcmp(out_rdot[LIB], out_rdot[m], ROWS * 4) == 0,
              what);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
