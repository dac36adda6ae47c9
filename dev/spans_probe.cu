/* spans_probe.cu — how long does the pass's span list take to build on the device, where one
 * thread builds it (launch.cu's spans_kernel) between the opening barrier and the megakernel?
 *
 * For the benchmark's one-GPU layers (forward and backward, the default ring and minibatch, the
 * tile widths the cuda tuning picks) and for uneven routings, it builds the spans with
 * mok__spans_build (core/tasks.inc) two ways, times each (median of 21 after 3, CUDA events), and
 * compares each list byte for byte with the host's build of the same plan:
 *   global: one thread, reading the schedule's expert arrays and writing the spans in global
 *           memory (launch.cu's spans_kernel);
 *   shared: the block copies the expert arrays into shared memory, one thread builds the spans
 *           there, the block copies them out (a list too long for shared memory: built again in
 *           global memory).
 *
 * Build and run from the repository root (sm_90a here; -I another tree's src to time its core):
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a \
 *        dev/spans_probe.cu -o build/spans_probe && ./build/spans_probe
 * It ends with `N passed, N failed`. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "try.h"

#include "cuda/core.cuh"

#define SPANS_CAP 65536
#define SMEM_BYTES (200 * 1024)

__global__ void build_kernel(mok_plan plan, mok_task_span *spans, long long *count) {
    *count = mok__spans_build(&plan, spans, SPANS_CAP);
}

/* as build_kernel, with the expert arrays and the spans in shared memory (smem_spans of them) */
__global__ void build_shared_kernel(mok_plan plan, mok_task_span *spans, long long *count, int smem_spans) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ long long n;
    const int E = plan.num_local_experts;
    int64_t *start = (int64_t *)smem, *rows = start + E + 1;
    mok_task_span *out = (mok_task_span *)(rows + E);
    for (int i = threadIdx.x; i <= E; i += blockDim.x) start[i] = plan.expert_start[i];
    for (int i = threadIdx.x; i < E; i += blockDim.x) rows[i] = plan.expert_rows[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        mok_plan p = plan;
        p.expert_start = start;
        p.expert_rows = rows;
        n = mok__spans_build(&p, out, smem_spans);
    }
    __syncthreads();
    if (n < 0) {
        if (threadIdx.x == 0) *count = mok__spans_build(&plan, spans, SPANS_CAP);
        return;
    }
    const uint32_t *src = (const uint32_t *)out;
    uint32_t *dst = (uint32_t *)spans;
    for (long long i = threadIdx.x; i < n * (long long)(sizeof(mok_task_span) / 4); i += blockDim.x) dst[i] = src[i];
    if (threadIdx.x == 0) *count = n;
}

struct layer {
    const char *name;
    long long hidden, inter, shared, experts, topk, tokens;
    int n_tile, n_tile_dh;
};

static unsigned long long rng = 88172645463325252ull;
static unsigned next_rand() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)(rng >> 11);
}

