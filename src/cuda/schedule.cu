/* schedule.cu — the schedule built on the device from every rank's topk_ids, with no host
 * synchronisation: stage this rank's ids and T into its symmetric region, cross-GPU barrier,
 * then count / prefix / place kernels that read all ranks' ids through peer pointers, and a
 * closing barrier (peers read this rank's ids until then). The result is bit-for-bit the
 * schedule that core/schedule.c builds sequentially (same row order, see schedule.h). */
#include <string.h>

#include "cuda_common.cuh"

#define PLACE_THREADS 1024

struct sched_params {
    char *const *peers;
    size_t off_tokens, off_ids;
    int rank, nranks, num_local_experts, topk;
    long long num_experts, max_tokens, max_rows;
    mok_sched_layout layout;
    void *schedule;
    int *error;
};

__global__ void sched_clear_kernel(sched_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_local_experts * p.nranks; i += gridDim.x * blockDim.x)
        v.counts[i] = 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) v.header->error = 0;
}

static __device__ long long peer_tokens(const sched_params &p, int peer) {
    return *(volatile const long long *)(p.peers[peer] + p.off_tokens);
}

__global__ void sched_count_kernel(sched_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    const int peer = blockIdx.y;
    const long long T = peer_tokens(p, peer);
    if (T < 0 || T > p.max_tokens) {
        if (threadIdx.x == 0 && blockIdx.x == 0) {
            atomicCAS(p.error, 0, MOK_KERR_TOKENS);
            v.header->error = MOK_SCHED_ERR_TOKENS;
        }
        return;
    }
    const int32_t *ids = (const int32_t *)(p.peers[peer] + p.off_ids);
    const long long first = (long long)p.rank * p.num_local_experts;
    for (long long s = blockIdx.x * (long long)blockDim.x + threadIdx.x; s < T * p.topk;
         s += (long long)gridDim.x * blockDim.x) {
        int e = ids[s];
        if (e < -1 || e >= p.num_experts) {
            atomicCAS(p.error, 0, MOK_KERR_EXPERT_ID);
            v.header->error = MOK_SCHED_ERR_EXPERT_ID;
            continue;
        }
        if (e >= first && e < first + p.num_local_experts)
            atomicAdd((unsigned long long *)&v.counts[(e - first) * p.nranks + peer], 1ull);
    }
}

/* One thread: segments, header. */
__global__ void sched_prefix_kernel(sched_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    mok_sched_header *h = v.header;
    h->magic = MOK_SCHED_MAGIC;
    h->nranks = p.nranks;
    h->rank = p.rank;
    h->num_local_experts = p.num_local_experts;
    h->topk = p.topk;
    h->max_rows = p.max_rows;
    for (int q = 0; q < MOK_MAX_RANKS; ++q) h->num_tokens[q] = q < p.nranks ? peer_tokens(p, q) : 0;
    long long row = 0, routed = 0, busiest = 0;
    for (int l = 0; l < p.num_local_experts; ++l) {
        long long n = 0;
        for (int q = 0; q < p.nranks; ++q) n += v.counts[l * p.nranks + q];
        v.expert_start[l] = row;
        v.expert_rows[l] = n;
        routed += n;
        busiest = n > busiest ? n : busiest;
        row += (n + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
    }
    v.expert_start[p.num_local_experts] = row;
    if (row > p.max_rows || h->error) {
        if (!h->error) h->error = MOK_SCHED_ERR_CAPACITY;
        atomicCAS(p.error, 0, MOK_KERR_SCHEDULE);
        row = routed = busiest = 0;
        for (int l = 0; l <= p.num_local_experts; ++l) v.expert_start[l] = 0;
        for (int l = 0; l < p.num_local_experts; ++l) v.expert_rows[l] = 0;
    }
    h->routed_rows = routed;
    h->padded_rows = row;
    h->max_expert_rows = busiest;
}

__global__ void sched_rows_kernel(sched_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    const long long padded = v.header->padded_rows;
    for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < padded; r += (long long)gridDim.x * blockDim.x) {
        v.row_peer[r] = -1;
        v.row_slot[r] = -1;
    }
    const long long T = peer_tokens(p, p.rank);
    const int32_t *ids = (const int32_t *)(p.peers[p.rank] + p.off_ids);
    for (long long s = blockIdx.x * (long long)blockDim.x + threadIdx.x; s < p.max_tokens * p.topk;
         s += (long long)gridDim.x * blockDim.x)
        v.own_ids[s] = (s < T * p.topk && v.header->error != MOK_SCHED_ERR_TOKENS) ? ids[s] : -1;
}

/* One block per source peer. The i-th row of peer p in expert l goes to
 * start[l] + sum_q min(c_q, i) + #{q < p : c_q > i} (round-robin across peers). i is the slot's
 * rank among peer p's slots to expert l: a running cursor per expert plus the slot's rank inside
 * its chunk, from warp match masks and per-warp counts. */
