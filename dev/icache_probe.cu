/* icache_probe.cu — experiment: what straight-line code costs when it runs once per task.
 *
 * The question (docs/log.md): the megakernel's epilogues take far longer per SASS instruction
 * per warp than issuing them would (one warp instruction per cycle per scheduler, two consumer
 * warps on each). The hypothesis: their code is cold. Each epilogue is straight-line code (fully
 * unrolled over the accumulators) that runs once per task, between main loops, in a kernel of
 * hundreds of KB of code, so its instructions keep coming from L2.
 *
 * The probe: one CTA per SM with 8 warps (as many as the consumers), walking TASKS tasks. A task
 * is a hot loop (a few FMAs in a small loop, like a main loop) and then a straight-line block of
 * S FFMA instructions per thread (8 independent chains with distinct immediates, so it cannot be
 * rolled back into a loop), run twice through the same code (`#pragma unroll 1`): the first run
 * finds the block as the previous task left it, the second right after the first. Lane 0 of
 * every warp times both runs with clock64. The table gives cycles per instruction per warp for
 * each S (8 warps on 4 schedulers: ~2 is issue-bound), and the block's size in KB.
 * If the hypothesis holds, the first run costs several times the second once S no longer fits
 * the instruction caches, and the second stays near 2.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a dev/icache_probe.cu \
 *        -o build/icache_probe && ./build/icache_probe
 * It checks each kernel's result against a host replay of one thread's arithmetic and ends with
 * `N passed, N failed`. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "try.h"

#define WARPS 8
#define TASKS 40
#define HOT_ITERS 4000

/* The block: N rounds of 8 FMAs, every one with its own immediate. Halved recursively down to
 * 256 rounds, because nvcc stops unrolling one loop fully past ~1024 rounds. */
template <int N, int OFF = 0>
__host__ __device__ __forceinline__ void straight(float (&v)[8], float y) {
    if constexpr (N > 256) {
        straight<N / 2, OFF>(v, y);
        straight<N / 2, OFF + N / 2>(v, y);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) {
#pragma unroll
            for (int c = 0; c < 8; ++c) v[c] = fmaf(v[c], y, 1.0f + 1e-6f * (float)((OFF + i) * 8 + c));
        }
    }
}

/* The hot loop: one small loop body, as a main loop's code stays cached. */
__host__ __device__ __forceinline__ void hot(float (&v)[8], float y, int iters) {
    float k = 0.5f;
#pragma unroll 1
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int c = 0; c < 8; ++c) v[c] = fmaf(v[c], y, k);
        k = k * 0.999f;
    }
}

__host__ __device__ inline void start_values(float (&v)[8], float *y, int thread) {
    for (int c = 0; c < 8; ++c) v[c] = 0.25f + 0.01f * (float)c + 1e-5f * (float)(thread % 97);
    *y = 0.5f + 1e-7f * (float)(thread % 31);
}

template <int N>
__global__ void __launch_bounds__(32 * WARPS, 1) probe(long long *cycles, float *out) {
    const int thread = blockIdx.x * blockDim.x + threadIdx.x;
    float v[8], y;
    start_values(v, &y, thread);
    long long first = 0, second = 0;
    for (int t = 0; t < TASKS; ++t) {
        hot(v, y, HOT_ITERS);
        __syncwarp();
#pragma unroll 1
        for (int run = 0; run < 2; ++run) {
            const long long c0 = clock64();
            straight<N>(v, y);
            __syncwarp();
            const long long c1 = clock64();
            if (run == 0) first += c1 - c0;
            else second += c1 - c0;
        }
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd((unsigned long long *)&cycles[0], (unsigned long long)first);
        atomicAdd((unsigned long long *)&cycles[1], (unsigned long long)second);
    }
    float s = 0.0f;
    for (int c = 0; c < 8; ++c) s += v[c];
    out[thread] = s;
}

/* One thread's arithmetic on the host, in the kernel's order. */
template <int N>
static float host_replay(int thread) {
    float v[8], y;
    start_values(v, &y, thread);
    for (int t = 0; t < TASKS; ++t) {
        hot(v, y, HOT_ITERS);
        for (int run = 0; run < 2; ++run) straight<N>(v, y);
    }
    float s = 0.0f;
    for (int c = 0; c < 8; ++c) s += v[c];
    return s;
}

static int passed, failed;

template <int N>
static void run(int sms) {
    const int threads = sms * 32 * WARPS;
    long long *cycles;
    float *out;
    TRY(cudaMalloc(&cycles, 2 * sizeof(long long)));
    TRY(cudaMalloc(&out, threads * sizeof(float)));
    TRY(cudaMemset(cycles, 0, 2 * sizeof(long long)));
    probe<N><<<sms, 32 * WARPS>>>(cycles, out);
    TRY(cudaGetLastError());
    TRY(cudaDeviceSynchronize());
    long long c[2];
    float *h = (float *)malloc(threads * sizeof(float));
    TRY(cudaMemcpy(c, cycles, sizeof c, cudaMemcpyDeviceToHost));
    TRY(cudaMemcpy(h, out, threads * sizeof(float), cudaMemcpyDeviceToHost));
    /* the device fuses nothing the host does not (fmaf both sides), so a few threads must agree
       to within rounding of the order-identical arithmetic */
    int bad = 0;
    for (int i = 0; i < threads; i += threads / 7 + 1) {
        const float want = host_replay<N>(i);
        if (!(fabsf(h[i] - want) <= 1e-5f * fabsf(want) + 1e-6f)) ++bad;
    }
    const double warps = (double)sms * WARPS, instr = 8.0 * N;
    const double per_first = (double)c[0] / (warps * TASKS * instr), per_second = (double)c[1] / (warps * TASKS * instr);
    printf("S = %6d FFMA (%5.0f KB)   first run %6.2f cycles/instr   second run %6.2f   ratio %5.2f   %s\n", 8 * N,
           instr * 16.0 / 1024.0, per_first, per_second, per_first / per_second, bad ? "FAIL (result)" : "ok");
    bad ? ++failed : ++passed;
    free(h);
    TRY(cudaFree(cycles));
    TRY(cudaFree(out));
}

int main(void) {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("icache probe: %d CTAs x %d warps, %d tasks of %d hot iterations + a straight-line block run twice\n", sms,
           WARPS, TASKS, HOT_ITERS);
    run<64>(sms);
    run<256>(sms);
    run<1024>(sms);
    run<2048>(sms);
    run<4096>(sms);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