int main() {
    const layer layers[] = {{"qwen3-30b-a3b", 2048, 768, 0, 128, 8, 8192, 128, 128},
                            {"qwen3-30b-a3b", 2048, 768, 0, 128, 8, 16384, 128, 128},
                            {"deepseek-v3", 7168, 2048, 2048, 32, 8, 8192, 128, 256},
                            {"mixtral-8x7b", 4096, 14336, 0, 8, 2, 8192, 128, 256},
                            {"256 experts, k 8", 4096, 1024, 1024, 256, 8, 8192, 128, 128}};
    int passed = 0, failed = 0;
    mok_task_span *d_spans;
    long long *d_count;
    int64_t *d_experts;
    TRY(cudaMalloc(&d_spans, sizeof(mok_task_span) * SPANS_CAP));
    TRY(cudaMalloc(&d_count, sizeof(long long)));
    TRY(cudaMalloc(&d_experts, sizeof(int64_t) * 2 * 1024));
    std::vector<mok_task_span> host(SPANS_CAP), dev(SPANS_CAP);
    cudaEvent_t e0, e1;
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    TRY(cudaFuncSetAttribute(build_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    printf("%-18s %6s %6s %5s %6s | %8s %8s\n", "layer", "tokens", "route", "pass", "build", "spans", "us");
    for (const layer &L : layers)
        for (int uneven = 0; uneven < 2; ++uneven)
            for (int backward = 0; backward < 2; ++backward) {
                const int E = (int)L.experts;
                std::vector<int64_t> start(E + 1), rows(E);
                const long long routed = L.tokens * L.topk;
                long long left = routed, off = 0;
                for (int e = 0; e < E; ++e) { /* even: routed / E each; uneven: random shares, some empty */
                    long long n = uneven ? (e == E - 1 ? left : std::min(left, (long long)(next_rand() % (2 * routed / E + 1)))) : routed / E;
                    if (uneven && next_rand() % 8 == 0 && e != E - 1) n = 0;
                    left -= n;
                    start[e] = off;
                    rows[e] = n;
                    off += (n + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
                }
                start[E] = off;
                mok_plan p;
                memset(&p, 0, sizeof p);
                p.backward = backward;
                p.padded_rows = off;
                p.context_rows = off;
                p.num_tokens = L.tokens;
                p.hidden = L.hidden;
                p.intermediate = L.inter;
                p.shared_intermediate = L.shared;
                p.num_local_experts = E;
                p.minibatch_rows = 2048;
                p.ring_rows = 32768;
                p.n_tile = backward ? L.n_tile_dh : L.n_tile;
                p.n_tile_h = 256;
                p.wgrad_tile = 128;
                p.wgrad_tile_n = 256;
                p.raster = 16;
                p.nranks = 1;
                p.expert_start = start.data();
                p.expert_rows = rows.data();
                const long long nh = mok__spans_build(&p, host.data(), SPANS_CAP);
                TRY(cudaMemcpy(d_experts, start.data(), sizeof(int64_t) * (E + 1), cudaMemcpyHostToDevice));
                TRY(cudaMemcpy(d_experts + 1024, rows.data(), sizeof(int64_t) * E, cudaMemcpyHostToDevice));
                const int smem_spans = (int)((SMEM_BYTES - sizeof(int64_t) * (2 * E + 1)) / sizeof(mok_task_span));
                mok_plan dp = p;
                dp.expert_start = d_experts;
                dp.expert_rows = d_experts + 1024;
                for (int variant = 0; variant < 2; ++variant) {
                TRY(cudaMemset(d_spans, 0xff, sizeof(mok_task_span) * SPANS_CAP));
                std::vector<float> ms;
                for (int rep = 0; rep < 24; ++rep) {
                    TRY(cudaEventRecord(e0));
                    if (variant == 0) build_kernel<<<1, 1>>>(dp, d_spans, d_count);
                    else build_shared_kernel<<<1, 256, SMEM_BYTES>>>(dp, d_spans, d_count, smem_spans);
                    TRY(cudaEventRecord(e1));
                    TRY(cudaEventSynchronize(e1));
                    float t;
                    TRY(cudaEventElapsedTime(&t, e0, e1));
                    if (rep >= 3) ms.push_back(t);
                }
                TRY(cudaGetLastError());
                std::sort(ms.begin(), ms.end());
                long long nd = 0;
                TRY(cudaMemcpy(&nd, d_count, sizeof nd, cudaMemcpyDeviceToHost));
                bool same = nd == nh && nh >= 0 && nh <= SPANS_CAP;
                if (same) {
                    TRY(cudaMemcpy(dev.data(), d_spans, sizeof(mok_task_span) * nh, cudaMemcpyDeviceToHost));
                    same = memcmp(dev.data(), host.data(), sizeof(mok_task_span) * nh) == 0;
                }
                printf("%-18s %6lld %6s %5s %6s | %8lld %8.1f %s\n", L.name, L.tokens, uneven ? "uneven" : "even",
                       backward ? "bwd" : "fwd", variant ? "shared" : "global", nd, 1e3 * ms[ms.size() / 2],
                       same ? "" : "DIFFERS from the host's");
                if (same) ++passed;
                else ++failed;
                }
            }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