__global__ void __launch_bounds__(PLACE_THREADS) sched_place_kernel(sched_params p) {
    extern __shared__ int smem[];
    const int L = p.num_local_experts, nwarps = PLACE_THREADS / 32;
    int *warp_count = smem;              /* [nwarps][L] */
    int *cursor = smem + nwarps * L;     /* [L] */
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    if (v.header->error) return;
    const int peer = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long T = peer_tokens(p, peer);
    const int32_t *ids = (const int32_t *)(p.peers[peer] + p.off_ids);
    const long long first = (long long)p.rank * L;
    for (int i = threadIdx.x; i < nwarps * L + L; i += blockDim.x) smem[i] = 0;
    __syncthreads();
    for (long long base = 0; base < T * p.topk; base += PLACE_THREADS) {
        long long s = base + threadIdx.x;
        int l = -1;
        if (s < T * p.topk) {
            int e = ids[s];
            if (e >= first && e < first + L) l = (int)(e - first);
        }
        unsigned same = __match_any_sync(0xffffffffu, l);
        int lane_rank = __popc(same & ((1u << lane) - 1u));
        if (l >= 0 && lane_rank == 0) warp_count[warp * L + l] = __popc(same);
        __syncthreads();
        if (l >= 0) {
            long long i = cursor[l] + lane_rank;
            for (int w = 0; w < warp; ++w) i += warp_count[w * L + l];
            const int64_t *c = v.counts + (long long)l * p.nranks;
            long long pos = v.expert_start[l];
            for (int q = 0; q < p.nranks; ++q) pos += c[q] < i ? c[q] : i;
            for (int q = 0; q < peer; ++q) pos += c[q] > i ? 1 : 0;
            v.row_peer[pos] = peer;
            v.row_slot[pos] = (int32_t)s;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < L; e += blockDim.x) {
            int add = 0;
            for (int w = 0; w < nwarps; ++w) {
                add += warp_count[w * L + e];
                warp_count[w * L + e] = 0;
            }
            cursor[e] += add;
        }
        __syncthreads();
    }
}

extern "C" mok_status mok__cuda_schedule_build(mok_workspace *ws, const mok_schedule_args *args) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    const size_t place_smem = sizeof(int) * (size_t)(PLACE_THREADS / 32 + 1) * (size_t)ws->num_local_experts;
    if (place_smem > 227 * 1024) {
        return mok__fail(MOK_ERR_UNSUPPORTED, "shape: %lld local experts exceed the schedule kernel's shared memory",
                         (long long)ws->num_local_experts);
    }
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_schedule_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cudaSetDevice(R->device));
        CUDA_TRY(cudaFuncSetAttribute(sched_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)place_smem));
        if (a->num_tokens > 0)
            CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.ids, a->topk_ids, (size_t)(a->num_tokens * ws->shape.topk) * 4,
                                     cudaMemcpyDeviceToDevice, stream));
        st = mok__cuda_barrier(ws, lr, stream, a->num_tokens);
        if (st != MOK_OK) return st;
        sched_params p;
        p.peers = R->peers;
        p.off_tokens = cw->sym.tokens;
        p.off_ids = cw->sym.ids;
        p.rank = R->rank;
        p.nranks = ws->group->nranks;
        p.num_local_experts = (int)ws->num_local_experts;
        p.topk = (int)ws->shape.topk;
        p.num_experts = ws->shape.num_experts;
        p.max_tokens = ws->shape.max_tokens;
        p.max_rows = ws->sched_layout.max_rows;
        p.layout = ws->sched_layout;
        p.schedule = a->schedule;
        p.error = R->error_dev;
        int blocks = R->num_sms;
        LAUNCH_TRY(sched_clear_kernel<<<blocks, 256, 0, stream>>>(p));
        LAUNCH_TRY(sched_count_kernel<<<dim3(blocks, p.nranks), 256, 0, stream>>>(p));
        LAUNCH_TRY(sched_prefix_kernel<<<1, 1, 0, stream>>>(p));
        LAUNCH_TRY(sched_rows_kernel<<<blocks, 256, 0, stream>>>(p));
        LAUNCH_TRY(sched_place_kernel<<<p.nranks, PLACE_THREADS, place_smem, stream>>>(p));
        st = mok__cuda_barrier(ws, lr, stream, -1);
        if (st != MOK_OK) return st;
    }
    cudaSetDevice(previous);
    return MOK_OK;
}

extern "C" mok_status mok__cuda_schedule_read(mok_workspace *ws, const void *schedule, int lr, mok_sched_header *h) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    CUDA_TRY(cudaSetDevice(cw->ranks[lr].device));
    CUDA_TRY(cudaDeviceSynchronize());
    CUDA_TRY(cudaMemcpy(h, schedule, sizeof *h, cudaMemcpyDeviceToHost));
    cudaSetDevice(previous);
    return mok__cuda_check_error_word(ws);
}
