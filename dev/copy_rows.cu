/* copy_rows.cu — experiment: how fast one SM moves scattered rows (the comm tasks' work:
 * dispatch, combine, pull, push), by method, for 4 KB and 14 KB rows (Qwen3's and DeepSeek-V3's
 * hidden sizes in bf16).
 *
 * Each of `ctas` CTAs (384 threads, as in the megakernel) runs `tasks` tasks of 128 rows: the
 * rows come from random places of a large source and go to consecutive destination rows, as a
 * dispatch does. Methods:
 *   warp4     each warp copies a row, 4 x 16 bytes per lane in flight (as the library's copy_row)
 *   warp8, warp16  the same with 8 and 16 x 16 bytes per lane in flight
 *   slots     one thread bulk-loads rows into private slots of 11 storing warps, which store them
 *             with 16-byte stores (src/cuda/megakernel/comm_walk.cuh), fence.proxy.async once per task
 *   slots-nf  the same without the proxy fence
 *   bulk      one thread bulk-loads rows into a ring of slots and bulk-stores them out again
 * It checks every copied byte, then prints GB/s per CTA (bytes copied once) and the time per task.
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a dev/copy_rows.cu -o build/copy_rows \
 *       && ./build/copy_rows [ctas=8] [tasks=64]
 * Ends with `N passed, N failed`; exit code 0 only if every copy was exact. */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define THREADS 384
#define WARPS (THREADS / 32)
#define CONSUMERS (WARPS - 1)
#define ROWS 128
#define SMEM (200 * 1024)
#define MAX_PER_WARP 8
#define SLOTS_OFF 8192

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                            \
        }                                                                                       \
    } while (0)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

struct job {
    const int4 *src;
    int4 *dst;
    const int *rows; /* [ctas][tasks][ROWS] source row of each destination row */
    int tasks, n16;
    uint32_t row_bytes;
};

/* One warp, a row: N 16-byte loads per lane in flight (predicated at the row's end), then N stores. */
template <int N>
__device__ void warp_copy(int4 *d, const int4 *s, int n16) {
    const int lane = threadIdx.x & 31;
    for (int c0 = 0; c0 < n16; c0 += 32 * N) {
        int4 v[N];
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (c0 + 32 * i + lane < n16) v[i] = s[c0 + 32 * i + lane];
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (c0 + 32 * i + lane < n16) d[c0 + 32 * i + lane] = v[i];
    }
}

template <int N>
__global__ void __launch_bounds__(THREADS, 1) k_warp(job j) {
    for (int t = 0; t < j.tasks; ++t) {
        const int *rows = j.rows + ((long long)blockIdx.x * j.tasks + t) * ROWS;
        int4 *dst = j.dst + ((long long)blockIdx.x * j.tasks + t) * ROWS * j.n16;
        for (int r = threadIdx.x >> 5; r < ROWS; r += WARPS)
            warp_copy<N>(dst + (long long)r * j.n16, j.src + (long long)rows[r] * j.n16, j.n16);
        __syncthreads();
    }
}

template <bool FENCE>
__global__ void __launch_bounds__(THREADS, 1) k_slots(job j) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t *base = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const int4 **src_tab = (const int4 **)base;
    int4 **dst_tab = (int4 **)(base + ROWS * 8);
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(base + 4096);
    const uint32_t empty = full + 8 * CONSUMERS * MAX_PER_WARP;
    uint8_t *slot = base + SLOTS_OFF;
    const uint32_t slot_s = (uint32_t)__cvta_generic_to_shared(slot);
    const uint32_t slot_bytes = (j.row_bytes + 127) / 128 * 128;
    int per = (int)((SMEM - 1024 - SLOTS_OFF) / (slot_bytes * CONSUMERS));
    if (per > MAX_PER_WARP) per = MAX_PER_WARP;
    if (threadIdx.x == 0) {
        for (int s = 0; s < CONSUMERS * MAX_PER_WARP; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    long long seq = 0;
    for (int t = 0; t < j.tasks; ++t) {
        const int *rows = j.rows + ((long long)blockIdx.x * j.tasks + t) * ROWS;
        int4 *dst = j.dst + ((long long)blockIdx.x * j.tasks + t) * ROWS * j.n16;
        for (int r = threadIdx.x; r < ROWS; r += THREADS) {
            src_tab[r] = j.src + (long long)rows[r] * j.n16;
            dst_tab[r] = dst + (long long)r * j.n16;
        }
        __syncthreads();
        if (warp == 0) {
            if (lane == 0) {
                if (FENCE) asm volatile("fence.proxy.async.global;" ::: "memory");
                for (int i = 0; i < ROWS; ++i) {
                    const long long g = seq + i, m = g / CONSUMERS;
                    const int s = (int)(g % CONSUMERS) * per + (int)(m % per);
                    const uint32_t u = (uint32_t)(m / per);
                    mbar_wait(empty + 8 * s, (u & 1) ^ 1);
                    mbar_expect(full + 8 * s, j.row_bytes);
                    bulk_load(slot_s + s * slot_bytes, src_tab[i], j.row_bytes, full + 8 * s);
                }
            }
        } else {
            const int c = warp - 1;
            for (long long i = ((c - seq) % CONSUMERS + CONSUMERS) % CONSUMERS; i < ROWS; i += CONSUMERS) {
                const long long m = (seq + i) / CONSUMERS;
                const int s = c * per + (int)(m % per);
                mbar_wait(full + 8 * s, (uint32_t)(m / per) & 1);
                const int4 *from = (const int4 *)(slot + s * slot_bytes);
                int4 *to = dst_tab[i];
                for (int k = lane; k < j.n16; k += 32) to[k] = from[k];
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + 8 * s);
            }
        }
        seq += ROWS;
        __syncthreads();
    }
}

