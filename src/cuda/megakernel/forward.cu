/* forward.cu — the forward megakernel: one CTA per SM, all co-resident (cooperative launch).
 * CTAs [0, comm) pull-dispatch routed rows from the peers' x into the ring and push-combine
 * finished expert outputs into their owners' per-(token, slot) buffers; the others run the
 * shared expert, then per minibatch the gate/up GEMM with SwiGLU and the down GEMM, on the
 * warp-specialised wgmma tile (compute_walk.cuh: a producer warpgroup loads, two consumer
 * warpgroups multiply and run the epilogues). Each role
 * claims its tasks with a ticket, in the order of core/tasks.inc (mok__spans_build), and waits
 * only on counters of earlier tasks: deadlock-free as long as all CTAs run at once.
 *
 * Buffer ownership: ring rows of a row tile are written by that tile's DISPATCH (x), GATEUP
 * (h) and DOWN (y) and read by the later tasks of the same tile; a ring slot is refilled only
 * after the COMBINE of its previous occupant (the counter wait of DISPATCH). An owner's
 * combine row (token, slot) has exactly one writer: the COMBINE of the rank owning the expert. */
#include <string.h>

#include "cuda/megakernel/comm_walk.cuh"
#include "cuda/megakernel/swiglu.cuh"


/* x rows of the tile's (peer, token) pairs into the ring, one warp per row. */
static __device__ void run_dispatch(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
    comm_tile_load(ct, v, rt);
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const int peer = ct->peer[r];
        if (peer < 0) break; /* padding: the rest of the tile */
        const uint16_t *src = (const uint16_t *)input_row_base(p, peer, p.off_x, p.x) +
                              (long long)(ct->slot[r] / p.topk) * p.hidden;
        copy_row(p.ring_x + (ring0 + r) * p.hidden, src, p.hidden);
    }
}

/* The tile's expert outputs into their owners' (token, slot) rows, one warp per row. With one
 * rank the down tiles wrote them there themselves (fwd_epilogue): the task is its counters. */
static __device__ void run_combine(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
    if (p.nranks == 1) return;
    comm_tile_load(ct, v, rt);
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const int peer = ct->peer[r];
        if (peer < 0) break;
        uint16_t *dst = (uint16_t *)(p.peers[peer] + p.off_comb) + (long long)ct->slot[r] * p.hidden;
        copy_row(dst, p.ring_y + (ring0 + r) * p.hidden, p.hidden);
    }
}

/* ---- turned transfers (docs/design.md §2.4a): this rank's rows of peer q's row tile rt, found
 * through q's copy of its schedule in q's window (sched_publish_kernel), one warp per row; the
 * rows of other ranks are theirs to move. */

/* combine_pull: q's expert outputs of this rank's (token, slot) rows, from q's ring into this
 * rank's combine buffer (after q's down tiles of rt: the GATHER's wait). */
static __device__ void run_gather(const pass_params &p, int q, long long rt, comm_tile *ct) {
    comm_tile_load(ct, mok__sched_view(&p.layout, p.peers[q] + p.off_sched), rt);
    const uint16_t *ring_y = (const uint16_t *)(p.peers[q] + p.off_ring_y);
    uint16_t *comb = (uint16_t *)(p.peers[p.rank] + p.off_comb);
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        if (ct->peer[r] != p.rank) continue;
        copy_row(comb + (long long)ct->slot[r] * p.hidden, ring_y + (ring0 + r) * p.hidden, p.hidden);
    }
}

/* dispatch_push: this rank's x rows into q's ring (after q combined the slot's previous occupant:
 * the SCATTER's wait). The padding rows stay as they are: the forward never reads them (gate|up
 * stores zeros for them in the context and no h), the backward brings its own x. */
