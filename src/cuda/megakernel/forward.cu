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


/* One warp, FP8: row `token` of x^ (codes [., H] at codes, scales [., H / 128] at scales) into ring
 * row `ring` (codes at ring_codes, scales at ring_scales): H codes, H / 128 scales. */
static __device__ __forceinline__ void copy_fp8_row(uint16_t *ring_codes, float *ring_scales, long long ring,
                                                    const uint16_t *codes, const float *scales, long long token,
                                                    long long H) {
    copy_row(ring_codes + ring * (H / 2), codes + token * (H / 2), H / 2); /* pairs of codes */
    const long long nb = H / MOK_FP8_BLOCK;
    for (long long b = threadIdx.x & 31; b < nb; b += 32) ring_scales[ring * nb + b] = scales[token * nb + b];
}

/* x rows (FP8: x^ rows and their scales) of the tile's (peer, token) pairs into the ring, one warp
 * per row. */
static __device__ void run_dispatch(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
    comm_tile_load(ct, v, rt);
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const int peer = ct->peer[r];
        if (peer < 0) break; /* padding: the rest of the tile */
        const long long token = ct->slot[r] / p.topk;
        if (p.fp8) { /* x^: the token's codes and scales, from its owner's window */
            const char *window = p.peers[peer];
            copy_fp8_row(p.ring_x, p.ring_xs, ring0 + r, (const uint16_t *)(window + p.off_x),
                         (const float *)(window + p.off_xs), token, p.hidden);
            continue;
        }
        const uint16_t *src = (const uint16_t *)input_row_base(p, peer, p.off_x, p.x) + token * p.hidden;
        copy_row(p.ring_x + (ring0 + r) * p.hidden, src, p.hidden);
    }
}

/* The tile's expert outputs into their owners' (token, slot) rows, one warp per row. Not on one
 * rank: there the down tiles write them in place (fwd_epilogue; mok__plan_in_place) and the list
 * has no COMBINE. */
static __device__ void run_combine(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
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
    /* FP8: q's ring_x holds its codes, then their scales (pass_params) */
    float *ring_xs = (float *)(p.peers[q] + p.off_ring_x + (size_t)(p.ring_rows * p.hidden));
    const uint16_t *x = p.x;
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        if (ct->peer[r] != p.rank) continue;
        const long long token = ct->slot[r] / p.topk;
        if (p.fp8) copy_fp8_row(ring_x, ring_xs, ring0 + r, x, p.xs, token, p.hidden);
        else copy_row(ring_x + (ring0 + r) * p.hidden, x + token * p.hidden, p.hidden);
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
        use_tma_k(p, op, MAP_RING_H, t.ring0, MAP_W_DOWN, row);
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
        use_tma_k(p, op, MAP_SH_H, t0, MAP_S_DOWN, nt * p.n_tile_h);
        return 1;
    }
    default: return 0;
    }
}

/* The FP8 GEMM of a compute task (fwd_gemm's, on x^, h^ and the weights' codes; tile_operands.cuh:
 * E4M3 operands counted in pairs of codes, so K = H is H / 2 pairs). */
