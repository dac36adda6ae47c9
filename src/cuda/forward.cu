/* forward.cu — the forward megakernel: one CTA per SM, all co-resident (cooperative launch).
 * CTAs [0, comm) pull-dispatch routed rows from the peers' x into the ring and push-combine
 * finished expert outputs into their owners' per-(token, slot) buffers; the others run the
 * shared expert, then per minibatch the gate/up GEMM with SwiGLU and the down GEMM. Each role
 * claims its tasks with a ticket, in the order of core/tasks.c (mok__groups_build), and waits
 * only on counters of earlier tasks: deadlock-free as long as all CTAs run at once.
 *
 * Buffer ownership: ring rows of a row tile are written by that tile's DISPATCH (x), GATEUP
 * (h) and DOWN (y) and read by the later tasks of the same tile; a ring slot is refilled only
 * after the COMBINE of its previous occupant (the counter wait of DISPATCH). An owner's
 * combine row (token, slot) has exactly one writer: the COMBINE of the rank owning the expert. */
#include <string.h>

#include "cuda_common.cuh"
#include "mma_tile.cuh"

struct fwd_params {
    mok_sched_layout layout;
    const void *schedule;
    int num_local_experts, topk, rank, recompute, n_tile_h, comm_ctas;
    long long hidden, inter, shared_inter, num_tokens, ring_rows, minibatch_rows, context_rows;
    char *const *peers;
    size_t off_x, off_comb;
    const uint16_t *x, *w_gate, *w_up, *w_down, *s_gate, *s_up, *s_down;
    uint16_t *ring_x, *ring_h, *ring_y, *sh_h, *sh_out, *context, *context_shared;
    float limit;
    unsigned long long *counters;
    long long counters_cap;
    int *error;
    long long timeout_ns;
    mok_task_group *groups; /* built by forward_groups_kernel */
    long long groups_cap;
    long long *num_groups;
};

struct tile_info {
    long long row0, ring0;
    int nreal, expert;
};

static __device__ tile_info row_tile(const fwd_params &p, const mok_sched_view &v, long long rt) {
    tile_info t;
    t.row0 = rt * MOK_ROW_TILE;
    t.ring0 = t.row0 % p.ring_rows;
    t.expert = mok__sched_row_expert(&v, p.num_local_experts, t.row0);
    long long end = v.expert_start[t.expert] + v.expert_rows[t.expert] - t.row0;
    t.nreal = (int)(end < 0 ? 0 : end > MOK_ROW_TILE ? MOK_ROW_TILE : end);
    return t;
}

/* Waits until counters[c] >= target (thread 0 spins, the CTA then proceeds together). Returns
 * false if the pass was aborted. */
static __device__ bool wait_counter(const fwd_params &p, long long c, long long target, volatile int *s_flag) {
    if (threadIdx.x == 0) {
        int ok = 1;
        if (c >= 0) {
            long long start = globaltimer_ns();
            unsigned long long *abort = p.counters + p.counters_cap + 2;
            while ((long long)ld_acquire_gpu(p.counters + c) < target) {
                if (*(volatile unsigned long long *)abort) { ok = 0; break; }
                if (globaltimer_ns() - start > p.timeout_ns) {
                    atomicCAS(p.error, 0, MOK_KERR_STALL);
                    atomicExch(abort, 1ull);
                    ok = 0;
                    break;
                }
            }
        }
        *s_flag = ok;
    }
    __syncthreads();
    bool ok = *s_flag;
    __syncthreads();
    return ok;
}

/* Copies `rows` rows of H bf16 between two places, one warp per row, 16 bytes per lane. */
static __device__ __forceinline__ void copy_row(uint16_t *dst, const uint16_t *src, long long h) {
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    const int lane = threadIdx.x & 31, n = (int)(h / 8);
    int c = lane;
    for (; c + 96 < n; c += 128) {
        int4 v0 = s[c], v1 = s[c + 32], v2 = s[c + 64], v3 = s[c + 96];
        d[c] = v0; d[c + 32] = v1; d[c + 64] = v2; d[c + 96] = v3;
    }
    for (; c < n; c += 32) d[c] = s[c];
}