static __device__ void run_scatter(const pass_params &p, int q, long long rt, comm_tile *ct) {
    comm_tile_load(ct, mok__sched_view(&p.layout, p.peers[q] + p.off_sched), rt);
    uint16_t *ring_x = (uint16_t *)(p.peers[q] + p.off_ring_x);
    const uint16_t *x = p.x;
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        if (ct->peer[r] != p.rank) continue;
        copy_row(ring_x + (ring0 + r) * p.hidden, x + (long long)(ct->slot[r] / p.topk) * p.hidden, p.hidden);
    }
}

/* The one GEMM of a compute task: gate|up (n_tile columns of each: B is n_tile gate rows, then
 * n_tile up rows) or down (n_tile_h columns of H), routed or shared. */
static __device__ int fwd_gemm(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                               const task_prep &tp, int i, tile_operands *op) {
    if (i > 0) return 0;
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter;
    *op = tile_operands{};
    op->lda = H;
    op->ldb = H;
    op->k = H;
    switch (span.kind) {
    case MOK_TASK_GATEUP: {
        const tile_info t = tp.tile;
        const long long n0 = nt * p.n_tile;
        op->a = p.ring_x + t.ring0 * H;
        op->a_rows = t.nreal;
        op->b_lo = p.w_gate + ((long long)t.expert * I + n0) * H;
        op->b_hi = p.w_up + ((long long)t.expert * I + n0) * H;
        op->n_valid = 2 * p.n_tile;
        op->b_split = p.n_tile / 64;
        use_tma_k(p, op, MAP_RING_X, t.ring0, MAP_W_GATE, t.expert * I + n0, MAP_W_UP, t.expert * I + n0);
        return 1;
    }
    case MOK_TASK_SHARED_UP: {
        const long long t0 = rt * MOK_ROW_TILE, n0 = nt * p.n_tile;
        op->a = p.x + t0 * H;
        op->a_rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
        op->b_lo = p.s_gate + n0 * H;
        op->b_hi = p.s_up + n0 * H;
        op->n_valid = 2 * p.n_tile;
        op->b_split = p.n_tile / 64;
        use_tma_k(p, op, MAP_X, t0, MAP_S_GATE, n0, MAP_S_UP, n0);
        return 1;
    }
    case MOK_TASK_DOWN: {
        const tile_info t = tp.tile;
        if (t.nreal == 0) return 0;
        op->a = p.ring_h + t.ring0 * I;
        op->a_rows = t.nreal;
        const long long row = t.expert * H + nt * p.n_tile_h;
        op->b_lo = p.w_down + row * I;
        op->lda = op->ldb = op->k = I;
        op->n_valid = p.n_tile_h;
        op->b_split = p.n_tile_h / 64;
        use_tma_k(p, op, MAP_RING_H, t.ring0, MAP_W_DOWN, row, -1, 0);
        return 1;
    }
    case MOK_TASK_SHARED_DOWN: {
        const long long t0 = rt * MOK_ROW_TILE;
        op->a = p.sh_h + t0 * Is;
        op->a_rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
        op->b_lo = p.s_down + nt * p.n_tile_h * Is;
        op->lda = op->ldb = op->k = Is;
        op->n_valid = p.n_tile_h;
        op->b_split = p.n_tile_h / 64;
        use_tma_k(p, op, MAP_SH_H, t0, MAP_S_DOWN, nt * p.n_tile_h, -1, 0);
        return 1;
    }
    default: return 0;
    }
}

/* Consumers: SwiGLU (h, and g|u into the context) or the down projection's tile, both through
 * the staging tile in 16-byte chunks (swiglu_staged, store_staged; they sync the consumers). The
 * walk's closing barrier orders the stores before the release. */
