/* wgmma_rate_probe.cu — experiment: how many SM cycles the tensor cores take per 128 x 256 tile
 * stage in each arrangement of the consumers' K loop, with the operands already in shared memory
 * (no loads, no ring, no epilogue), so that what holds the FP8 main loop below its peak can be told
 * apart from what feeds it.
 *
 * One CTA per SM, two consumer warpgroups, each owning 64 rows of a 128 x 256 tile, running
 * `stages` K stages on one fixed stage of operands (48 KB, 128B-swizzled: A 128 rows, B 256 rows of
 * 128 bytes; finite random codes). Per stage, each warpgroup runs:
 *   bf16/n256     four m64n256k16 bf16 wgmmas (K 64) into its 128 accumulators, one group in flight
 *                 (wait 1): the bf16 tile's loop;
 *   e4m3/n256     four m64n256k32 E4M3 wgmmas (K 128) into 128 accumulators, one group in flight:
 *                 the E4M3 ceiling of this tile without promotion;
 *   e4m3/n128x2   two chunks of four m64n128k32 into two sets of 64 accumulators, one group in flight:
 *                 the n128 instruction's ceiling (A read twice a stage);
 *   e4m3/lib      the megakernel's FP8 loop (fp8_tile.cuh's fp8_chunk and fp8_promote): per chunk
 *                 four m64n128k32 into 64 partial sums, wait 0, promote 64 fmas into the chunk's
 *                 accumulators;
 *   e4m3/lib-sync lib with both warpgroups meeting at a named barrier every stage, as they do when
 *                 the producer's stages arrive just in time;
 *   e4m3/lib-1wg  lib with one warpgroup (64 x 256): a chunk's tensor time and the gap after it;
 *   e4m3/areg     lib with A from registers: each thread loads the stage's 16 registers of A once
 *                 (four 16-byte shared loads, not in the fragment's layout: the rate is what is
 *                 measured) and both chunks' wgmmas read them, so A is read from shared memory
 *                 once a stage instead of once a chunk.
 * Reported: SM cycles per stage (clock64, median over CTAs) and the tensor rate as FLOP per SM cycle
 * against the dense peaks (bf16 4096, E4M3 8192 FLOP per SM cycle: the H100/H200 datasheet figures
 * over 132 SMs at 1830 MHz), with TFLOP/s from CUDA events (the clock the GPU chose). Results are
 * kept alive through a store that never happens; they are not checked (dev/fp8_tile_probe.cu checks
 * these instructions' results).
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a dev/wgmma_rate_probe.cu \
 *        -o build/wgmma_rate_probe && ./build/wgmma_rate_probe */
#include "cuda/sm90/fp8_tile.cuh" /* the library's FP8 chunk and promotion, and the wgmma wrappers */
#include "try.h"

#include <algorithm>
#include <stdint.h>
#include <stdio.h>
#include <vector>

enum Variant { BF16_N256, E4M3_N256, E4M3_N128X2, E4M3_LIB, E4M3_LIB_SYNC, E4M3_LIB_1WG, E4M3_AREG, NUM_VARIANTS };
static const char *const NAMES[NUM_VARIANTS] = {"bf16/n256", "e4m3/n256", "e4m3/n128x2",
                                                "e4m3/lib",  "e4m3/lib-sync", "e4m3/lib-1wg",
                                                "e4m3/areg"};
static const bool IS_E4M3[NUM_VARIANTS] = {false, true, true, true, true, true, true};

constexpr int THREADS = 256;
constexpr int A_BYTES = 128 * 128, B_BYTES = 256 * 128, SMEM_BYTES = A_BYTES + B_BYTES + 1024;

/* D[64 x 256] (+)= A[64 x 32] · B[32 x 256], E4M3 from shared memory, both K-major. */
static __device__ __forceinline__ void wgmma_e4m3_n256(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " MOK_WGMMA_D128 ", %128, %129, p, 1, 1;\n}\n"
                 : MOK_WGMMA_ACC128(d)
                 : "l"(da), "l"(db), "r"(scale_d)
                 : "memory");
}

