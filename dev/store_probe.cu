/* store_probe.cu — experiment: how fast one SM stores a 64 KB bf16 tile to global memory.
 *
 * The question (docs/log.md): the epilogues of the megakernels that store a tile from registers
 * (down, dx, weight gradients; the SwiGLU backward, 192 KB per 256-column tile) move their bytes
 * far slower than an SM's bandwidth share. Is that what an SM's stores can do while the others
 * store too, or is it the epilogues' code?
 *
 * Each CTA (8 warps, as many as the consumers) writes TILES tiles of 128 x 256 bf16 into its own
 * region, one tile after another, in one of four ways:
 *   frag  4 bytes per lane in the accumulator fragment's pattern: a warp's store covers 8 rows x
 *         16 bytes (the library's stores before megakernel/row_stores.cuh staged them);
 *   rows  4 bytes per lane, a warp's store one row's 128 contiguous bytes (the SwiGLU-backward
 *         row loop);
 *   vec16 16 bytes per lane, a warp's store 512 contiguous bytes (store_staged's copy-out);
 *   bulk  the tile staged in shared memory, then one bulk copy per row block
 *         (cp.async.bulk.global.shared::cta, 8 KB each), waited for at the tile's end.
 * with 1 CTA alone and with one CTA per SM, and times it with %globaltimer (the kernel's span
 * over all CTAs) to give GB/s per SM and in all. The values written are a function of the
 * position, and the host checks a sample of every region afterwards.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a dev/store_probe.cu \
 *        -o build/store_probe && ./build/store_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "try.h"

#define WARPS 8
#define THREADS (32 * WARPS)
#define ROWS 128
#define COLS 256
#define TILE_BYTES (ROWS * COLS * 2)
#define TILES 64

enum { FRAG, ROWS4, VEC16, BULK, NUM_WAYS };
static const char *way_name[NUM_WAYS] = {"frag", "rows", "vec16", "bulk"};

/* The bf16 pair stored at (tile, row, col..col+1) of a CTA's region: any function of the
 * position that the host can recompute. */
__host__ __device__ static inline uint32_t value(int cta, int tile, int row, int col) {
    return (uint32_t)(cta * 7919 + tile * 131 + row * 257 + col) * 2654435761u;
}

__device__ static inline long long globaltimer() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <int WAY>
__global__ void __launch_bounds__(THREADS, 1) store_tiles(uint16_t *out, long long *span) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, cta = blockIdx.x;
    uint16_t *region = out + (size_t)cta * TILES * ROWS * COLS;
    __syncthreads();
    const long long t0 = globaltimer();
    for (int tile = 0; tile < TILES; ++tile) {
        uint16_t *o = region + (size_t)tile * ROWS * COLS;
        if (WAY == FRAG) { /* rows 16 warp + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) */
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp * 16 + (lane >> 2) + 8 * half;
#pragma unroll
                for (int j = 0; j < COLS / 8; ++j) {
                    const int c = 8 * j + 2 * (lane & 3);
                    *(uint32_t *)(o + r * COLS + c) = value(cta, tile, r, c);
                }
            }
        } else if (WAY == ROWS4) { /* a warp per row, 64 columns (128 bytes) per store */
            for (int r = warp; r < ROWS; r += WARPS)
#pragma unroll
                for (int c0 = 0; c0 < COLS; c0 += 64) {
                    const int c = c0 + 2 * lane;
                    *(uint32_t *)(o + r * COLS + c) = value(cta, tile, r, c);
                }
        } else if (WAY == VEC16) { /* 16 bytes per lane, rows of 512 bytes in order */
            for (int i = t; i < ROWS * COLS / 8; i += THREADS) {
                const int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
                *(int4 *)(o + r * COLS + c) = make_int4((int)value(cta, tile, r, c), (int)value(cta, tile, r, c + 2),
                                                        (int)value(cta, tile, r, c + 4), (int)value(cta, tile, r, c + 6));
            }
        } else { /* BULK: stage the tile, then 8 KB bulk copies issued by thread 0 */
            if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            __syncthreads();
            for (int i = t; i < ROWS * COLS / 8; i += THREADS) {
                const int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
                *(int4 *)(smem + (r * COLS + c) * 2) = make_int4((int)value(cta, tile, r, c), (int)value(cta, tile, r, c + 2),
                                                                 (int)value(cta, tile, r, c + 4), (int)value(cta, tile, r, c + 6));
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
            if (t == 0) {
                for (int b = 0; b < TILE_BYTES / 8192; ++b)
                    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 8192;" ::"l"(
                                     (uint8_t *)o + b * 8192),
                                 "r"((uint32_t)__cvta_generic_to_shared(smem + b * 8192))
                                 : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
        }
    }
    if (WAY == BULK && t == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    __syncthreads();
    __threadfence();
    const long long t1 = globaltimer();
    if (t == 0) {
        atomicMin((unsigned long long *)&span[0], (unsigned long long)t0);
        atomicMax((unsigned long long *)&span[1], (unsigned long long)t1);
    }
}