static __device__ __forceinline__ void fwd_epilogue(const pass_params &p, const mok_task_span &span, long long rt,
                                    long long nt, const task_prep &tp, float (&acc)[TILE_ACC], uint16_t *staging) {
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter;
    switch (span.kind) {
    case MOK_TASK_GATEUP:
    case MOK_TASK_SHARED_UP: { /* one call site per width for both: the SwiGLU is most of the kernel's code */
        const bool routed = span.kind == MOK_TASK_GATEUP;
        const long long inter = routed ? I : Is;
        int rows;
        long long ctx_row0, ctx_rows;
        uint16_t *ctx, *h;
        if (routed) {
            const tile_info t = tp.tile;
            rows = t.nreal;
            ctx_row0 = t.row0;
            ctx_rows = p.context_rows;
            ctx = p.context;
            h = p.ring_h + t.ring0 * I;
        } else {
            const long long t0 = rt * MOK_ROW_TILE;
            rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
            ctx_row0 = t0;
            ctx_rows = t0 + rows;
            ctx = p.context_shared;
            h = p.sh_h + t0 * Is;
        }
        if (p.n_tile == 128)
            swiglu_staged<128>(acc, rows, ctx_row0, ctx_rows, ctx, 2 * inter, inter, nt * 128, h, inter, p.limit, staging);
        else
            swiglu_staged<64>(acc, rows, ctx_row0, ctx_rows, ctx, 2 * inter, inter, nt * 64, h, inter, p.limit, staging);
        break;
    }
    case MOK_TASK_DOWN:
    case MOK_TASK_SHARED_DOWN: {
        int rows;
        uint16_t *out;
        if (span.kind == MOK_TASK_DOWN) {
            const tile_info t = tp.tile;
            rows = t.nreal;
            if (p.nranks == 1 && !p.combine_pull) {
                /* one rank: each row straight into its (token, slot) row of the combine buffer, which
                   the COMBINE tasks would copy it to from the ring (run_combine); the rows < nreal
                   of a tile are real, each with its own slot */
                const mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
                store_staged<true>(acc, rows, p.n_tile_h, (uint16_t *)(p.peers[p.rank] + p.off_comb), H,
                                   nt * p.n_tile_h, staging, v.row_slot + t.row0);
                break;
            }
            out = p.ring_y + t.ring0 * H;
        } else {
            const long long t0 = rt * MOK_ROW_TILE;
            rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
            out = p.sh_out + t0 * H;
        }
        store_staged(acc, rows, p.n_tile_h, out, H, nt * p.n_tile_h, staging);
        break;
    }
    default: break;
    }
}

/* Comm CTAs run the transfers with every thread; compute CTAs are warp-specialised (compute_walk.cuh). */
struct forward_comm {
    static __device__ void run(const pass_params &p, const mok_sched_view &v, const mok_task_span &span, long long rt,
                               long long, uint16_t *smem) {
        comm_tile *ct = (comm_tile *)smem;
        switch (span.kind) {
        case MOK_TASK_DISPATCH: run_dispatch(p, v, rt, ct); break;
        case MOK_TASK_COMBINE: run_combine(p, v, rt, ct); break;
        case MOK_TASK_GATHER: run_gather(p, span.peer, rt, ct); break;
        case MOK_TASK_SCATTER: run_scatter(p, span.peer, rt, ct); break;
        default: break;
        }
    }
};

struct forward_compute {
    static constexpr int VARIANTS = 1; /* K-major operands only */
    static __device__ void prepare(const pass_params &p, const mok_sched_view &v, const mok_task_span &span,
                                   long long rt, long long, task_prep *tp) {
        if (span.kind == MOK_TASK_GATEUP || span.kind == MOK_TASK_DOWN) tp->tile = row_tile(p, v, rt);
    }
    static __device__ int gemm(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                               const task_prep &tp, int i, tile_operands *op) {
        return fwd_gemm(p, span, rt, nt, tp, i, op);
    }
    template <int VAR>
    static __device__ void preset(const pass_params &, const mok_task_span &, long long, long long,
                                  const task_prep &, int, float (&acc)[TILE_ACC]) {
#pragma unroll
        for (int i = 0; i < TILE_ACC; ++i) acc[i] = 0.0f;
    }
    template <int VAR>
    static __device__ void epilogue(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                                    const task_prep &tp, int, float (&acc)[TILE_ACC], uint16_t *staging, float *,
                                    const CUtensorMap *) {
        fwd_epilogue(p, span, rt, nt, tp, acc, staging);
    }
    static __device__ void plain(const pass_params &, const mok_task_span &, long long, long long,
                                 const task_prep &) {}
};