static __device__ void run_dispatch(const fwd_params &p, const mok_sched_view &v, long long rt) {
    tile_info t = row_tile(p, v, rt);
    for (int r = threadIdx.x >> 5; r < t.nreal; r += CUDA_THREADS / 32) {
        int peer = v.row_peer[t.row0 + r];
        long long token = v.row_slot[t.row0 + r] / p.topk;
        const uint16_t *src = (const uint16_t *)(p.peers[peer] + p.off_x) + token * p.hidden;
        copy_row(p.ring_x + (t.ring0 + r) * p.hidden, src, p.hidden);
    }
}

static __device__ void run_combine(const fwd_params &p, const mok_sched_view &v, long long rt) {
    tile_info t = row_tile(p, v, rt);
    for (int r = threadIdx.x >> 5; r < t.nreal; r += CUDA_THREADS / 32) {
        int peer = v.row_peer[t.row0 + r];
        long long slot = v.row_slot[t.row0 + r];
        uint16_t *dst = (uint16_t *)(p.peers[peer] + p.off_comb) + slot * p.hidden;
        copy_row(dst, p.ring_y + (t.ring0 + r) * p.hidden, p.hidden);
    }
}

/* gate|up tile: C[:, 0:64] = g, C[:, 64:128] = u (bf16). Writes g, u into the context rows
 * (padding rows as zeros) and h = bf16(silu(g) * u) into `h_out` for real rows. */
static __device__ void swiglu_epilogue(const uint16_t *c, int nreal, long long ctx_row0, long long ctx_rows,
                                       uint16_t *ctx, long long ctx_ld, long long inter, long long n0, uint16_t *h_out,
                                       long long h_ld, float limit) {
    for (int idx = threadIdx.x; idx < TILE_BM * 8; idx += CUDA_THREADS) {
        int r = idx >> 3, c8 = (idx & 7) * 8;
        bool real = r < nreal;
        uint16_t gv[8], uv[8], hv[8];
        *(int4 *)gv = *(const int4 *)(c + r * TILE_C_LD + c8);
        *(int4 *)uv = *(const int4 *)(c + r * TILE_C_LD + 64 + c8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (!real) gv[i] = uv[i] = 0;
            hv[i] = mok__bf16_from_f32(mok__swiglu(mok__bf16_to_f32(gv[i]), mok__bf16_to_f32(uv[i]), limit));
        }
        long long row = ctx_row0 + r;
        if (ctx && row < ctx_rows) {
            *(int4 *)(ctx + row * ctx_ld + n0 + c8) = *(int4 *)gv;
            *(int4 *)(ctx + row * ctx_ld + inter + n0 + c8) = *(int4 *)uv;
        }
        if (real) *(int4 *)(h_out + r * h_ld + n0 + c8) = *(int4 *)hv;
    }
}

static __device__ void store_tile(const uint16_t *c, int rows, int cols, uint16_t *out, long long ld, long long n0) {
    const int chunks = cols / 8;
    for (int idx = threadIdx.x; idx < rows * chunks; idx += CUDA_THREADS) {
        int r = idx / chunks, c8 = (idx % chunks) * 8;
        *(int4 *)(out + r * ld + n0 + c8) = *(const int4 *)(c + r * TILE_C_LD + c8);
    }
}

static __device__ void run_gateup(const fwd_params &p, const mok_sched_view &v, long long rt, long long nt,
                                  uint16_t *smem) {
    tile_info t = row_tile(p, v, rt);
    const long long n0 = nt * CUDA_N_TILE, H = p.hidden, I = p.inter;
    tile_operands op;
    op.a = p.ring_x + t.ring0 * H;
    op.lda = H;
    op.a_rows = t.nreal;
    op.b_lo = p.w_gate + ((long long)t.expert * I + n0) * H;
    op.b_hi = p.w_up + ((long long)t.expert * I + n0) * H;
    op.ldb = H;
    op.k = H;
    float acc[4][4][4];
    tile_mma(smem, op, acc);
    tile_stage_bf16(smem, acc);
    swiglu_epilogue(smem, t.nreal, t.row0, p.context_rows, p.context, 2 * I, I, n0, p.ring_h + t.ring0 * I, I, p.limit);
}