static int passed, failed;

template <int WAY>
static void run(int ctas, uint16_t *out, uint16_t *host) {
    long long *span, init[2] = {0x7fffffffffffffffll, 0};
    TRY(cudaMalloc(&span, sizeof init));
    const size_t bytes = (size_t)ctas * TILES * TILE_BYTES;
    TRY(cudaFuncSetAttribute(store_tiles<WAY>, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE_BYTES));
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) { /* the first is a warm-up; the best of the rest */
        TRY(cudaMemset(out, 0, bytes));
        TRY(cudaMemcpy(span, init, sizeof init, cudaMemcpyHostToDevice));
        store_tiles<WAY><<<ctas, THREADS, WAY == BULK ? TILE_BYTES : 0>>>(out, span);
        TRY(cudaGetLastError());
        TRY(cudaDeviceSynchronize());
        long long s[2];
        TRY(cudaMemcpy(s, span, sizeof s, cudaMemcpyDeviceToHost));
        if (rep > 0 && (double)(s[1] - s[0]) < best) best = (double)(s[1] - s[0]);
    }
    /* a sample of every CTA's region: the first and last tile, a spread of rows, every column */
    int bad = 0;
    for (int cta = 0; cta < ctas; ++cta)
        for (int tile = 0; tile < TILES; tile += TILES - 1) {
            uint16_t *o = out + ((size_t)cta * TILES + tile) * ROWS * COLS;
            TRY(cudaMemcpy(host, o, TILE_BYTES, cudaMemcpyDeviceToHost));
            for (int r = cta % 5; r < ROWS; r += 37)
                for (int c = 0; c < COLS; c += 2)
                    if (*(uint32_t *)(host + r * COLS + c) != value(cta, tile, r, c)) ++bad;
        }
    const double per_cta = (double)TILES * TILE_BYTES / best; /* bytes per ns = GB/s */
    printf("%-6s %3d CTA%s  %8.1f us  %7.1f GB/s per SM  %8.1f GB/s in all  %6.2f us per 64 KB tile  %s\n",
           way_name[WAY], ctas, ctas > 1 ? "s" : " ", best / 1e3, per_cta, per_cta * ctas, best / 1e3 / TILES,
           bad ? "FAIL (values)" : "ok");
    bad ? ++failed : ++passed;
    TRY(cudaFree(span));
}

int main(void) {
    int sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint16_t *out, *host = (uint16_t *)malloc(TILE_BYTES);
    TRY(cudaMalloc(&out, (size_t)sms * TILES * TILE_BYTES));
    printf("store probe: %d tiles of %d x %d bf16 (64 KB) per CTA, %d warps\n", TILES, ROWS, COLS, WARPS);
    for (int ctas = 1; ctas <= sms; ctas = ctas == 1 ? sms : sms + 1) {
        run<FRAG>(ctas, out, host);
        run<ROWS4>(ctas, out, host);
        run<VEC16>(ctas, out, host);
        run<BULK>(ctas, out, host);
    }
    printf("%d passed, %d failed\n", passed, failed);
    free(host);
    TRY(cudaFree(out));
    return failed ? 1 : 0;
}
