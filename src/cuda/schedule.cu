/* schedule.cu — the schedule built on the device from every rank's topk_ids, with no host
 * synchronisation: stage this rank's ids and T into its symmetric region, cross-GPU barrier,
 * then count / scan / place kernels that read all ranks' ids through peer pointers, and a
 * closing barrier (peers read this rank's ids until then). The result is bit-for-bit the
 * schedule that core/schedule.inc builds sequentially (same row order, see schedule.h).
 *
 * The one idea: a slot's rank i among its peer's slots to local expert l (the i of schedule.h)
 * is the rows that peer sends l in the chunks before the slot's chunk, plus the slot's rank
 * inside its chunk. So count and place run one block per (chunk, peer) and only the scan
 * between them is one block:
 *   count  grid (chunks, P): a histogram of the chunk over the local experts, each slot's local
 *          expert, the chunk's id / T errors, and (the blocks of this rank) own_ids;
 *   scan   one block: histograms -> exclusive per-chunk bases and counts; segments, header (with
 *          the tag of the workspace and build, core/schedule.h);
 *   place  grid (chunks, P): rows of the chunk from its bases; padding rows of some experts.
 * The scratch they pass on (cuda_sched_scratch, per rank) is fully rewritten by every build. */
#include <string.h>

#include "cuda/backend.cuh"

#define COUNT_THREADS 512
#define COUNT_ITEMS 4        /* count: ids each thread has in flight per step */
#define SCAN_THREADS 1024
#define SCAN_MAX_SEGMENTS 32 /* scan: threads that share one (peer, expert) column of chunks */
#define SCAN_BATCH 8         /* scan: chunk counts each thread has in flight */
#define PLACE_THREADS 1024   /* place: slots ranked per step (one per thread) */
#define PLACE_BLOCKS_PER_SM 2 /* its __launch_bounds__ keep it at <= 32 registers, so two fit */
#define SCHED_MAX_SMEM (227 * 1024)

struct sched_params {
    char *const *peers;
    size_t off_tokens, off_ids;
    int rank, nranks, num_local_experts, topk;
    long long num_experts, max_tokens, max_rows;
    cuda_sched_scratch scratch;
    mok_sched_layout layout;
    void *schedule;
    /* the header's tag (core/schedule.h): the workspace that builds, and the build's call number */
    unsigned long long workspace_tag;
    long long build;
    int *error;
};

static __device__ long long peer_tokens(const sched_params &p, int peer) {
    return *(volatile const long long *)(p.peers[peer] + p.off_tokens);
}

static size_t place_smem_bytes(long long num_local_experts) {
    return sizeof(int) * (size_t)(PLACE_THREADS / 32 + 1) * (size_t)num_local_experts;
}

/* Chunks: the smallest multiple of PLACE_THREADS, times a power of two, that gives at most
 * PLACE_BLOCKS_PER_SM place blocks per SM for T_max on every rank. Longer chunks would leave SMs
 * idle; shorter ones would only queue behind the first wave, and lengthen the scan. */
size_t mok__cuda_sched_scratch(const mok_workspace *ws, int num_sms, char *base, cuda_sched_scratch *out) {
    const long long P = ws->group->nranks, L = ws->num_local_experts;
    const long long slots = ws->shape.max_tokens * ws->shape.topk;
    memset(out, 0, sizeof *out);
    /* The build refuses such shapes (mok__cuda_schedule_build); they get no scratch. The others
       have L < 2^15 local experts, so slot_expert's int16 holds every one. */
    if (place_smem_bytes(L) > SCHED_MAX_SMEM) return 0;
    long long chunk = PLACE_THREADS;
    const long long blocks_max = (long long)(num_sms > 0 ? num_sms : 1) * PLACE_BLOCKS_PER_SM;
    while (chunk < slots && P * ((slots + chunk - 1) / chunk) > blocks_max) chunk *= 2;
    out->chunk_slots = chunk;
    out->num_chunks = (slots + chunk - 1) / chunk;
    const size_t counts_bytes = sizeof(int32_t) * (size_t)(out->num_chunks * P * L);
    const size_t error_bytes = sizeof(int32_t) * (size_t)(out->num_chunks * P);
    const size_t off_error = (counts_bytes + 255) & ~(size_t)255;
    const size_t off_slots = (off_error + error_bytes + 255) & ~(size_t)255;
    const size_t bytes = off_slots + sizeof(int16_t) * (size_t)(P * slots);
    if (base) {
        out->chunk_counts = (int32_t *)base;
        out->chunk_error = (int32_t *)(base + off_error);
        out->slot_expert = (int16_t *)(base + off_slots);
    }
    return bytes;
}