template <int V>
__global__ void __launch_bounds__(THREADS, 1) rate_kernel(int stages, long long *cycles, float *sink) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    /* Finite codes: E4M3 bytes with the exponent field below 15 (no NaN), bf16 pairs of small
       values; the same bytes serve both (read as bf16 they are finite too). */
    for (int i = threadIdx.x; i < (A_BYTES + B_BYTES) / 4; i += THREADS) {
        uint32_t h = (uint32_t)i * 2654435761u ^ blockIdx.x;
        h ^= h >> 13;
        ((uint32_t *)smem)[i] = (h & 0x37373737u);
    }
    fence_proxy_async();
    __syncthreads();
    const int consumer = threadIdx.x >> 7;
    if (V == E4M3_LIB_1WG && consumer == 1) return;
    const uint32_t base = smem_addr(smem), a = base + consumer * (A_BYTES / 2), b = base + A_BYTES;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    const float lo = 1.0f + threadIdx.x * 1e-7f, hi = 1.0f - threadIdx.x * 1e-7f, sb = 1.0f - blockIdx.x * 1e-9f;
    const long long t0 = clock64();
    for (int s = 0; s < stages; ++s) {
        if constexpr (V == BF16_N256) {
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k)
                wgmma_m64n256k16<0, 0>(acc, smem_desc(a + 32 * k, 16), smem_desc(b + 32 * k, 16), 1);
            wgmma_commit();
            wgmma_wait<1>();
            pin_acc(acc);
        } else if constexpr (V == E4M3_N256) {
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k) wgmma_e4m3_n256(acc, smem_desc(a + 32 * k, 16), smem_desc(b + 32 * k, 16), 1);
            wgmma_commit();
            wgmma_wait<1>();
            pin_acc(acc);
        } else if constexpr (V == E4M3_N128X2) {
            float(&lo_acc)[64] = *reinterpret_cast<float(*)[64]>(acc);
            float(&hi_acc)[64] = *reinterpret_cast<float(*)[64]>(acc + 64);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k)
                wgmma_e4m3_n128(lo_acc, smem_desc(a + 32 * k, 16), smem_desc(b + 32 * k, 16), 1);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                wgmma_e4m3_n128(hi_acc, smem_desc(a + 32 * k, 16), smem_desc(b + B_BYTES / 2 + 32 * k, 16), 1);
            wgmma_commit();
            wgmma_wait<1>();
            pin_acc(acc);
        } else if constexpr (V == E4M3_AREG) {
            uint32_t ra[4][4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const uint32_t at = a + ((threadIdx.x & 127) * 16 + k * 2048) % (A_BYTES / 2);
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(ra[k][0]), "=r"(ra[k][1]), "=r"(ra[k][2]), "=r"(ra[k][3])
                             : "r"(at)
                             : "memory");
            }
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float part[64];
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    wgmma_e4m3_n128_ra(part, ra[k], smem_desc(b + c * (B_BYTES / 2) + 32 * k, 16), k);
                wgmma_commit();
                wgmma_wait<0>();
                pin_partial(part);
                if (c == 0) fp8_promote<0>(acc, part, lo, hi, sb); else fp8_promote<1>(acc, part, lo, hi, sb);
            }
        } else {
            if constexpr (V == E4M3_LIB_SYNC) asm volatile("bar.sync 1, 256;" ::: "memory");
            float part[64];
            fp8_chunk(part, a, b);
            fp8_promote<0>(acc, part, lo, hi, sb);
            fp8_chunk(part, a, b + B_BYTES / 2);
            fp8_promote<1>(acc, part, lo, hi, sb);
        }
    }
    wgmma_wait<0>();
    pin_acc(acc);
    const long long t1 = clock64();
    if ((threadIdx.x & 127) == 0) cycles[blockIdx.x * 2 + consumer] = t1 - t0;
    float x = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; ++i) x += acc[i];
    if (x == 1.2345e-30f) sink[threadIdx.x] = x;
}