static __device__ void run_down(const fwd_params &p, const mok_sched_view &v, long long rt, long long nt,
                                uint16_t *smem) {
    tile_info t = row_tile(p, v, rt);
    if (t.nreal == 0) return;
    const long long n0 = nt * p.n_tile_h, H = p.hidden, I = p.inter;
    tile_operands op;
    op.a = p.ring_h + t.ring0 * I;
    op.lda = I;
    op.a_rows = t.nreal;
    op.b_lo = p.w_down + ((long long)t.expert * H + n0) * I;
    op.b_hi = p.n_tile_h == 128 ? op.b_lo + 64 * I : nullptr;
    op.ldb = I;
    op.k = I;
    float acc[4][4][4];
    tile_mma(smem, op, acc);
    tile_stage_bf16(smem, acc);
    store_tile(smem, t.nreal, p.n_tile_h, p.ring_y + t.ring0 * H, H, n0);
}

static __device__ void run_shared_up(const fwd_params &p, long long mt, long long nt, uint16_t *smem) {
    const long long t0 = mt * MOK_ROW_TILE, n0 = nt * CUDA_N_TILE, H = p.hidden, Is = p.shared_inter;
    int rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
    tile_operands op;
    op.a = p.x + t0 * H;
    op.lda = H;
    op.a_rows = rows;
    op.b_lo = p.s_gate + n0 * H;
    op.b_hi = p.s_up + n0 * H;
    op.ldb = H;
    op.k = H;
    float acc[4][4][4];
    tile_mma(smem, op, acc);
    tile_stage_bf16(smem, acc);
    swiglu_epilogue(smem, rows, t0, t0 + rows, p.context_shared, 2 * Is, Is, n0, p.sh_h + t0 * Is, Is, p.limit);
}

static __device__ void run_shared_down(const fwd_params &p, long long mt, long long nt, uint16_t *smem) {
    const long long t0 = mt * MOK_ROW_TILE, n0 = nt * p.n_tile_h, H = p.hidden, Is = p.shared_inter;
    int rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
    tile_operands op;
    op.a = p.sh_h + t0 * Is;
    op.lda = Is;
    op.a_rows = rows;
    op.b_lo = p.s_down + n0 * Is;
    op.b_hi = p.n_tile_h == 128 ? op.b_lo + 64 * Is : nullptr;
    op.ldb = Is;
    op.k = Is;
    float acc[4][4][4];
    tile_mma(smem, op, acc);
    tile_stage_bf16(smem, acc);
    store_tile(smem, rows, p.n_tile_h, p.sh_out + t0 * H, H, n0);
}

static __device__ void make_plan(const fwd_params &p, const mok_sched_view &v, mok_plan *plan) {
    memset(plan, 0, sizeof *plan);
    plan->recompute = p.recompute;
    plan->padded_rows = v.header->padded_rows;
    plan->context_rows = p.context_rows;
    plan->num_tokens = p.num_tokens;
    plan->hidden = p.hidden;
    plan->intermediate = p.inter;
    plan->shared_intermediate = p.shared_inter;
    plan->num_local_experts = p.num_local_experts;
    plan->minibatch_rows = (int)p.minibatch_rows;
    plan->ring_rows = (int)p.ring_rows;
    plan->n_tile = CUDA_N_TILE;
    plan->n_tile_h = p.n_tile_h;
    plan->wgrad_tile = 64;
    plan->expert_start = v.expert_start;
    plan->expert_rows = v.expert_rows;
}

static __device__ bool schedule_ok(const fwd_params &p, const mok_sched_view &v) {
    return v.header->magic == MOK_SCHED_MAGIC && v.header->rank == p.rank && !v.header->error &&
           v.header->num_tokens[p.rank] == p.num_tokens;
}

/* One thread: the pass's groups in the global order (core/tasks.c), for the megakernel. */
__global__ void forward_groups_kernel(fwd_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    *p.num_groups = 0;
    if (!schedule_ok(p, v)) {
        atomicCAS(p.error, 0, MOK_KERR_SCHEDULE);
        return;
    }
    mok_plan plan;
    make_plan(p, v, &plan);
    long long n = mok__groups_build(&plan, p.groups, p.groups_cap);
    if (n < 0) {
        atomicCAS(p.error, 0, MOK_KERR_SCHEDULE);
        n = 0;
    }
    *p.num_groups = n;
}