/* Block (chunk, peer). Writes, for its chunk of the peer's slots: chunk_counts[chunk][peer][*]
 * (every local expert, zeros included), chunk_error[chunk][peer], slot_expert of the slots below
 * T * k, and for peer == rank own_ids of the whole chunk (up to T_max * k). Every block writes
 * its entries even past T or for a bad T, so the scan reads no stale counts. A bad id is not
 * counted (as in core/schedule.inc); a bad T leaves the peer's ids unread. */
__global__ void __launch_bounds__(COUNT_THREADS) sched_count_kernel(sched_params p) {
    extern __shared__ int hist[]; /* [L] */
    __shared__ int bad_id;
    const int L = p.num_local_experts, chunk = blockIdx.x, peer = blockIdx.y, lane = threadIdx.x % 32;
    const long long slots_max = p.max_tokens * p.topk;
    const long long T = peer_tokens(p, peer);
    const bool tokens_ok = T >= 0 && T <= p.max_tokens;
    const bool own = peer == p.rank;
    for (int l = threadIdx.x; l < L; l += blockDim.x) hist[l] = 0;
    if (threadIdx.x == 0) bad_id = 0;
    /* own_ids are all -1 when any peer's T is out of range (the schedule is then an error). */
    int tokens_fine = 1;
    if (own)
        for (int q = threadIdx.x; q < p.nranks; q += blockDim.x) {
            const long long t = peer_tokens(p, q);
            tokens_fine &= t >= 0 && t <= p.max_tokens;
        }
    const bool own_ids_ok = __syncthreads_and(tokens_fine);

    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    const int32_t *ids = (const int32_t *)(p.peers[peer] + p.off_ids);
    int16_t *slot_expert = p.scratch.slot_expert + peer * slots_max;
    const long long first = (long long)p.rank * L;
    const long long begin = chunk * p.scratch.chunk_slots;
    const long long chunk_end = min(begin + p.scratch.chunk_slots, slots_max);
    const long long end = tokens_ok ? min(chunk_end, T * p.topk) : begin;
    /* NOTE: the loop bound is the same for the whole block, so every warp's 32 lanes reach each
       match together; lanes past `end` vote -1. One shared atomic per expert per warp. A step
       loads all its COUNT_ITEMS ids before it counts them, so they are in flight together. */
    for (long long base = begin; base < end; base += (long long)COUNT_ITEMS * blockDim.x) {
        int e[COUNT_ITEMS];
#pragma unroll
        for (int u = 0; u < COUNT_ITEMS; ++u) {
            const long long s = base + u * blockDim.x + threadIdx.x;
            e[u] = s < end ? ids[s] : -1;
        }
#pragma unroll
        for (int u = 0; u < COUNT_ITEMS; ++u) {
            const long long s = base + u * blockDim.x + threadIdx.x;
            int l = -1;
            if (s < end) {
                if (e[u] < -1 || e[u] >= p.num_experts) bad_id = 1;
                else if (e[u] >= first && e[u] < first + L) l = (int)(e[u] - first);
                slot_expert[s] = (int16_t)l;
                if (own) v.own_ids[s] = own_ids_ok ? e[u] : -1;
            }
            const unsigned same = __match_any_sync(0xffffffffu, l);
            if (l >= 0 && lane == __ffs(same) - 1) atomicAdd(&hist[l], __popc(same));
        }
    }
    if (own)
        for (long long s = max(begin, end) + threadIdx.x; s < chunk_end; s += blockDim.x) v.own_ids[s] = -1;
    __syncthreads();
    int32_t *counts = p.scratch.chunk_counts + ((long long)chunk * p.nranks + peer) * L;
    for (int l = threadIdx.x; l < L; l += blockDim.x) counts[l] = hist[l];
    if (threadIdx.x == 0) {
        p.scratch.chunk_error[(long long)chunk * p.nranks + peer] =
            !tokens_ok ? MOK_SCHED_ERR_TOKENS : bad_id ? MOK_SCHED_ERR_EXPERT_ID : 0;
        if (!tokens_ok && chunk == 0) set_error(p.error, MOK_KERR_TOKENS);
        if (bad_id) set_error(p.error, MOK_KERR_EXPERT_ID);
    }
}

/* Block-wide helpers for SCAN_THREADS threads; `scratch` is shared [SCAN_THREADS / 32]. Every
 * thread of the block must call them. */