template <int V>
static void run(int num_sms, int stages) {
    auto kernel = rate_kernel<V>;
    TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    long long *d_cycles;
    float *sink;
    TRY(cudaMalloc(&d_cycles, sizeof(long long) * num_sms * 2));
    TRY(cudaMalloc(&sink, sizeof(float) * THREADS));
    TRY(cudaMemset(d_cycles, 0, sizeof(long long) * num_sms * 2));
    cudaEvent_t e0, e1;
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    for (int w = 0; w < 3; ++w) kernel<<<num_sms, THREADS, SMEM_BYTES>>>(stages, d_cycles, sink);
    TRY(cudaGetLastError());
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
        TRY(cudaEventRecord(e0));
        kernel<<<num_sms, THREADS, SMEM_BYTES>>>(stages, d_cycles, sink);
        TRY(cudaEventRecord(e1));
        TRY(cudaEventSynchronize(e1));
        float t;
        TRY(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
    }
    std::vector<long long> cyc(num_sms * 2);
    TRY(cudaMemcpy(cyc.data(), d_cycles, sizeof(long long) * cyc.size(), cudaMemcpyDeviceToHost));
    std::vector<long long> per_cta;
    for (int i = 0; i < num_sms; ++i) per_cta.push_back(std::max(cyc[2 * i], cyc[2 * i + 1]));
    std::sort(per_cta.begin(), per_cta.end());
    std::sort(ms.begin(), ms.end());
    const double cyc_per_stage = (double)per_cta[num_sms / 2] / stages;
    const int wgs = V == E4M3_LIB_1WG ? 1 : 2;
    /* FLOPs of one stage: rows 64 per warpgroup, N 256, K 64 (bf16) or 128 (E4M3). */
    const double flop_stage = 2.0 * 64 * wgs * 256 * (IS_E4M3[V] ? 128 : 64);
    const double peak = IS_E4M3[V] ? 8192.0 : 4096.0;
    const double tflops = flop_stage * stages * num_sms / (ms[ms.size() / 2] * 1e-3) / 1e12;
    printf("%-14s %9.1f cycles/stage  %6.0f FLOP/cycle/SM  %5.1f%% of peak  %7.1f TFLOP/s  (%.0f MHz implied)\n",
           NAMES[V], cyc_per_stage, flop_stage / cyc_per_stage, 100.0 * flop_stage / cyc_per_stage / peak, tflops,
           (double)per_cta[num_sms / 2] / (ms[ms.size() / 2] * 1e3));
    TRY(cudaFree(d_cycles));
    TRY(cudaFree(sink));
}

int main() {
    cudaDeviceProp prop;
    TRY(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        fprintf(stderr, "%s is sm_%d%d; this program is built for sm_90a only\n", prop.name, prop.major, prop.minor);
        return 1;
    }
    const int stages = 20000;
    printf("device %s, %d SMs, %d stages per CTA, one CTA per SM\n", prop.name, prop.multiProcessorCount, stages);
    run<BF16_N256>(prop.multiProcessorCount, stages);
    run<E4M3_N256>(prop.multiProcessorCount, stages);
    run<E4M3_N128X2>(prop.multiProcessorCount, stages);
    run<E4M3_LIB>(prop.multiProcessorCount, stages);
    run<E4M3_LIB_SYNC>(prop.multiProcessorCount, stages);
    run<E4M3_LIB_1WG>(prop.multiProcessorCount, stages);
    run<E4M3_AREG>(prop.multiProcessorCount, stages);
    printf("one SM alone:\n");
    run<BF16_N256>(1, stages);
    run<E4M3_N256>(1, stages);
    run<E4M3_LIB>(1, stages);
    return 0;
}