static __device__ int fwd_gemm_fp8(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                                   const task_prep &tp, int i, tile_operands *op) {
    if (i > 0) return 0;
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter;
    *op = tile_operands{};
    switch (span.kind) {
    case MOK_TASK_GATEUP:
    case MOK_TASK_SHARED_UP: {
        const bool routed = span.kind == MOK_TASK_GATEUP;
        const long long n0 = nt * p.n_tile;
        long long a_row, w_row;
        if (routed) {
            const tile_info t = tp.tile;
            a_row = t.ring0;
            w_row = t.expert * I + n0;
            op->a = p.ring_x + a_row * (H / 2);
            op->sa = p.ring_xs + a_row * (H / MOK_FP8_BLOCK);
            op->a_rows = t.nreal;
        } else {
            a_row = rt * MOK_ROW_TILE;
            w_row = n0;
            op->a = p.x + a_row * (H / 2);
            op->sa = p.xs + a_row * (H / MOK_FP8_BLOCK);
            op->a_rows = (int)(p.num_tokens - a_row < MOK_ROW_TILE ? p.num_tokens - a_row : MOK_ROW_TILE);
        }
        const int g = routed ? MOK_FP8_W_GATE : MOK_FP8_S_GATE, u = routed ? MOK_FP8_W_UP : MOK_FP8_S_UP;
        op->lda = op->ldb = op->k = H / 2;
        op->sa_ld = H / MOK_FP8_BLOCK;
        op->b_lo = (const uint16_t *)(p.wq[g] + w_row * H);
        op->b_hi = (const uint16_t *)(p.wq[u] + w_row * H);
        op->n_valid = 2 * p.n_tile;
        op->b_split = p.n_tile / 64;
        fp8_b_scales(op, p.wqs[g], w_row, p.wqs[u], w_row, H / MOK_FP8_BLOCK);
        if (routed) use_tma_k(p, op, MAP_RING_X, a_row, MAP_W_GATE, w_row, MAP_W_UP, w_row);
        else use_tma_k(p, op, MAP_X, a_row, MAP_S_GATE, w_row, MAP_S_UP, w_row);
        return 1;
    }
    case MOK_TASK_DOWN:
    case MOK_TASK_SHARED_DOWN: {
        const bool routed = span.kind == MOK_TASK_DOWN;
        const long long inter = routed ? I : Is, h0 = nt * p.n_tile_h;
        long long a_row, w_row;
        if (routed) {
            const tile_info t = tp.tile;
            if (t.nreal == 0) return 0;
            a_row = t.ring0;
            w_row = t.expert * H + h0;
            op->a = p.ring_h + a_row * (I / 2);
            op->sa = p.ring_hs + a_row * (I / MOK_FP8_BLOCK);
            op->a_rows = t.nreal;
        } else {
            a_row = rt * MOK_ROW_TILE;
            w_row = h0;
            op->a = p.sh_h + a_row * (Is / 2);
            op->sa = p.sh_hs + a_row * (Is / MOK_FP8_BLOCK);
            op->a_rows = (int)(p.num_tokens - a_row < MOK_ROW_TILE ? p.num_tokens - a_row : MOK_ROW_TILE);
        }
        const int d = routed ? MOK_FP8_W_DOWN : MOK_FP8_S_DOWN;
        op->lda = op->ldb = op->k = inter / 2;
        op->sa_ld = inter / MOK_FP8_BLOCK;
        op->b_lo = (const uint16_t *)(p.wq[d] + w_row * inter);
        op->n_valid = p.n_tile_h;
        op->b_split = p.n_tile_h / 64;
        fp8_b_scales(op, p.wqs[d], w_row, nullptr, 0, inter / MOK_FP8_BLOCK);
        if (routed) use_tma_k(p, op, MAP_RING_H, a_row, MAP_W_DOWN, w_row);
        else use_tma_k(p, op, MAP_SH_H, a_row, MAP_S_DOWN, w_row);
        return 1;
    }
    default: return 0;
    }
}

/* Consumers: SwiGLU (h, and g|u into the context) or the down projection's tile, both through
 * the staging tile in 16-byte chunks (swiglu_staged, store_staged; they sync the consumers), or
 * with p.direct_rows the down tile's rows straight from the accumulators (store_direct), which
 * leaves the staging region alone and so does not wait for it. The walk's closing barrier orders
 * the stores before the release. */
