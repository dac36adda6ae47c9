/* transpose_quant_probe.cu — what would it cost to make an FP8 weight gradient's operands?
 *
 * An FP8 weight gradient (dW = sum over an expert's rows of a ⊗ b) needs both operands K-major, K
 * being the rows, and quantized along the rows: for a [R, C] row-major bf16 operand (x^ widened,
 * dg|du, bf16(w · dy), h^), codes [C, R] with one power-of-two scale per column per 128 rows
 * (core/fp8.h's rules: mok__fp8_amax, mok__fp8_scale_exp, mok__fp8_quantize). This times that
 * transposing quantization as a kernel of its own (a CTA per 128 x 128 block: the block through
 * shared memory, a column's maximum over its 128 rows, the codes stored as rows of the transpose),
 * beside a plain bf16 copy of the same rows (what the backward's pull writes for the bf16 weight
 * gradients), on the operands of the benchmark's layers (16384 rows). It prints each one's
 * time, GB/s and SM-µs per 128-row tile (the cost a task per row tile would carry).
 *
 * Checked first, bit for bit against a host replay of the rules: codes and scales of a small
 * operand and of the first layer's x, with values spread over wide ranges per block, zero
 * columns, NaN and ±Inf (which the maximum skips and which become the NaN code).
 *
 * Build and run from the repository root (sm_90a here):
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a \
 *        dev/transpose_quant_probe.cu -o build/transpose_quant_probe && ./build/transpose_quant_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "try.h"

#include "cuda/fp8_rows.cuh"

#define BLOCK 128
#define TILE_LD 136 /* bf16 elements a row of the shared tile: 272 bytes, 16-byte aligned, padded */

/* Block (blockIdx.x: 128 columns, blockIdx.y: 128 rows) of x [R, C] into xt [C, R] codes and
 * scales [C, R / 128]. */
__global__ void __launch_bounds__(256) transpose_quantize(const uint16_t *__restrict__ x, long long R, long long C,
                                                         uint8_t *__restrict__ xt, float *__restrict__ scales) {
    __shared__ __align__(16) uint16_t tile[BLOCK * TILE_LD];
    __shared__ float part[2][BLOCK];
    __shared__ float inverse[BLOCK];
    const int t = threadIdx.x;
    const long long r0 = (long long)blockIdx.y * BLOCK, c0 = (long long)blockIdx.x * BLOCK;
    /* 128 rows x 256 bytes: 16 chunks of 16 bytes a row, 8 a thread */
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int chunk = t + 256 * i, r = chunk / 16, k = chunk % 16;
        *(uint4 *)(tile + r * TILE_LD + 8 * k) = *(const uint4 *)(x + (r0 + r) * C + c0 + 8 * k);
    }
    __syncthreads();
    { /* column t % 128's maximum over rows 64 (t / 128) .. + 64 */
        const int c = t % BLOCK, h = t / BLOCK;
        float amax = 0.0f;
        for (int r = 64 * h; r < 64 * h + 64; ++r) amax = mok__fp8_amax(amax, mok__bf16_to_f32(tile[r * TILE_LD + c]));
        part[h][c] = amax;
    }
    __syncthreads();
    if (t < BLOCK) {
        const int e = mok__fp8_scale_exp(fmaxf(part[0][t], part[1][t]));
        inverse[t] = mok__fp8_pow2(-e);
        scales[(c0 + t) * (R / BLOCK) + blockIdx.y] = mok__fp8_pow2(e);
    }
    __syncthreads();
    { /* the transpose's row c = t / 2, its codes of rows 64 (t % 2) .. + 64: four 16-byte stores */
        const int c = t / 2, h = t % 2;
        const float inv = inverse[c];
        uint8_t *out = xt + (c0 + c) * R + r0 + 64 * h;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = 64 * h + 16 * q + 4 * j;
                const uint32_t lo = e4m3x2_from_f32(mok__bf16_to_f32(tile[r * TILE_LD + c]) * inv,
                                                    mok__bf16_to_f32(tile[(r + 1) * TILE_LD + c]) * inv);
                const uint32_t hi = e4m3x2_from_f32(mok__bf16_to_f32(tile[(r + 2) * TILE_LD + c]) * inv,
                                                    mok__bf16_to_f32(tile[(r + 3) * TILE_LD + c]) * inv);
                w[j] = lo | (hi << 16);
            }
            *(uint4 *)(out + 16 * q) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