__global__ void __launch_bounds__(CUDA_THREADS, 1) forward_kernel(fwd_params p) {
    extern __shared__ __align__(1024) uint16_t smem[];
    __shared__ long long s_ticket;
    __shared__ int s_flag;
    if (*(volatile int *)p.error) return;
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    const int role = blockIdx.x < p.comm_ctas ? MOK_ROLE_COMM : MOK_ROLE_COMPUTE;
    unsigned long long *ticket = p.counters + p.counters_cap + role;
    const long long num_groups = *p.num_groups;
    long long g = -1, g_first = 0, g_size = 0; /* current group of this role and its first ticket */
    for (;;) {
        if (threadIdx.x == 0) s_ticket = (long long)atomicAdd(ticket, 1ull);
        __syncthreads();
        const long long t = s_ticket;
        __syncthreads();
        while (t >= g_first + g_size) {
            g_first += g_size;
            g_size = 0;
            while (++g < num_groups && p.groups[g].role != role) {
            }
            if (g >= num_groups) break;
            g_size = (long long)p.groups[g].num_tiles * p.groups[g].n_tiles;
        }
        if (g >= num_groups) break;
        const mok_task_group grp = p.groups[g];
        const long long local = t - g_first, rt = grp.first_tile + local / grp.n_tiles, nt = local % grp.n_tiles;
        const long long wait = grp.wait[0] < 0 ? -1 : grp.wait[0] + (grp.wait_per_tile ? rt - grp.first_tile : 0);
        if (!wait_counter(p, wait, grp.target[0], &s_flag)) break;
        if (!wait_counter(p, grp.wait[1], grp.target[1], &s_flag)) break;
        switch (grp.kind) {
        case MOK_TASK_DISPATCH: run_dispatch(p, v, rt); break;
        case MOK_TASK_COMBINE: run_combine(p, v, rt); break;
        case MOK_TASK_GATEUP: run_gateup(p, v, rt, nt, smem); break;
        case MOK_TASK_DOWN: run_down(p, v, rt, nt, smem); break;
        case MOK_TASK_SHARED_UP: run_shared_up(p, rt, nt, smem); break;
        case MOK_TASK_SHARED_DOWN: run_shared_down(p, rt, nt, smem); break;
        default: break;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            if (grp.done[0] >= 0)
                red_release_gpu(p.counters + grp.done[0] + (grp.done_per_tile ? rt - grp.first_tile : 0), 1ull);
            if (grp.done[1] >= 0) red_release_gpu(p.counters + grp.done[1], 1ull);
        }
    }
}

/* y[t] = bf16(shared[t] + sum_j w[t,j] * comb[t,j]) in fp32, in that order; one thread per 8
 * columns of a token. */
__global__ void forward_epilogue_kernel(const fwd_params p, const float *router_w, uint16_t *y, const char *comb_base) {
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    const long long chunks = p.hidden / 8;
    const uint16_t *comb = (const uint16_t *)comb_base;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < p.num_tokens * chunks;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx / chunks, c8 = (idx % chunks) * 8;
        float acc[8];
        uint16_t in[8];
        if (p.shared_inter > 0) {
            *(int4 *)in = *(const int4 *)(p.sh_out + t * p.hidden + c8);
            for (int i = 0; i < 8; ++i) acc[i] = mok__bf16_to_f32(in[i]);
        } else {
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        }
        for (int j = 0; j < p.topk; ++j) {
            if (v.own_ids[t * p.topk + j] < 0) continue;
            const float w = router_w[t * p.topk + j];
            *(int4 *)in = *(const int4 *)(comb + (t * p.topk + j) * p.hidden + c8);
            for (int i = 0; i < 8; ++i) acc[i] += w * mok__bf16_to_f32(in[i]);
        }
        uint16_t out[8];
        for (int i = 0; i < 8; ++i) out[i] = mok__bf16_from_f32(acc[i]);
        *(int4 *)(y + t * p.hidden + c8) = *(int4 *)out;
    }
}