__global__ void __launch_bounds__(COMPUTE_THREADS, 1) forward_kernel(pass_params p, const __grid_constant__ pass_maps maps) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const long long entry = TRACE_ON(p) ? globaltimer_ns() : 0;
    int comm;
    if (pass_start(p, &comm)) return;
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    if (blockIdx.x < comm) walk_tasks<forward_comm>(p, v, (uint16_t *)smem_raw); /* comm_tile */
    else walk_compute<forward_compute>(p, v, smem_raw, nullptr, maps.m);
    if (TRACE_ON(p)) {
        __syncthreads();
        if (threadIdx.x == 0) trace_resident(p, entry, comm);
    }
}

/* The tensor maps of a forward pass and the mask of those usable. */
static unsigned forward_maps(const cuda_rank *R, const pass_params *p, pass_maps *maps) {
    const long long H = p->hidden, I = p->inter, Is = p->shared_inter;
    const long long ring = p->ring_rows, T = p->num_tokens;
    unsigned mask = 0;
    memset(maps, 0, sizeof *maps);
    if (!R->tuning.tma) return 0;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_X], R->ring_x, ring, H, 64) << MAP_RING_X;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_H], R->ring_h, ring, I, 64) << MAP_RING_H;
    mask |= (unsigned)tma_encode(&maps->m[MAP_X], p->x, T, H, 64) << MAP_X;
    mask |= (unsigned)tma_encode(&maps->m[MAP_SH_H], Is ? R->sh_h : NULL, T, Is, 64) << MAP_SH_H;
    return mask | weight_maps(p, maps);
}

extern "C" mok_status mok__cuda_forward(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    int previous = 0;
    cudaGetDevice(&previous);
    const size_t smem = COMPUTE_SMEM_BYTES;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_forward_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cudaSetDevice(R->device));
        CUDA_TRY(cudaFuncSetAttribute(forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        pass_params p;
        pass_params_init(&p, ws, R, a->num_tokens, a->schedule, 0);
        p.recompute = recompute;
        if (!recompute) { /* a recompute pass refills the ring by its own pulls (core/tasks.inc) */
            p.combine_pull = ws->config.fwd_combine == MOK_PULL;
            p.dispatch_push = ws->config.fwd_dispatch == MOK_PUSH;
        }
        /* gate|up tasks: n_tile columns of I each of gate and up, 2 n_tile columns of the tile */
        p.n_tile = R->tuning.cols_gateup;
        pass_params_comm(&p, R, ws->config.fwd_comm_sms, 0);
        pass_params_layer(&p, ws, a->x, a->w_gate, a->w_up, a->w_down, a->s_gate, a->s_up, a->s_down, a->context);

        if (a->num_tokens > 0 && ws->group->nranks > 1) /* the peers' copy (input_row_base) */
            CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.x, a->x, (size_t)(a->num_tokens * s->hidden) * 2,
                                     cudaMemcpyDeviceToDevice, stream));
        pass_maps maps;
        p.tma_mask = forward_maps(R, &p, &maps);
        st = mok__cuda_launch_pass(ws, lr, R, &p, (const void *)forward_kernel, COMPUTE_THREADS, smem, stream,
                                   a->num_tokens, &maps);
        if (st != MOK_OK) return st;
        if (!recompute && a->num_tokens > 0)
            st = mok__cuda_forward_slot_sums(p, R->num_sms, a->router_w, (uint16_t *)a->y, R->sym + cw->sym.comb,
                                             stream);
        if (st != MOK_OK) return st;
    }
    cudaSetDevice(previous);
    return MOK_OK;
}