/* The same rows copied as they are (16-byte chunks, grid-stride). */
__global__ void __launch_bounds__(256) copy_rows(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

/* Values spread over wide ranges: each (128-row block, column) its own exponent in [-40, 12],
 * each value within 2^-6 of it; a column in 37 all zeros; every 4099th value NaN, +Inf or -Inf. */
static std::vector<uint16_t> make_operand(long long R, long long C, uint64_t seed) {
    std::vector<uint16_t> x((size_t)(R * C));
    uint64_t s = seed;
    auto next = [&s] {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (uint32_t)(s >> 33);
    };
    for (long long r = 0; r < R; ++r)
        for (long long c = 0; c < C; ++c) {
            const size_t i = (size_t)(r * C + c);
            const uint64_t h = ((uint64_t)(r / BLOCK) * 1000003u + (uint64_t)c) * 0x9e3779b97f4a7c15ull ^ seed;
            const int e = (int)((h >> 40) % 53) - 40;
            float v = ldexpf(1.0f + (float)(next() % 1024) / 1024.0f, e - (int)(next() % 7));
            if (next() & 1) v = -v;
            if (c % 37 == 5) v = 0.0f;
            if (i % 4099 == 17) v = (i / 4099) % 3 == 0 ? NAN : ((i / 4099) % 3 == 1 ? INFINITY : -INFINITY);
            x[i] = mok__bf16_from_f32(v);
        }
    return x;
}

/* Whether the device's codes and scales are the rules' for every element; prints the first miss. */
static bool check(const char *what, const std::vector<uint16_t> &x, long long R, long long C,
                  const std::vector<uint8_t> &xt, const std::vector<float> &sc) {
    long long bad = 0;
    for (long long c = 0; c < C; ++c)
        for (long long rb = 0; rb < R / BLOCK; ++rb) {
            float amax = 0.0f;
            for (long long r = rb * BLOCK; r < rb * BLOCK + BLOCK; ++r)
                amax = mok__fp8_amax(amax, mok__bf16_to_f32(x[(size_t)(r * C + c)]));
            const int e = mok__fp8_scale_exp(amax);
            const float scale = mok__fp8_pow2(e), inv = mok__fp8_pow2(-e);
            const float got_scale = sc[(size_t)(c * (R / BLOCK) + rb)];
            if (memcmp(&got_scale, &scale, 4) != 0 && bad++ == 0)
                printf("  %s: column %lld rows %lld..: scale %g, the rule's %g\n", what, c, rb * BLOCK, got_scale, scale);
            for (long long r = rb * BLOCK; r < rb * BLOCK + BLOCK; ++r) {
                const uint8_t want = mok__fp8_quantize(mok__bf16_to_f32(x[(size_t)(r * C + c)]), inv);
                const uint8_t got = xt[(size_t)(c * R + r)];
                if (got != want && bad++ == 0)
                    printf("  %s: row %lld column %lld: code 0x%02x, the rule's 0x%02x\n", what, r, c, got, want);
            }
        }
    printf("%s  %s: %lld of %lld codes and scales differ from the rules\n", bad ? "FAIL" : "PASS", what, bad,
           R * C + C * (R / BLOCK));
    return bad == 0;
}

struct Operand {
    const char *name;
    long long R, C;
};

/* The weight gradients' operands of the benchmark's layers, 16384 of an expert group's rows: x and
 * bf16(w · dy) [rows, H], dg|du [rows, 2I], h^ [rows, I]. */
static const Operand OPERANDS[] = {
    {"dsv3 x, w dy", 16384, 7168}, {"dsv3 dg|du", 16384, 4096}, {"dsv3 h", 16384, 2048},
    {"qwen3 x, w dy", 16384, 2048}, {"qwen3 dg|du", 16384, 1536}, {"qwen3 h", 16384, 768},
    {"mixtral x, w dy", 16384, 4096}, {"mixtral dg|du", 16384, 28672}, {"mixtral h", 16384, 14336},
};

template <class F>
static float median_ms(F launch) {
    cudaEvent_t a, b;
    TRY(cudaEventCreate(&a));
    TRY(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int i = 0; i < 23; ++i) {
        TRY(cudaEventRecord(a));
        launch();
        TRY(cudaEventRecord(b));
        TRY(cudaEventSynchronize(b));
        float m;
        TRY(cudaEventElapsedTime(&m, a, b));
        if (i >= 3) ms.push_back(m);
    }
    TRY(cudaEventDestroy(a));
    TRY(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

int main(void) {
    int passed = 0, failed = 0, sms = 0;
    TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    size_t most = 0;
    for (const Operand &o : OPERANDS) most = std::max(most, (size_t)(o.R * o.C));
    uint16_t *x, *copy;
    uint8_t *xt;
    float *sc;
    TRY(cudaMalloc(&x, most * 2));
    TRY(cudaMalloc(&copy, most * 2));
    TRY(cudaMalloc(&xt, most));
    TRY(cudaMalloc(&sc, most / BLOCK * 4));

    printf("checks (bit for bit against the rules of core/fp8.h)\n");
    const Operand checks[] = {{"small", 384, 256}, OPERANDS[0]};
    for (const Operand &o : checks) {
        const std::vector<uint16_t> h = make_operand(o.R, o.C, 0x5eed0000u + (uint64_t)o.C);
        TRY(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
        transpose_quantize<<<dim3((unsigned)(o.C / BLOCK), (unsigned)(o.R / BLOCK)), 256>>>(x, o.R, o.C, xt, sc);
        TRY(cudaGetLastError());
        std::vector<uint8_t> got((size_t)(o.R * o.C));
        std::vector<float> got_sc((size_t)(o.C * (o.R / BLOCK)));
        TRY(cudaMemcpy(got.data(), xt, got.size(), cudaMemcpyDeviceToHost));
        TRY(cudaMemcpy(got_sc.data(), sc, got_sc.size() * 4, cudaMemcpyDeviceToHost));
        (check(o.name, h, o.R, o.C, got, got_sc) ? passed : failed)++;
    }

    printf("\ntimings (median of 20 after 3, CUDA events; values spread as in the checks)\n");
    printf("%-16s %6s %6s | %9s %7s %11s | %9s %7s %11s\n", "operand", "R", "C", "tq ms", "GB/s", "SM-us/tile",
           "copy ms", "GB/s", "SM-us/tile");
    { /* one spread of values for every timing: each operand reads a prefix of it */
        long long widest = 0;
        for (const Operand &o : OPERANDS) widest = std::max(widest, o.C);
        const std::vector<uint16_t> h = make_operand((long long)(most / (size_t)widest), widest, 0x7a11u);
        TRY(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    for (const Operand &o : OPERANDS) {
        const size_t n = (size_t)(o.R * o.C);
        const float tq = median_ms([&] {
            transpose_quantize<<<dim3((unsigned)(o.C / BLOCK), (unsigned)(o.R / BLOCK)), 256>>>(x, o.R, o.C, xt, sc);
        });
        const float cp = median_ms([&] { copy_rows<<<(unsigned)(4 * sms), 256>>>((const uint4 *)x, (uint4 *)copy, n / 8); });
        TRY(cudaGetLastError());
        const double tiles = (double)(o.R / BLOCK);
        printf("%-16s %6lld %6lld | %9.3f %7.0f %11.2f | %9.3f %7.0f %11.2f\n", o.name, o.R, o.C, tq,
               (3.0 * n + 4.0 * n / BLOCK) / (tq * 1e6), tq * 1e3 * sms / tiles, cp, 4.0 * n / (cp * 1e6),
               cp * 1e3 * sms / tiles);
    }
    TRY(cudaFree(x));
    TRY(cudaFree(copy));
    TRY(cudaFree(xt));
    TRY(cudaFree(sc));
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