static size_t kernel_smem(void) {
    size_t c_tile = (size_t)TILE_BM * TILE_C_LD * 2;
    return TILE_SMEM_BYTES > c_tile ? TILE_SMEM_BYTES : c_tile;
}

extern "C" mok_status mok__cuda_forward(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    int previous = 0;
    cudaGetDevice(&previous);
    const size_t smem = kernel_smem();
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_forward_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cudaSetDevice(R->device));
        CUDA_TRY(cudaFuncSetAttribute(forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        fwd_params p;
        memset(&p, 0, sizeof p);
        p.layout = ws->sched_layout;
        p.schedule = a->schedule;
        p.num_local_experts = (int)ws->num_local_experts;
        p.topk = (int)s->topk;
        p.rank = R->rank;
        p.recompute = recompute;
        p.n_tile_h = s->hidden % 128 == 0 ? 128 : 64;
        int comm = ws->config.fwd_comm_sms;
        p.comm_ctas = comm < R->num_sms - 1 ? comm : R->num_sms - 1;
        p.hidden = s->hidden;
        p.inter = s->intermediate;
        p.shared_inter = s->shared_intermediate;
        p.num_tokens = a->num_tokens;
        p.ring_rows = ws->config.ring_rows;
        p.minibatch_rows = ws->config.minibatch_rows;
        p.context_rows = ws->context_rows;
        p.peers = R->peers;
        p.off_x = cw->sym.x;
        p.off_comb = cw->sym.comb;
        p.x = (const uint16_t *)a->x;
        p.w_gate = (const uint16_t *)a->w_gate;
        p.w_up = (const uint16_t *)a->w_up;
        p.w_down = (const uint16_t *)a->w_down;
        p.s_gate = (const uint16_t *)a->s_gate;
        p.s_up = (const uint16_t *)a->s_up;
        p.s_down = (const uint16_t *)a->s_down;
        p.ring_x = R->ring_x;
        p.ring_h = R->ring_h;
        p.ring_y = R->ring_y;
        p.sh_h = R->sh_h;
        p.sh_out = R->sh_out;
        p.context = (uint16_t *)a->context;
        p.context_shared = (uint16_t *)((char *)a->context + ws->context_shared_offset);
        p.limit = ws->config.swiglu_limit;
        p.counters = R->counters;
        p.counters_cap = R->counters_cap;
        p.error = R->error_dev;
        p.timeout_ns = (long long)(ws->config.peer_timeout_ms * 1e6);
        p.groups = R->groups;
        p.groups_cap = R->groups_cap;
        p.num_groups = R->num_groups;

        if (a->num_tokens > 0)
            CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.x, a->x, (size_t)(a->num_tokens * s->hidden) * 2,
                                     cudaMemcpyDeviceToDevice, stream));
        if ((st = mok__cuda_barrier(ws, lr, stream, a->num_tokens)) != MOK_OK) return st;
        CUDA_TRY(cudaMemsetAsync(R->counters, 0, sizeof(unsigned long long) * (size_t)(R->counters_cap + 8), stream));
        LAUNCH_TRY(forward_groups_kernel<<<1, 1, 0, stream>>>(p));
        void *kargs[] = {&p};
        CUDA_TRY(cudaLaunchCooperativeKernel((const void *)forward_kernel, dim3(R->num_sms), dim3(CUDA_THREADS), kargs,
                                             smem, stream));
        if ((st = mok__cuda_barrier(ws, lr, stream, -1)) != MOK_OK) return st;
        if (!recompute && a->num_tokens > 0)
            LAUNCH_TRY(forward_epilogue_kernel<<<R->num_sms * 4, 256, 0, stream>>>(p, a->router_w, (uint16_t *)a->y,
                                                                                    R->sym + cw->sym.comb));
    }
    cudaSetDevice(previous);
    return MOK_OK;
}

extern "C" mok_status mok__cuda_backward(mok_workspace *ws, const mok_backward_args *args) {
    (void)args;
    return mok__fail(MOK_ERR_UNSUPPORTED, "backward: the cuda backend runs the forward only so far");
}

extern "C" mok_status mok__cuda_trace_write(mok_workspace *ws, const char *path) {
    (void)path;
    return mok__fail(MOK_ERR_UNSUPPORTED, "trace: the cuda backend does not record traces yet");
}