static __device__ long long block_exclusive_sum(long long x, long long *total, long long *scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = SCAN_THREADS / 32;
    long long inclusive = x;
    for (int d = 1; d < 32; d *= 2) {
        const long long y = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += y;
    }
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        long long w = lane < nwarps ? scratch[lane] : 0;
        for (int d = 1; d < 32; d *= 2) {
            const long long y = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += y;
        }
        if (lane < nwarps) scratch[lane] = w;
    }
    __syncthreads();
    const long long before = warp > 0 ? scratch[warp - 1] : 0;
    *total = scratch[nwarps - 1];
    __syncthreads();
    return before + inclusive - x;
}

static __device__ long long block_max(long long x, long long *scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = SCAN_THREADS / 32;
    for (int d = 16; d > 0; d /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, d));
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    long long m = scratch[0];
    for (int w = 1; w < nwarps; ++w) m = max(m, scratch[w]);
    __syncthreads();
    return m;
}

static __device__ long long tile_rows(long long n) { return (n + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE; }

/* Phase (1) of the scan kernel: turns chunk_counts, column by column (a column is one (peer,
 * expert) over the chunks), into the rows of that column in the chunks before (exclusive scan, in
 * place), and writes the column's total to counts[l * P + peer]. A tile of `cols` columns at a
 * time; `segments` threads split each column's chunks. Ends with a __syncthreads. */
static __device__ void scan_chunk_columns(const sched_params &p, const mok_sched_view &v, int *partial) {
    const int L = p.num_local_experts, P = p.nranks, J = P * L;
    const long long C = p.scratch.num_chunks;
    const int cols = J < SCAN_THREADS ? J : SCAN_THREADS;
    int segments = SCAN_THREADS / cols;
    if (segments > SCAN_MAX_SEGMENTS) segments = SCAN_MAX_SEGMENTS;
    if (segments > C) segments = (int)C;
    const long long per_segment = (C + segments - 1) / segments;
    const int col = threadIdx.x % cols, segment = threadIdx.x / cols;
    for (int j0 = 0; j0 < J; j0 += cols) {
        const int j = j0 + col;
        const bool active = segment < segments && j < J;
        const long long c0 = segment * per_segment, c1 = min(C, c0 + per_segment);
        int32_t *column = p.scratch.chunk_counts + j; /* stride J: chunk_counts[c][peer][l], j = peer * L + l */
        int sum = 0;
        if (active)
            for (long long c = c0; c < c1; c += SCAN_BATCH) {
                int n[SCAN_BATCH];
#pragma unroll
                for (int b = 0; b < SCAN_BATCH; ++b) n[b] = c + b < c1 ? column[(c + b) * J] : 0;
#pragma unroll
                for (int b = 0; b < SCAN_BATCH; ++b) sum += n[b];
            }
        partial[threadIdx.x] = sum;
        __syncthreads();
        if (active) {
            int run = 0;
            for (int s = 0; s < segment; ++s) run += partial[s * cols + col];
            for (long long c = c0; c < c1; c += SCAN_BATCH) {
                int n[SCAN_BATCH];
#pragma unroll
                for (int b = 0; b < SCAN_BATCH; ++b) n[b] = c + b < c1 ? column[(c + b) * J] : 0;
#pragma unroll
                for (int b = 0; b < SCAN_BATCH; ++b)
                    if (c + b < c1) {
                        column[(c + b) * J] = run;
                        run += n[b];
                    }
            }
            if (segment == segments - 1) v.counts[(long long)(j % L) * P + j / L] = run;
        }
        __syncthreads();
    }
}

/* The count kernel's chunk errors into *worst as key (peer + 1) * 4 + code, the highest peer's kept
 * (a peer has one kind only). *worst is read after a barrier. */
static __device__ void gather_chunk_errors(const sched_params &p, int *worst) {
    const long long C = p.scratch.num_chunks;
    int key = 0;
    for (long long i = threadIdx.x; i < C * p.nranks; i += blockDim.x) {
        const int code = p.scratch.chunk_error[i];
        if (code) key = max(key, (int)(i % p.nranks + 1) * 4 + code);
    }
    key = __reduce_max_sync(0xffffffffu, key);
    if (threadIdx.x % 32 == 0 && key) atomicMax(worst, key);
}

/* Phase (2): segments and the header, as core/schedule.inc's phase 2. Each thread sums the experts
 * [l0, l1) (the counts are this block's own writes, ordered by phase (1)'s last __syncthreads). */
static __device__ void write_segments(const sched_params &p, const mok_sched_view &v, const int *worst,
                                      long long *warp_scratch) {
    const int L = p.num_local_experts, P = p.nranks;
    const int per_thread = (L + SCAN_THREADS - 1) / SCAN_THREADS;
    const int l0 = min(L, (int)threadIdx.x * per_thread), l1 = min(L, l0 + per_thread);
    long long padded = 0, routed = 0, busiest = 0;
    for (int l = l0; l < l1; ++l) {
        long long n = 0;
        for (int q = 0; q < P; ++q) n += v.counts[(long long)l * P + q];
        padded += tile_rows(n);
        routed += n;
        busiest = max(busiest, n);
    }
    long long rows = 0, routed_all = 0;
    long long start = block_exclusive_sum(padded, &rows, warp_scratch); /* its barriers order *worst */
    block_exclusive_sum(routed, &routed_all, warp_scratch);
    busiest = block_max(busiest, warp_scratch);
    const int error = *worst ? *worst % 4 : (rows > p.max_rows ? MOK_SCHED_ERR_CAPACITY : 0);
    for (int l = l0; l < l1; ++l) {
        long long n = 0;
        for (int q = 0; q < P; ++q) n += v.counts[(long long)l * P + q];
        v.expert_start[l] = error ? 0 : start;
        v.expert_rows[l] = error ? 0 : n;
        start += tile_rows(n);
    }
    mok_sched_header *h = v.header;
    for (int q = threadIdx.x; q < MOK_MAX_RANKS; q += blockDim.x) h->num_tokens[q] = q < P ? peer_tokens(p, q) : 0;
    if (threadIdx.x == 0) {
        h->magic = MOK_SCHED_MAGIC;
        h->nranks = P;
        h->rank = p.rank;
        h->num_local_experts = L;
        h->topk = p.topk;
        h->max_rows = p.max_rows;
        mok__sched_tag(p.schedule, p.workspace_tag, p.build);
        h->error = error;
        /* id and T errors were set by the count kernel; the host may have reported and cleared
           them already, so only the error found here goes into the word */
        if (error == MOK_SCHED_ERR_CAPACITY) set_error(p.error, MOK_KERR_SCHEDULE);
        v.expert_start[L] = error ? 0 : rows;
        h->routed_rows = error ? 0 : routed_all;
        h->padded_rows = error ? 0 : rows;
        h->max_expert_rows = error ? 0 : busiest;
    }
}

/* One block, after the count kernel: the column scan (1), then the segments and the header (2).
 * header.error is the error of the highest peer that has one (the code core/schedule.inc keeps),
 * else a capacity error; on any error the segments and row totals are zero. Everything it writes is
 * read by the place kernel, and the header by the pass. */
__global__ void __launch_bounds__(SCAN_THREADS) sched_scan_kernel(sched_params p) {
    __shared__ int partial[SCAN_THREADS];
    __shared__ long long warp_scratch[SCAN_THREADS / 32];
    __shared__ int worst;
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    if (threadIdx.x == 0) worst = 0; /* ordered before the atomics by phase (1)'s barriers */
    scan_chunk_columns(p, v, partial);
    gather_chunk_errors(p, &worst);
    write_segments(p, v, &worst, warp_scratch);
}

/* Block (chunk, peer), after the scan; nothing when the header has an error. The i-th row of
 * peer p in expert l goes to start[l] + sum_q min(c_q, i) + #{q < p : c_q > i} (round-robin
 * across peers). i is the chunk's base (from the scan) plus the slot's rank inside the chunk: a
 * running cursor per expert plus the slot's rank inside its step, from warp match masks and
 * per-warp counts. Also writes the padding rows of the experts l = block, block + blocks, ...
 * (disjoint from every real row). */
__global__ void __launch_bounds__(PLACE_THREADS, PLACE_BLOCKS_PER_SM) sched_place_kernel(sched_params p) {
    extern __shared__ int smem[];
    const int L = p.num_local_experts, nwarps = PLACE_THREADS / 32;
    int *warp_count = smem;              /* [nwarps][L] */
    int *cursor = smem + nwarps * L;     /* [L] */
    mok_sched_view v = mok__sched_view(&p.layout, p.schedule);
    if (v.header->error) return;
    const int chunk = blockIdx.x, peer = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int block = blockIdx.y * gridDim.x + blockIdx.x, blocks = gridDim.x * gridDim.y;
    for (int l = block; l < L; l += blocks)
        for (long long r = v.expert_start[l] + v.expert_rows[l] + threadIdx.x; r < v.expert_start[l + 1];
             r += blockDim.x) {
            v.row_peer[r] = -1;
            v.row_slot[r] = -1;
        }
    /* No header error: every T is in range, and the scan copied it into the header. */
    const long long slots_max = p.max_tokens * p.topk;
    const long long begin = chunk * p.scratch.chunk_slots;
    const long long end = min(begin + p.scratch.chunk_slots, (long long)v.header->num_tokens[peer] * p.topk);
    if (begin >= end) return;
    const int16_t *slot_expert = p.scratch.slot_expert + peer * slots_max;
    const int32_t *chunk_base = p.scratch.chunk_counts + ((long long)chunk * p.nranks + peer) * L;
    for (int i = threadIdx.x; i < nwarps * L; i += blockDim.x) warp_count[i] = 0;
    for (int l = threadIdx.x; l < L; l += blockDim.x) cursor[l] = chunk_base[l];
    __syncthreads();
    for (long long base = begin; base < end; base += PLACE_THREADS) {
        const long long s = base + threadIdx.x;
        const int l = s < end ? slot_expert[s] : -1;
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

/* The rank's topk_ids into its window, where the peers' count and place kernels read them: a
 * kernel, not cudaMemcpyAsync, whose device-to-device copy into the window cost the host tens of
 * microseconds a call. n4: int4s (the ids' bytes / 16; both pointers 16-byte aligned), tail: the
 * int32s after them. */
__global__ void copy_ids_kernel(const int32_t *__restrict__ src, int32_t *__restrict__ dst, long long n4, int tail) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += stride)
        ((int4 *)dst)[i] = ((const int4 *)src)[i];
    if (blockIdx.x == 0 && threadIdx.x < tail) dst[4 * n4 + threadIdx.x] = src[4 * n4 + threadIdx.x];
}

extern "C" mok_status mok__cuda_schedule_build(mok_workspace *ws, const mok_schedule_args *args) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    int current = previous;
    const size_t place_smem = place_smem_bytes(ws->num_local_experts);
    if (place_smem > SCHED_MAX_SMEM) {
        return mok__fail(MOK_ERR_UNSUPPORTED, "shape: %lld local experts exceed the schedule kernel's shared memory",
                         (long long)ws->num_local_experts);
    }
    const size_t count_smem = sizeof(int) * (size_t)ws->num_local_experts;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_schedule_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cuda_use_device(R->device, &current));
        /* the largest limit the kernel may need: every workspace sets the same one */
        CUDA_TRY(cuda_kernel_smem(R, CUDA_ATTR_SCHED_PLACE, (const void *)sched_place_kernel, SCHED_MAX_SMEM));
        st = mok__cuda_error_word_clear(ws, lr, stream); /* before any kernel of this call */
        if (st != MOK_OK) return st;
        if (a->num_tokens > 0) {
            const long long ids = a->num_tokens * ws->shape.topk, n4 = ids / 4;
            long long blocks = (n4 + 255) / 256;
            blocks = blocks < 1 ? 1 : blocks > 4 * R->num_sms ? 4 * R->num_sms : blocks;
            LAUNCH_TRY(copy_ids_kernel<<<(unsigned)blocks, 256, 0, stream>>>(a->topk_ids, (int32_t *)(R->sym + cw->sym.ids), n4,
                                                                           (int)(ids % 4)));
        }
        st = mok__cuda_barrier(ws, lr, stream, a->num_tokens, 0, NULL);
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
        p.scratch = R->sched;
        p.layout = ws->sched_layout;
        p.schedule = a->schedule;
        p.workspace_tag = ws->tag;
        p.build = ws->call_build[lr];
        p.error = (int *)R->error_word;
        const dim3 chunks((unsigned)R->sched.num_chunks, (unsigned)p.nranks);
        LAUNCH_TRY(sched_count_kernel<<<chunks, COUNT_THREADS, count_smem, stream>>>(p));
        LAUNCH_TRY(sched_scan_kernel<<<1, SCAN_THREADS, 0, stream>>>(p));
        LAUNCH_TRY(sched_place_kernel<<<chunks, PLACE_THREADS, place_smem, stream>>>(p));
        st = mok__cuda_barrier(ws, lr, stream, -1, 1, NULL);
        if (st != MOK_OK) return st;
    }
    cuda_use_device(previous, &current);
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