/* One thread: bulk loads into a ring of slots, bulk stores out of it. */
__global__ void __launch_bounds__(THREADS, 1) k_bulk(job j) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t *base = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(base);
    const uint32_t slot_s = (uint32_t)__cvta_generic_to_shared(base + 1024);
    const uint32_t slot_bytes = (j.row_bytes + 127) / 128 * 128;
    int S = (int)((SMEM - 2048) / slot_bytes);
    if (S > 64) S = 64;
    const int lag = S >= 16 ? 8 : S >= 4 ? 2 : 0, ahead = S - lag; /* stores left in flight */
    if (threadIdx.x != 0) return;
    for (int s = 0; s < S; ++s) mbar_init(full + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    long long seq = 0;
    for (int t = 0; t < j.tasks; ++t) {
        const int *rows = j.rows + ((long long)blockIdx.x * j.tasks + t) * ROWS;
        int4 *dst = j.dst + ((long long)blockIdx.x * j.tasks + t) * ROWS * j.n16;
        int issued = 0;
        auto issue = [&](int i) {
            const long long g = seq + i;
            const int s = (int)(g % S);
            mbar_expect(full + 8 * s, j.row_bytes);
            bulk_load(slot_s + s * slot_bytes, j.src + (long long)rows[i] * j.n16, j.row_bytes, full + 8 * s);
        };
        for (; issued < ROWS && issued < ahead; ++issued) issue(issued);
        for (int i = 0; i < ROWS; ++i) {
            const long long g = seq + i;
            const int s = (int)(g % S);
            mbar_wait(full + 8 * s, (uint32_t)(g / S) & 1);
            bulk_store(dst + (long long)i * j.n16, slot_s + s * slot_bytes, j.row_bytes);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            if (issued < ROWS) {
                /* the slot of row `issued` last held row issued - S = i - lag: lag stores after it */
                if (lag == 8) asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
                else if (lag == 2) asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory");
                else asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                issue(issued++);
            }
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        seq += ROWS;
    }
}

int main(int argc, char **argv) {
    const int ctas = argc > 1 ? atoi(argv[1]) : 8, tasks = argc > 2 ? atoi(argv[2]) : 64;
    CK(cudaFuncSetAttribute(k_slots<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    CK(cudaFuncSetAttribute(k_slots<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    const long long src_rows = 65536;
    int passed = 0, failed = 0;
    printf("%d CTAs x %d tasks x %d rows\n", ctas, tasks, ROWS);
    for (int hidden : {2048, 7168}) {
        const uint32_t row_bytes = hidden * 2;
        const int n16 = (int)(row_bytes / 16);
        const long long nrows = (long long)ctas * tasks * ROWS;
        std::vector<int> rows(nrows);
        srand(1234);
        for (auto &r : rows) r = rand() % src_rows;
        std::vector<uint32_t> h_src(src_rows * row_bytes / 4);
        for (size_t i = 0; i < h_src.size(); ++i) h_src[i] = (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u;
        int4 *src, *dst;
        int *d_rows;
        CK(cudaMalloc(&src, src_rows * row_bytes));
        CK(cudaMalloc(&dst, nrows * row_bytes));
        CK(cudaMalloc(&d_rows, nrows * 4));
        CK(cudaMemcpy(src, h_src.data(), src_rows * row_bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_rows, rows.data(), nrows * 4, cudaMemcpyHostToDevice));
        job j{src, dst, d_rows, tasks, n16, row_bytes};
        const char *names[] = {"warp4", "warp16", "slots", "slots-nf", "bulk", "warp8"};
        for (int m = 0; m < 6; ++m) {
            auto launch = [&]() {
                switch (m) {
                case 0: k_warp<4><<<ctas, THREADS>>>(j); break;
                case 1: k_warp<16><<<ctas, THREADS>>>(j); break;
                case 2: k_slots<true><<<ctas, THREADS, SMEM>>>(j); break;
                case 3: k_slots<false><<<ctas, THREADS, SMEM>>>(j); break;
                case 4: k_bulk<<<ctas, THREADS, SMEM>>>(j); break;
                case 5: k_warp<8><<<ctas, THREADS>>>(j); break;
                }
            };
            CK(cudaMemset(dst, 0, nrows * row_bytes));
            launch();
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<uint32_t> h_dst(nrows * row_bytes / 4);
            CK(cudaMemcpy(h_dst.data(), dst, nrows * row_bytes, cudaMemcpyDeviceToHost));
            long long bad = 0;
            for (long long r = 0; r < nrows; ++r)
                bad += memcmp(&h_dst[r * row_bytes / 4], &h_src[(long long)rows[r] * row_bytes / 4], row_bytes) != 0;
            cudaEvent_t a, b;
            cudaEventCreate(&a);
            cudaEventCreate(&b);
            std::vector<float> ms;
            for (int rep = 0; rep < 7; ++rep) {
                cudaEventRecord(a);
                launch();
                cudaEventRecord(b);
                cudaEventSynchronize(b);
                float t;
                cudaEventElapsedTime(&t, a, b);
                ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            const float med = ms[ms.size() / 2];
            const double gbs = (double)nrows * row_bytes / (med * 1e-3) / 1e9 / ctas;
            printf("H %5d %-9s %s  %7.1f GB/s per CTA  %7.2f us per task (128 rows)\n", hidden, names[m],
                   bad ? "WRONG" : "exact", gbs, med * 1e3 / tasks);
            bad ? ++failed : ++passed;
        }
        cudaFree(src);
        cudaFree(dst);
        cudaFree(d_rows);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