template <bool FP8>
static __device__ __forceinline__ void fwd_epilogue(const pass_params &p, const mok_task_span &span, long long rt,
                                    long long nt, const task_prep &tp, float (&acc)[TILE_ACC], uint16_t *staging,
                                    const CUtensorMap *maps) {
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter;
    const handoff_view hv = handoff_of(staging);
    const bool down = span.kind == MOK_TASK_DOWN || span.kind == MOK_TASK_SHARED_DOWN;
    if (!FP8 && p.handoff && !(down && p.direct_rows)) {
        /* every path below but the direct down rows writes the staging region: warps 1-3 must
           have read the last handed-off tile from it, and the TMA stores of a gate|up tile's g|u
           (issued by thread 0) too */
        if (threadIdx.x == PRODUCER_THREADS) bulk_wait_read();
        handoff_wait(hv, p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT, p.error, p.timeout_ns);
        consumer_sync();
    }
    switch (span.kind) {
    case MOK_TASK_GATEUP:
    case MOK_TASK_SHARED_UP: { /* one call site per width for both: the SwiGLU is most of the kernel's code */
        const bool routed = span.kind == MOK_TASK_GATEUP;
        const long long inter = routed ? I : Is;
        int rows;
        long long ctx_row0, ctx_rows, h_row;
        uint16_t *ctx, *h;
        float *hs;
        if (routed) {
            const tile_info t = tp.tile;
            rows = t.nreal;
            ctx_row0 = t.row0;
            ctx_rows = p.context_rows;
            ctx = p.context;
            h_row = t.ring0;
            h = p.ring_h;
            hs = p.ring_hs;
        } else {
            const long long t0 = rt * MOK_ROW_TILE;
            rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
            ctx_row0 = t0;
            ctx_rows = t0 + rows;
            ctx = p.context_shared;
            h_row = t0;
            h = p.sh_h;
            hs = p.sh_hs;
        }
        if constexpr (FP8) /* h^ = Q(h): codes [., inter] then scales [., inter / 128] (n_tile = 128) */
            swiglu_staged<128, true>(acc, rows, ctx_row0, ctx_rows, ctx, 2 * inter, inter, nt * 128,
                                     (uint8_t *)h + h_row * inter, inter, p.limit, staging,
                                     hs + h_row * (inter / MOK_FP8_BLOCK), inter / MOK_FP8_BLOCK);
        else if (p.handoff) { /* h to warps 1-3, g|u out by TMA (the map's rows bound what is kept) */
            const bool keep = ctx && ctx_row0 < ctx_rows;
            const CUtensorMap *cm = keep ? maps + (routed ? MAP_CTX : MAP_SH_CTX) : nullptr;
            if (p.n_tile == 128)
                swiglu_handoff<128>(acc, rows, (int)ctx_row0, cm, (int)inter, (int)(nt * 128), h + h_row * inter,
                                    inter, staging, hv);
            else
                swiglu_handoff<64>(acc, rows, (int)ctx_row0, cm, (int)inter, (int)(nt * 64), h + h_row * inter, inter,
                                   staging, hv);
        } else if (p.n_tile == 128)
            swiglu_staged<128>(acc, rows, ctx_row0, ctx_rows, ctx, 2 * inter, inter, nt * 128, h + h_row * inter, inter,
                               p.limit, staging);
        else
            swiglu_staged<64>(acc, rows, ctx_row0, ctx_rows, ctx, 2 * inter, inter, nt * 64, h + h_row * inter, inter,
                              p.limit, staging);
        break;
    }
    case MOK_TASK_DOWN:
    case MOK_TASK_SHARED_DOWN: {
        if (span.kind == MOK_TASK_SHARED_DOWN) {
            const long long t0 = rt * MOK_ROW_TILE;
            const int rows = (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
            hidden_rows(p, nt, acc, rows, p.sh_out + t0 * H, staging);
            break;
        }
        const tile_info t = tp.tile;
        if (outputs_in_place(p)) {
            /* in place: each row straight into its (token, slot) row of
               the combine buffer, where run_combine would copy it from the ring; the rows <
               nreal of a tile are real, each with its own slot */
            const mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
            hidden_rows<true>(p, nt, acc, t.nreal, (uint16_t *)(p.peers[p.rank] + p.off_comb), staging,
                              v.row_slot + t.row0);
        } else {
            hidden_rows(p, nt, acc, t.nreal, p.ring_y + t.ring0 * H, staging);
        }
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

template <bool FP8_>
struct forward_compute {
    static constexpr int VARIANTS = 1; /* K-major operands only */
    static constexpr bool FP8 = FP8_;  /* the FP8 function's GEMMs and epilogues (include/mok.h) */
    static constexpr bool HANDOFF = !FP8_; /* bf16: the gate|up tiles' h (warps 1-3) */
    static __device__ void prepare(const pass_params &p, const mok_sched_view &v, const mok_task_span &span,
                                   long long rt, long long, task_prep *tp) {
        if (span.kind == MOK_TASK_GATEUP || span.kind == MOK_TASK_DOWN) tp->tile = row_tile(p, v, rt);
    }
    static __device__ int gemm(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                               const task_prep &tp, int i, tile_operands *op) {
        if constexpr (FP8) return fwd_gemm_fp8(p, span, rt, nt, tp, i, op);
        else return fwd_gemm(p, span, rt, nt, tp, i, op);
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
                                    const CUtensorMap *maps) {
        fwd_epilogue<FP8>(p, span, rt, nt, tp, acc, staging, maps);
    }
    static __device__ void handed(const pass_params &p, const tile_handoff &ho, const uint16_t *staging, int part) {
        swiglu_handed(ho, staging, p.limit, part, HANDOFF_PARTS);
    }
    static __device__ void plain(const pass_params &, const mok_task_span &, long long, long long,
                                 const task_prep &) {}
};

template <bool FP8>
__global__ void __launch_bounds__(COMPUTE_THREADS, 1) forward_kernel(pass_params p, const __grid_constant__ pass_maps maps) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const long long entry = TRACE_ON(p) ? globaltimer_ns() : 0;
    __shared__ long long s_entry_cycles; /* config.trace: thread 0's clock64 at entry (shared, not a
                                            register held through the kernel) */
    if (TRACE_ON(p) && threadIdx.x == 0) s_entry_cycles = clock64();
    int comm;
    if (pass_start(p, &comm)) return;
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    stream_spans(p, v, smem_raw);
    if (blockIdx.x < comm) walk_tasks<forward_comm>(p, v, (uint16_t *)smem_raw); /* comm_tile */
    else walk_compute<forward_compute<FP8>>(p, v, smem_raw, nullptr, maps.m);
    if (TRACE_ON(p)) {
        __syncthreads();
        if (threadIdx.x == 0) trace_resident(p, entry, s_entry_cycles, comm);
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
    /* the contexts' g|u, stored in 128-row boxes (swiglu_handoff); rows past a map's end are not kept */
    mask |= (unsigned)tma_encode(&maps->m[MAP_CTX], p->context, p->context_rows, 2 * I, 128) << MAP_CTX;
    mask |= (unsigned)tma_encode(&maps->m[MAP_SH_CTX], Is ? p->context_shared : NULL, T, 2 * Is, 128) << MAP_SH_CTX;
    return mask | weight_maps(p, maps);
}

/* The same for an FP8 pass: the E4M3 matrices seen as bf16-sized pairs of codes ([rows, cols / 2],
 * boxes of 64 pairs: a 128-byte row of 128 codes, tile_operands.cuh), the weights' codes in place
 * of the bf16 weights. */
static unsigned forward_maps_fp8(const cuda_rank *R, const pass_params *p, pass_maps *maps) {
    const long long H = p->hidden, I = p->inter, Is = p->shared_inter, E = p->num_local_experts;
    const long long ring = p->ring_rows, T = p->num_tokens;
    unsigned mask = 0;
    memset(maps, 0, sizeof *maps);
    if (!R->tuning.tma) return 0;
    const struct {
        int map;
        const void *ptr;
        long long rows, cols;
    } all[] = {{MAP_RING_X, R->ring_x, ring, H},
               {MAP_RING_H, R->ring_h, ring, I},
               {MAP_X, p->x, T, H},
               {MAP_SH_H, Is ? R->sh_h : NULL, T, Is},
               {MAP_W_GATE, p->wq[MOK_FP8_W_GATE], E * I, H},
               {MAP_W_UP, p->wq[MOK_FP8_W_UP], E * I, H},
               {MAP_W_DOWN, p->wq[MOK_FP8_W_DOWN], E * H, I},
               {MAP_S_GATE, Is ? p->wq[MOK_FP8_S_GATE] : NULL, Is, H},
               {MAP_S_UP, Is ? p->wq[MOK_FP8_S_UP] : NULL, Is, H},
               {MAP_S_DOWN, Is ? p->wq[MOK_FP8_S_DOWN] : NULL, H, Is}};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        mask |= (unsigned)tma_encode(&maps->m[all[i].map], all[i].ptr, all[i].rows, all[i].cols / 2, 64) << all[i].map;
    return mask;
}

/* Whether a bf16 forward hands its gate|up tiles' h to warps 1-3 (compute_walk.cuh, NOTE
 * (handoff)): the tuning's handoff where every map its tasks use is usable, so warp 0 alone loads
 * every stage and the contexts' g|u go out by TMA; else 0. */
static int forward_handoff(const cuda_rank *R, const pass_params *p) {
    unsigned need = 1u << MAP_RING_X | 1u << MAP_RING_H | 1u << MAP_W_GATE | 1u << MAP_W_UP | 1u << MAP_W_DOWN |
                    1u << MAP_CTX;
    if (p->shared_inter)
        need |= 1u << MAP_X | 1u << MAP_SH_H | 1u << MAP_S_GATE | 1u << MAP_S_UP | 1u << MAP_S_DOWN | 1u << MAP_SH_CTX;
    return (p->tma_mask & need) == need ? R->tuning.handoff : 0;
}

/* An FP8 pass's buffers (pass_params): x^ in this rank's window (quantized there before the pass,
 * where the peers' dispatch reads it), the scales beside the codes in the rings, the weights from
 * the caller's fp8_weights (mok_fp8_layout). */
static void pass_params_fp8(pass_params *p, const mok_workspace *ws, const cuda_rank *R, const void *fp8_weights) {
    const cuda_workspace *cw = (const cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    const size_t ring = (size_t)ws->config.ring_rows, T = (size_t)s->max_tokens;
    p->x = (const uint16_t *)(R->sym + cw->sym.x);
    p->off_xs = cw->sym.x + T * (size_t)s->hidden;
    p->xs = (const float *)(R->sym + p->off_xs);
    p->ring_xs = (float *)((char *)R->ring_x + ring * (size_t)s->hidden);
    p->ring_hs = (float *)((char *)R->ring_h + ring * (size_t)s->intermediate);
    p->sh_hs = (float *)((char *)R->sh_h + T * (size_t)s->shared_intermediate);
    pass_params_fp8_weights(p, ws, fp8_weights);
}

extern "C" mok_status mok__cuda_forward(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    const int fp8 = s->precision == MOK_PRECISION_FP8;
    int previous = 0;
    cudaGetDevice(&previous);
    int current = previous;
    const size_t smem = COMPUTE_SMEM_BYTES;
    const void *kernel = fp8 ? (const void *)forward_kernel<true> : (const void *)forward_kernel<false>;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_forward_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cuda_use_device(R->device, &current));
        CUDA_TRY(cuda_kernel_smem(R, fp8 ? CUDA_ATTR_FORWARD_FP8 : CUDA_ATTR_FORWARD, kernel, smem));
        pass_params p;
        /* a recompute pass turns no transfer: it refills the ring by its own pulls (core/tasks.inc) */
        pass_params_init(&p, ws, R, a->num_tokens, a->schedule, recompute ? MOK_PASS_RECOMPUTE : MOK_PASS_FORWARD);
        /* gate|up tasks: n_tile columns of I each of gate and up, 2 n_tile columns of the tile */
        p.n_tile = R->tuning.cols_gateup;
        pass_params_comm(&p, R, ws->config.fwd_comm_sms, 0);
        pass_params_layer(&p, ws, a->x, a->w_gate, a->w_up, a->w_down, a->s_gate, a->s_up, a->s_down, a->context);

        pass_maps maps;
        if (fp8) {
            if (p.n_tile != MOK_FP8_BLOCK) /* the gate|up epilogue quantizes whole 128-blocks of h */
                return mok__fail(MOK_ERR_INTERNAL, "FP8 forward: gate|up tiles of %d columns, not 128", p.n_tile);
            /* x^ = Q(x) once, into this rank's window: its own tiles and the peers' dispatch read it */
            pass_params_fp8(&p, ws, R, a->fp8_weights);
            st = mok__cuda_fp8_quantize_rows((const uint16_t *)a->x, a->num_tokens, s->hidden, (uint8_t *)p.x, s->hidden,
                                             (float *)p.xs, s->hidden / MOK_FP8_BLOCK, R->num_sms, stream);
            if (st != MOK_OK) return st;
            p.tma_mask = forward_maps_fp8(R, &p, &maps);
        } else {
            if (a->num_tokens > 0 && ws->group->nranks > 1) /* the peers' copy (input_row_base) */
                CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.x, a->x, (size_t)(a->num_tokens * s->hidden) * 2,
                                         cudaMemcpyDeviceToDevice, stream));
            p.tma_mask = forward_maps(R, &p, &maps);
            p.handoff = forward_handoff(R, &p);
        }
        st = mok__cuda_launch_pass(ws, lr, R, &p, kernel, COMPUTE_THREADS, smem, stream, a->num_tokens, &maps);
        if (st != MOK_OK) return st;
        if (!recompute && a->num_tokens > 0)
            st = mok__cuda_forward_slot_sums(p, R->num_sms, a->router_w, (uint16_t *)a->y, R->sym + cw->sym.comb,
                                             stream);
        if (st != MOK_OK) return st;
    }
    cuda_use_device(previous, &current);
    return MOK_OK;
}
