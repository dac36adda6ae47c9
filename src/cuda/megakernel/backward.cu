/* backward.cu — the backward megakernel, the same design as the forward (forward.cu): comm CTAs
 * pull dy rows, their router weights and the x rows from the tokens' owners into the ring and
 * push each routed row's dx part and router-weight gradient back into its owner's per-(token,
 * slot) buffers; compute CTAs run the shared expert's backward, then per minibatch dy·W_down
 * with the SwiGLU backward and the router-weight dot (replaying g, u where the context does not
 * keep them), the dx GEMM, and after each macrobatch the weight-gradient tiles.
 *
 * Rounding points (as src/cpu/tasks_bwd.c): dh = w · (dy·W_down) in fp32; d_router_w =
 * <dy·W_down, h> summed in a fixed order; dg, du and dx parts rounded to bf16; the down
 * projection's weight gradient uses bf16(w · dy) (made once, by the pull).
 *
 * Buffer ownership: ring rows of a row tile are written by its PULL (dy, w·dy, x, w), DH (h,
 * dg|du, router partials, replayed g|u) and DX (dx part, in ring_y) and read by later tasks of the
 * same tile and by its macrobatch's weight gradients; a PULL refills a slot only after the PUSH
 * and the weight gradients of its previous occupant. One CTA owns a weight-gradient tile for a
 * macrobatch and carries the fp32 accumulator to the next one through the caller's fp32 buffer
 * (accumulate) or a carry slot, so sums run over an expert's rows in schedule order. */
#include "cuda/megakernel/comm_walk.cuh"
#include "cuda/megakernel/swiglu.cuh"
#include "cuda/megakernel/wgrad.cuh"

/* Whether the tasks of row tile rt replay g|u (its rows lie past the context's). */
static __device__ __forceinline__ bool tile_replays(const pass_params &p, long long rt) {
    return rt * MOK_ROW_TILE >= p.context_rows;
}

/* FP8: the token's dy^ code row in rank peer's window, or NULL where the pass has none there
 * (pass_params.dyq_ld: the pull quantizes dy itself). */
static __device__ __forceinline__ const uint8_t *dyq_row(const pass_params &p, int peer, long long token) {
    return p.dyq_ld ? (const uint8_t *)(p.peers[peer] + p.off_dyq) + token * p.dyq_ld : nullptr;
}

/* Per ring row, one warp: x and dy of its (peer, token) pair, w·dy beside dy and the router
 * weight (FP8: bf16(x^) from the peer's x^, x^ itself when the tile replays, dy^;
 * backward_fp8.cuh); the tile's padding rows of x and w·dy are written as zeros, which the weight
 * gradients' 64-row slices add as nothing. */
template <bool FP8>
static __device__ void run_pull(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
    comm_tile_load(ct, v, rt);
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    const bool replay = tile_replays(p, rt);
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const int peer = ct->peer[r];
        const long long ring = ring0 + r;
        if (peer < 0) { /* a padding row */
            zero_pad_row(p.ring_x + ring * p.hidden, p.ring_dyw + ring * p.hidden, p.hidden);
            continue;
        }
        const long long slot = ct->slot[r], token = slot / p.topk;
        const float w = ((const float *)input_row_base(p, peer, p.off_router_w, p.router_w))[slot];
        const uint16_t *dy = (const uint16_t *)input_row_base(p, peer, p.off_dy, p.dy) + token * p.hidden;
        if constexpr (FP8)
            pull_row_fp8(p.ring_x + ring * p.hidden, replay ? (uint8_t *)(p.ring_y + ring * p.hidden) : nullptr,
                         p.ring_dyw + ring * p.hidden, (uint8_t *)(p.ring_dy + ring * p.hidden),
                         (const uint8_t *)(p.peers[peer] + p.off_x) + token * p.hidden,
                         (const float *)(p.peers[peer] + p.off_xs) + token * (p.hidden / MOK_FP8_BLOCK), dy,
                         dyq_row(p, peer, token), w, p.hidden);
        else
            pull_row(p.ring_x + ring * p.hidden, p.ring_dy + ring * p.hidden, p.ring_dyw + ring * p.hidden,
                     (const uint16_t *)input_row_base(p, peer, p.off_x, p.x) + token * p.hidden, dy, w, p.hidden);
        if (lane == 0) p.ring_w[ring] = w;
    }
}

/* Each ring row's dx part into its owner's (token, slot) row, and its d_router_w (the sum of the
 * dh tiles' partial dot products, in column order), one warp per row. Not on one rank: there the
 * dx tiles write both in place (dx_epilogue; mok__plan_in_place) and the list has no PUSH. */
static __device__ void run_push(const pass_params &p, const mok_sched_view &v, long long rt, comm_tile *ct) {
    comm_tile_load(ct, v, rt);
    const long long nI = p.inter / p.rdot_cols, ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const int peer = ct->peer[r];
        if (peer < 0) break; /* padding: the rest of the tile */
        const long long slot = ct->slot[r], ring = ring0 + r;
        dx_row_out((uint16_t *)(p.peers[peer] + p.off_dxbuf) + slot * p.hidden,
                   (float *)(p.peers[peer] + p.off_drw) + slot, p.ring_y + ring * p.hidden,
                   p.ring_rdot + ring * (p.inter / 64), nI, p.hidden);
    }
}

/* ---- turned transfers (docs/design.md §2.4a): this rank's rows of peer q's row tile rt, found
 * through q's copy of its schedule in q's window, one warp per row. */

/* dispatch_pull: q's dx parts and router-weight gradients of this rank's (token, slot) rows, from
 * q's ring into this rank's buffers (after q's dx tiles of rt, so its dh tiles too: the GATHER's
 * wait); the partial sums in the order of run_push. */
static __device__ void run_gather(const pass_params &p, int q, long long rt, comm_tile *ct) {
    comm_tile_load(ct, mok__sched_view(&p.layout, p.peers[q] + p.off_sched), rt);
    const uint16_t *ring_y = (const uint16_t *)(p.peers[q] + p.off_ring_y);
    const float *rdot = (const float *)(p.peers[q] + p.off_ring_rdot);
    uint16_t *dxbuf = (uint16_t *)(p.peers[p.rank] + p.off_dxbuf);
    float *drw = (float *)(p.peers[p.rank] + p.off_drw);
    const long long nI = p.inter / p.rdot_cols;
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const long long ring = ring0 + r;
        if (ct->peer[r] != p.rank) continue;
        const long long slot = ct->slot[r];
        dx_row_out(dxbuf + slot * p.hidden, drw + slot, ring_y + ring * p.hidden, rdot + ring * (p.inter / 64), nI,
                   p.hidden);
    }
}

/* combine_push: this rank's x and dy rows, bf16(w * dy) and the router weights into q's ring
 * (after q opened the minibatch: the SCATTER's wait), what q's PULL of the tile would have
 * written; the SCATTER of q into its own tile also writes the padding rows' zeros. */
template <bool FP8>
static __device__ void run_scatter(const pass_params &p, int q, long long rt, comm_tile *ct) {
    comm_tile_load(ct, mok__sched_view(&p.layout, p.peers[q] + p.off_sched), rt);
    char *dst = p.peers[q];
    uint16_t *ring_x = (uint16_t *)(dst + p.off_ring_x), *ring_dy = (uint16_t *)(dst + p.off_ring_dy);
    uint16_t *ring_dyw = (uint16_t *)(dst + p.off_ring_dyw), *ring_y = (uint16_t *)(dst + p.off_ring_y);
    float *ring_w = (float *)(dst + p.off_ring_w);
    const bool replay = tile_replays(p, rt); /* context_rows is the group's */
    const uint16_t *x = p.x, *dy = p.dy;
    const float *router_w = p.router_w;
    const int lane = threadIdx.x & 31;
    const long long ring0 = rt * MOK_ROW_TILE % p.ring_rows;
    for (int r = threadIdx.x >> 5; r < MOK_ROW_TILE; r += blockDim.x / 32) {
        const long long ring = ring0 + r;
        const int src = ct->peer[r];
        if (src == p.rank) {
            const long long slot = ct->slot[r], token = slot / p.topk;
            const float w = router_w[slot];
            if constexpr (FP8)
                pull_row_fp8(ring_x + ring * p.hidden, replay ? (uint8_t *)(ring_y + ring * p.hidden) : nullptr,
                             ring_dyw + ring * p.hidden, (uint8_t *)(ring_dy + ring * p.hidden),
                             (const uint8_t *)(p.peers[p.rank] + p.off_x) + token * p.hidden,
                             (const float *)(p.peers[p.rank] + p.off_xs) + token * (p.hidden / MOK_FP8_BLOCK),
                             dy + token * p.hidden, dyq_row(p, p.rank, token), w, p.hidden);
            else
                pull_row(ring_x + ring * p.hidden, ring_dy + ring * p.hidden, ring_dyw + ring * p.hidden,
                         x + token * p.hidden, dy + token * p.hidden, w, p.hidden);
            if (lane == 0) ring_w[ring] = w;
        } else if (src < 0 && q == p.rank) {
            zero_pad_row(ring_x + ring * p.hidden, ring_dyw + ring * p.hidden, p.hidden);
        }
    }
}

/* ---- compute tasks (consumer side of compute_walk.cuh) ------------------------------------------ */

static __device__ __forceinline__ int token_rows(const pass_params &p, long long t0) {
    return (int)(p.num_tokens - t0 < MOK_ROW_TILE ? p.num_tokens - t0 : MOK_ROW_TILE);
}

/* Producer thread 0, once per task: what the roles need of the schedule (task_prep). */
static __device__ void bwd_prepare(const pass_params &p, const mok_sched_view &v, const mok_task_span &span, long long rt,
                                   long long nt, task_prep *tp) {
    switch (span.kind) {
    case MOK_TASK_DH:
    case MOK_TASK_DX: tp->tile = row_tile(p, v, rt); break;
    case MOK_TASK_WGRAD:
    case MOK_TASK_SHARED_WGRAD: wgrad_prepare(p, v, span, nt, tp); break;
    default: break;
    }
}

/* dy · W_down^T: A K-major, W_down read N-major. */
static __device__ __forceinline__ void dh_common(tile_operands *op, long long H, int n_tile) {
    op->lda = H;
    op->n_valid = n_tile;
    op->k_split = 1ll << 62;
    op->k = op->k_valid = H;
}

/* GEMM i of a compute task; 1 + operand layout (compute_walk.cuh), 0 when there is none. A routed dh
 * task whose g|u the context does not keep replays them first (one K-major GEMM per 64 columns). */
static __device__ int bwd_gemm(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                               const task_prep &tp, int i, tile_operands *op) {
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter;
    *op = tile_operands{};
    switch (span.kind) {
    case MOK_TASK_DH: {
        const tile_info t = tp.tile;
        if (t.nreal == 0) return 0;
        const int replays = t.row0 < p.context_rows ? 0 : p.n_tile / 64;
        if (i < replays) { /* g|u for columns [n0 + 64 i, + 64), as the forward's GATEUP */
            const long long n0 = nt * p.n_tile + 64 * i;
            op->a = p.ring_x + t.ring0 * H;
            op->lda = op->ldb = op->k = H;
            op->a_rows = t.nreal;
            op->b_lo = p.w_gate + ((long long)t.expert * I + n0) * H;
            op->b_hi = p.w_up + ((long long)t.expert * I + n0) * H;
            op->n_valid = 128; /* 64 gate rows, then 64 up rows: columns 128.. are discarded */
            op->b_split = 1;
            use_tma_k(p, op, MAP_RING_X, t.ring0, MAP_W_GATE, t.expert * I + n0, MAP_W_UP, t.expert * I + n0);
            return 1;
        }
        if (i > replays) return 0;
        op->a = p.ring_dy + t.ring0 * H;
        op->a_rows = t.nreal;
        op->b_lo = p.w_down + (long long)t.expert * H * I + nt * p.n_tile;
        op->ldb = I;
        dh_common(op, H, p.n_tile);
        use_tma_n(p, op, MAP_RING_DY, t.ring0, MAP_W_DOWN, (long long)t.expert * H, nt * p.n_tile, p.n_tile / 64);
        return 2;
    }
    case MOK_TASK_SHARED_DH: {
        if (i > 0) return 0;
        const long long t0 = rt * MOK_ROW_TILE;
        op->a = p.dy + t0 * H;
        op->a_rows = token_rows(p, t0);
        op->b_lo = p.s_down + nt * p.n_tile;
        op->ldb = Is;
        dh_common(op, H, p.n_tile);
        use_tma_n(p, op, MAP_DY, t0, MAP_S_DOWN, 0, nt * p.n_tile, p.n_tile / 64);
        return 2;
    }
    case MOK_TASK_DX:
    case MOK_TASK_SHARED_DX: {
        if (i > 0) return 0;
        const bool shared = span.kind == MOK_TASK_SHARED_DX;
        const long long inter = shared ? Is : I, n0 = nt * p.n_tile_h;
        op->lda = 2 * inter;
        op->ldb = H;
        op->n_valid = p.n_tile_h;
        op->k_split = inter;
        op->k = op->k_valid = 2 * inter;
        if (shared) {
            const long long t0 = rt * MOK_ROW_TILE;
            op->a = p.sh_dgu + t0 * 2 * Is;
            op->a_rows = token_rows(p, t0);
            op->b_lo = p.s_gate + n0;
            op->b_hi = p.s_up + n0;
            use_tma_n(p, op, MAP_SH_DGU, t0, MAP_S_GATE, 0, MAP_S_UP, 0, n0, p.n_tile_h / 64);
        } else {
            const tile_info t = tp.tile;
            if (t.nreal == 0) return 0;
            op->a = p.ring_dgu + t.ring0 * 2 * I;
            op->a_rows = t.nreal;
            op->b_lo = p.w_gate + (long long)t.expert * I * H + n0;
            op->b_hi = p.w_up + (long long)t.expert * I * H + n0;
            use_tma_n(p, op, MAP_RING_DGU, t.ring0, MAP_W_GATE, (long long)t.expert * I, MAP_W_UP,
                      (long long)t.expert * I, n0, p.n_tile_h / 64);
        }
        return 2;
    }
    case MOK_TASK_WGRAD:
    case MOK_TASK_SHARED_WGRAD: return wgrad_gemm(p, span, tp, i, op);
    default: return 0;
    }
}

/* The operand layouts of bwd_gemm's GEMMs (compute_walk.cuh: 2 A_MN + B_MN, bwd_gemm returns 1 + it):
 * a dh task's replay of g|u is K/K, the dgrad GEMMs (dh, dx, routed and shared) K/N-major, the
 * weight gradients M/N-major. bwd_epilogue compiles for layout VAR only the kinds whose GEMMs
 * have it. bwd_preset keeps its runtime test of the kind: pruned by VAR, it let ptxas see zero
 * accumulators and serialise the wgmmas (C7512). */
#define BWD_VAR_REPLAY 0
#define BWD_VAR_DGRAD 1
#define BWD_VAR_WGRAD 3

/* A dh task's GEMM i < replays: g|u of 64 columns into the replay rows. */
static __device__ __forceinline__ void replay_epilogue(const pass_params &p, long long nt, const task_prep &tp, int i,
                                                       float (&acc)[TILE_ACC], uint16_t *c, int tid) {
    const long long I = p.inter;
    const tile_info t = tp.tile;
    uint16_t *ring_gu = p.ring_gu + t.ring0 * 2 * I;
    const long long n0 = nt * p.n_tile + 64 * i;
    stage_bf16(c, acc);
    for (int idx = tid; idx < t.nreal * 16; idx += CONSUMER_THREADS) {
        int r = idx >> 4, c8 = (idx & 15) * 8;
        uint16_t *dst = ring_gu + r * 2 * I + (c8 < 64 ? n0 + c8 : I + n0 + c8 - 64);
        *(int4 *)dst = *(const int4 *)(c + r * TILE_C_LD + c8);
    }
}

/* The SwiGLU backward of a routed or shared dh tile (one call site for both: this epilogue is the
 * kernel's largest code). */
static __device__ __forceinline__ void dh_epilogue(const pass_params &p, const mok_task_span &span, long long rt,
                                                   long long nt, const task_prep &tp, float (&acc)[TILE_ACC],
                                                   uint16_t *c) {
    const long long I = p.inter, Is = p.shared_inter;
    const bool routed = span.kind == MOK_TASK_DH;
    const long long inter = routed ? I : Is;
    int rows;
    const uint16_t *gu;
    const float *w = nullptr;
    uint16_t *h, *dgu;
    float *rdot = nullptr;
    if (routed) {
        const tile_info t = tp.tile;
        rows = t.nreal;
        /* rows past the context had their g|u replayed into the ring by GEMMs i < this one */
        gu = t.row0 >= p.context_rows ? p.ring_gu + t.ring0 * 2 * I : p.context + t.row0 * 2 * I;
        w = p.ring_w + t.ring0;
        h = p.ring_h + t.ring0 * I;
        dgu = p.ring_dgu + t.ring0 * 2 * I;
        rdot = p.ring_rdot + t.ring0 * (I / 64) + nt;
    } else {
        const long long t0 = rt * MOK_ROW_TILE;
        rows = token_rows(p, t0);
        gu = p.context_shared + t0 * 2 * Is;
        h = p.sh_h + t0 * Is;
        dgu = p.sh_dgu + t0 * 2 * Is;
    }
    swiglu_backward_epilogue(acc, rows, p.n_tile, gu, 2 * inter, inter, nt * p.n_tile, w, p.limit, h, inter, dgu,
                             2 * inter, rdot, I / 64, c, routed);
}

/* Whether a backward epilogue leaves the staging region alone (dx rows with p.direct_rows), and so
 * need not wait for what still reads it. */
static __device__ __forceinline__ bool bwd_direct(const pass_params &p, const mok_task_span &span) {
    return p.direct_rows && (span.kind == MOK_TASK_DX || span.kind == MOK_TASK_SHARED_DX);
}

/* A routed dx tile (hidden_rows). */
static __device__ __forceinline__ void dx_epilogue(const pass_params &p, long long nt, const task_prep &tp,
                                                   float (&acc)[TILE_ACC], uint16_t *c, int tid) {
    const long long H = p.hidden, I = p.inter;
    const tile_info t = tp.tile;
    if (outputs_in_place(p)) {
        /* in place: what run_push would do, here. Each row straight into its (token, slot)
           row of the dx buffer; the first column tile's threads also sum their rows'
           d_router_w partials, which every dh tile of the row tile wrote before this task
           could start (its wait), in column order, as dx_row_out does */
        const mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
        const int32_t *slots = v.row_slot + t.row0;
        hidden_rows<true>(p, nt, acc, t.nreal, (uint16_t *)(p.peers[p.rank] + p.off_dxbuf), c, slots);
        if (nt == 0 && tid < t.nreal) {
            const float *rdot = p.ring_rdot + (t.ring0 + tid) * (I / 64);
            float sum = 0.0f;
            for (long long j = 0; j < I / p.rdot_cols; ++j) sum += rdot[j];
            ((float *)(p.peers[p.rank] + p.off_drw))[slots[tid]] = sum;
        }
        return;
    }
    hidden_rows(p, nt, acc, t.nreal, p.ring_y + t.ring0 * H, c);
}

/* A routed or shared weight-gradient tile: bf16 by TMA when whole, else through the staging region. */
static __device__ __forceinline__ void wgrad_epilogue(const pass_params &p, const mok_task_span &span,
                                                      const task_prep &tp, float (&acc)[TILE_ACC], uint16_t *c,
                                                      const CUtensorMap *maps, int tid) {
    wgrad_job w;
    wgrad_job_of(p, span, tp, &w);
    if (w.store_map >= 0 && w.m_valid == CUDA_WGRAD_M && w.n_valid == CUDA_WGRAD_N) {
        /* bf16 by TMA: the tile as four 128-row x 64-column boxes in the 128B-swizzled layout
           the loads use (swizzle(), tile_operands.cuh) over the staging region, stored while
           the consumers go on to the next task */
        uint8_t *box = (uint8_t *)c;
        const uint32_t base = (uint32_t)__cvta_generic_to_shared(box);
#pragma unroll
        for (int j = 0; j < TILE_ACC / 4; j += 2) stsm_blocks<STSM_BOXES>(acc, j, base, (tid >> 5) * 16, 0);
        fence_proxy_async();
        consumer_sync();
        if (tid == 0) {
#pragma unroll
            for (int b = 0; b < CUDA_WGRAD_N / 64; ++b)
                tma_store_2d(&maps[w.store_map], w.store_col + 64 * b, w.store_row,
                             (uint32_t)__cvta_generic_to_shared(box + b * STORE_BOX_BYTES));
            bulk_commit();
        }
    } else if (!w.carry_out && !w.dest_f32) { /* bf16 through the staging tile */
        store_staged(acc, w.m_valid, w.n_valid, (uint16_t *)w.dest, w.ld, 0, c);
    } else { /* fp32 (a carry, or accumulate mode) through the staging region */
        store_staged_f32(acc, w.m_valid, w.n_valid, w.carry_out ? w.carry_out : (float *)w.dest, w.ld, (float *)c);
    }
}

template <int VAR>
static __device__ __forceinline__ void bwd_epilogue(const pass_params &p, const mok_task_span &span, long long rt,
                                    long long nt, const task_prep &tp, int i, float (&acc)[TILE_ACC], uint16_t *c,
                                    const CUtensorMap *maps) {
    const int tid = threadIdx.x - PRODUCER_THREADS;
    /* every path below but the direct dx rows writes the staging region: the last weight-gradient
       tile's TMA stores, issued by thread 0, must have read it first */
    if (!(VAR == BWD_VAR_DGRAD && bwd_direct(p, span))) {
        if (tid == 0) bulk_wait_read();
        consumer_sync();
    }
    if (VAR == BWD_VAR_REPLAY) {
        replay_epilogue(p, nt, tp, i, acc, c, tid);
    } else if (VAR == BWD_VAR_DGRAD) {
        switch (span.kind) {
        case MOK_TASK_DH:
        case MOK_TASK_SHARED_DH: dh_epilogue(p, span, rt, nt, tp, acc, c); break;
        case MOK_TASK_DX: dx_epilogue(p, nt, tp, acc, c, tid); return; /* store_staged synced, or none used */
        case MOK_TASK_SHARED_DX: {
            const long long t0 = rt * MOK_ROW_TILE;
            hidden_rows(p, nt, acc, token_rows(p, t0), p.sh_out + t0 * p.hidden, c);
            return;
        }
        default: break;
        }
    } else if (VAR == BWD_VAR_WGRAD) {
        wgrad_epilogue(p, span, tp, acc, c, maps, tid);
    }
    consumer_sync();
}

#include "cuda/megakernel/backward_fp8.cuh" /* the FP8 GEMMs and epilogues, on the helpers above */

/* Comm CTAs run the transfers with every thread; compute CTAs are warp-specialised. */
template <bool FP8>
struct backward_comm {
    static __device__ void run(const pass_params &p, const mok_sched_view &v, const mok_task_span &span, long long rt,
                               long long, uint16_t *smem) {
        comm_tile *ct = (comm_tile *)smem;
        switch (span.kind) {
        case MOK_TASK_PULL: run_pull<FP8>(p, v, rt, ct); break;
        case MOK_TASK_PUSH: run_push(p, v, rt, ct); break;
        case MOK_TASK_GATHER: run_gather(p, span.peer, rt, ct); break;
        case MOK_TASK_SCATTER: run_scatter<FP8>(p, span.peer, rt, ct); break;
        default: break; /* OPEN: its counter is all it has */
        }
    }
};

/* The compute tasks, bf16 or FP8 (backward_fp8.cuh: its layouts are E4M3, E4M3 with B split along
 * K, and the same bf16 weight gradients). */
template <bool FP8_>
struct backward_compute {
    static constexpr bool FP8 = FP8_;
    static constexpr int VARIANTS = (1 << 0) | (1 << 1) | (1 << 3); /* bf16: K/K, K/N-major, M-major/N-major */
    static __device__ void prepare(const pass_params &p, const mok_sched_view &v, const mok_task_span &span,
                                   long long rt, long long nt, task_prep *tp) {
        bwd_prepare(p, v, span, rt, nt, tp);
    }
    static __device__ int gemm(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                               const task_prep &tp, int i, tile_operands *op) {
        if constexpr (FP8) return bwd_gemm_fp8(p, span, rt, nt, tp, i, op);
        else return bwd_gemm(p, span, rt, nt, tp, i, op);
    }
    template <int VAR>
    static __device__ void preset(const pass_params &p, const mok_task_span &span, long long, long long,
                                  const task_prep &tp, int, float (&acc)[TILE_ACC]) {
        bwd_preset<VAR>(p, span, tp, acc);
    }
    template <int VAR>
    static __device__ void epilogue(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                                    const task_prep &tp, int i, float (&acc)[TILE_ACC], uint16_t *c, float *,
                                    const CUtensorMap *maps) {
        if constexpr (FP8) bwd_epilogue_fp8<VAR>(p, span, rt, nt, tp, i, acc, c, maps);
        else bwd_epilogue<VAR>(p, span, rt, nt, tp, i, acc, c, maps);
    }
    static __device__ void plain(const pass_params &p, const mok_task_span &span, long long, long long,
                                 const task_prep &) {
        if (span.kind == MOK_TASK_WGRAD_ZERO) run_wgrad_zero(p, span.first_tile);
    }
};

template <bool FP8>
__global__ void __launch_bounds__(COMPUTE_THREADS, 1) backward_kernel(pass_params p, const __grid_constant__ pass_maps maps) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const long long entry = TRACE_ON(p) ? globaltimer_ns() : 0;
    __shared__ long long s_entry_cycles; /* config.trace: thread 0's clock64 at entry (shared, not a
                                            register held through the kernel) */
    if (TRACE_ON(p) && threadIdx.x == 0) s_entry_cycles = clock64();
    int comm;
    if (pass_start(p, &comm)) return;
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    stream_spans(p, v, smem_raw);
    if (blockIdx.x < comm) walk_tasks<backward_comm<FP8>>(p, v, (uint16_t *)smem_raw); /* comm_tile */
    else walk_compute<backward_compute<FP8>>(p, v, smem_raw, nullptr, maps.m);
    if (TRACE_ON(p)) {
        __syncthreads();
        if (threadIdx.x == 0) trace_resident(p, entry, s_entry_cycles, comm);
    }
}

/* The tensor maps of a backward pass. The weight-gradient tiles read the ring's activations
 * M/N-major in whole 64-row slices: the rows between an expert's last row and its segment's end
 * are written as zeros (pull: x, w·dy; dh: h, dg|du) so that they add nothing. An FP8 pass
 * (backward_fp8.cuh) reads its E4M3 code rows and weights as pairs of codes ([rows, cols / 2],
 * boxes of 64 pairs: a 128-byte row of 128 codes), the weights in the orientation each GEMM
 * takes: gate and up for the replay, the transposed copies for dh and dx. */
/* Both travel as kernel parameters: 4 KB before CUDA 12.1, 32,764 bytes since (sm_70 on). */
#if CUDART_VERSION >= 12010
static_assert(sizeof(pass_params) + sizeof(pass_maps) <= 32764, "the backward kernel's parameters exceed 32,764 bytes");
#else
static_assert(sizeof(pass_params) + sizeof(pass_maps) <= 4096, "the backward kernel's parameters exceed 4 KB");
#endif

static unsigned backward_maps(const cuda_rank *R, const pass_params *p, pass_maps *maps) {
    const long long H = p->hidden, I = p->inter, Is = p->shared_inter, E = p->num_local_experts;
    const long long ring = p->ring_rows, T = p->num_tokens;
    unsigned mask = 0;
    memset(maps, 0, sizeof *maps);
    if (!R->tuning.tma) return 0;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_X], R->ring_x, ring, H, 64) << MAP_RING_X;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_H], R->ring_h, ring, I, 64) << MAP_RING_H;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_DYW], R->ring_dyw, ring, H, 64) << MAP_RING_DYW;
    mask |= (unsigned)tma_encode(&maps->m[MAP_RING_DGU], R->ring_dgu, ring, 2 * I, 64) << MAP_RING_DGU;
    mask |= (unsigned)tma_encode(&maps->m[MAP_X], p->x, T, H, 64) << MAP_X;
    mask |= (unsigned)tma_encode(&maps->m[MAP_DY], p->dy, T, H, 64) << MAP_DY;
    mask |= (unsigned)tma_encode(&maps->m[MAP_SH_H], Is ? R->sh_h : NULL, T, Is, 64) << MAP_SH_H;
    mask |= (unsigned)tma_encode(&maps->m[MAP_SH_DGU], Is ? R->sh_dgu : NULL, T, 2 * Is, 64) << MAP_SH_DGU;
    if (!p->accumulate) { /* bf16 weight gradients, stored in 128-row boxes */
        mask |= (unsigned)tma_encode(&maps->m[MAP_DW_GATE], p->dw[0], E * I, H, 128) << MAP_DW_GATE;
        mask |= (unsigned)tma_encode(&maps->m[MAP_DW_UP], p->dw[1], E * I, H, 128) << MAP_DW_UP;
        mask |= (unsigned)tma_encode(&maps->m[MAP_DW_DOWN], p->dw[2], E * H, I, 128) << MAP_DW_DOWN;
        mask |= (unsigned)tma_encode(&maps->m[MAP_DS_GATE], Is ? p->ds[0] : NULL, Is, H, 128) << MAP_DS_GATE;
        mask |= (unsigned)tma_encode(&maps->m[MAP_DS_UP], Is ? p->ds[1] : NULL, Is, H, 128) << MAP_DS_UP;
        mask |= (unsigned)tma_encode(&maps->m[MAP_DS_DOWN], Is ? p->ds[2] : NULL, H, Is, 128) << MAP_DS_DOWN;
    }
    if (!p->fp8) {
        mask |= (unsigned)tma_encode(&maps->m[MAP_RING_DY], R->ring_dy, ring, H, 64) << MAP_RING_DY;
        return mask | weight_maps(p, maps);
    }
    const struct {
        int map;
        const void *ptr;
        long long rows, cols, row_bytes; /* cols in codes */
    } fp8[] = {{MAP_RING_DY, R->ring_dy, ring, H, 2 * H},
               {MAP_RING_XQ, R->ring_y, ring, H, 2 * H},
               {MAP_RING_GQ, R->ring_gu, ring, 2 * I, 4 * I},
               {MAP_SH_DYQ, Is ? p->sh_dyq : NULL, T, H, p->sh_dyq_ld},
               {MAP_SH_GQ, Is ? p->sh_gq : NULL, T, 2 * Is, p->sh_gq_ld},
               {MAP_W_GATE, p->wq[MOK_FP8_W_GATE], E * I, H, H},
               {MAP_W_UP, p->wq[MOK_FP8_W_UP], E * I, H, H},
               {MAP_W_DOWN, p->wq[MOK_FP8_W_DOWN_T], E * I, H, H},
               {MAP_W_GATE_T, p->wq[MOK_FP8_W_GATE_T], E * H, I, I},
               {MAP_W_UP_T, p->wq[MOK_FP8_W_UP_T], E * H, I, I},
               {MAP_S_GATE, Is ? p->wq[MOK_FP8_S_GATE_T] : NULL, H, Is, Is},
               {MAP_S_UP, Is ? p->wq[MOK_FP8_S_UP_T] : NULL, H, Is, Is},
               {MAP_S_DOWN, Is ? p->wq[MOK_FP8_S_DOWN_T] : NULL, Is, H, H}};
    for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; ++i)
        mask |= (unsigned)tma_encode_rows(&maps->m[fp8[i].map], fp8[i].ptr, fp8[i].rows, fp8[i].cols / 2,
                                          fp8[i].row_bytes, 64)
                << fp8[i].map;
    return mask;
}

/* An FP8 pass's inputs and buffers (backward_fp8.cuh), on the rank's stream: x^ into the window
 * (codes, then scales, as the forward's); dy^ once per token as code rows into the window's
 * combine region where they fit (mok__cuda_fp8_dyq_offset), else for a shared expert into sh_out;
 * with a shared expert bf16(x^) for its weight gradients. */
static mok_status backward_fp8_setup(mok_workspace *ws, cuda_rank *R, pass_params *p, const mok_backward_args *a,
                                     cudaStream_t stream) {
    const cuda_workspace *cw = (const cuda_workspace *)ws->impl;
    const long long H = p->hidden, T = a->num_tokens;
    pass_params_fp8_weights(p, ws, a->fp8_weights);
    /* a dh tile quantizes whole 128-blocks of h, dg and du (cols_dh is 256, 128 or 64) */
    p->n_tile = p->n_tile < MOK_FP8_BLOCK ? MOK_FP8_BLOCK : p->n_tile;
    p->rdot_cols = MOK_FP8_BLOCK;
    p->off_xs = cw->sym.x + (size_t)ws->shape.max_tokens * (size_t)H;
    uint8_t *xq = (uint8_t *)(R->sym + cw->sym.x);
    float *xs = (float *)(R->sym + p->off_xs);
    mok_status st = mok__cuda_fp8_quantize_rows((const uint16_t *)a->x, T, H, xq, H, xs, H / MOK_FP8_BLOCK, R->num_sms,
                                                stream);
    if (st != MOK_OK) return st;
    const long long dyq_off = mok__cuda_fp8_dyq_offset(ws);
    if (dyq_off >= 0) {
        p->off_dyq = cw->sym.comb + (size_t)dyq_off;
        p->dyq_ld = mok__cuda_fp8_dyq_ld(ws);
        uint8_t *dyq = (uint8_t *)(R->sym + p->off_dyq);
        st = mok__cuda_fp8_quantize_rows((const uint16_t *)a->dy, T, H, dyq, p->dyq_ld, (float *)(dyq + H),
                                         p->dyq_ld / 4, R->num_sms, stream);
        if (st != MOK_OK) return st;
        p->sh_dyq = dyq;
        p->sh_dyq_ld = p->dyq_ld;
    }
    if (p->shared_inter == 0) return MOK_OK;
    uint16_t *xhat = (uint16_t *)(R->sym + cw->sym.comb);
    p->x = xhat;
    p->sh_gq = R->sh_gq ? R->sh_gq : (uint8_t *)(R->sym + cw->sym.comb) + mok__cuda_fp8_xhat_bytes(ws);
    p->sh_gq_ld = mok__cuda_fp8_sh_gq_ld(ws);
    st = mok__cuda_fp8_dequantize_rows(xq, xs, T, H, xhat, R->num_sms, stream);
    if (st != MOK_OK || dyq_off >= 0) return st;
    p->sh_dyq = (uint8_t *)R->sh_out; /* until the shared dx tiles write there */
    p->sh_dyq_ld = 2 * H;
    return mok__cuda_fp8_quantize_rows((const uint16_t *)a->dy, T, H, p->sh_dyq, 2 * H, (float *)(p->sh_dyq + H),
                                       H / 2, R->num_sms, stream);
}

extern "C" mok_status mok__cuda_backward(mok_workspace *ws, const mok_backward_args *args) {
    mok_status st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    const int fp8 = s->precision == MOK_PRECISION_FP8;
    int previous = 0;
    cudaGetDevice(&previous);
    int current = previous;
    const size_t smem = COMPUTE_SMEM_BYTES;
    const void *kernel = fp8 ? (const void *)backward_kernel<true> : (const void *)backward_kernel<false>;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        const mok_backward_args *a = &args[lr];
        cudaStream_t stream = (cudaStream_t)a->stream;
        CUDA_TRY(cuda_use_device(R->device, &current));
        CUDA_TRY(cuda_kernel_smem(R, fp8 ? CUDA_ATTR_BACKWARD_FP8 : CUDA_ATTR_BACKWARD, kernel, smem));
        pass_params p;
        pass_params_init(&p, ws, R, a->num_tokens, a->schedule, MOK_PASS_BACKWARD);
        p.accumulate = a->accumulate;
        /* SwiGLU-backward tasks: n_tile columns of I (and of I_s) */
        p.n_tile = p.rdot_cols = R->tuning.cols_dh;
        pass_params_comm(&p, R, ws->config.bwd_comm_sms, 1);
        pass_params_layer(&p, ws, a->x, a->w_gate, a->w_up, a->w_down, a->s_gate, a->s_up, a->s_down, a->context);
        p.dy = (const uint16_t *)a->dy;
        p.router_w = a->router_w;
        p.dw[0] = a->dw_gate;
        p.dw[1] = a->dw_up;
        p.dw[2] = a->dw_down;
        p.ds[0] = a->ds_gate;
        p.ds[1] = a->ds_up;
        p.ds[2] = a->ds_down;
        const size_t H = (size_t)s->hidden, k = (size_t)s->topk, T = (size_t)a->num_tokens;
        if (fp8) {
            st = backward_fp8_setup(ws, R, &p, a, stream);
            if (st != MOK_OK) return st;
        }
        if (T > 0 && ws->group->nranks > 1) { /* the peers' copies (input_row_base; FP8: x^ is there) */
            if (!fp8) CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.x, a->x, T * H * 2, cudaMemcpyDeviceToDevice, stream));
            CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.dy, a->dy, T * H * 2, cudaMemcpyDeviceToDevice, stream));
            CUDA_TRY(cudaMemcpyAsync(R->sym + cw->sym.router_w, a->router_w, T * k * 4, cudaMemcpyDeviceToDevice, stream));
        }
        pass_maps maps;
        p.tma_mask = backward_maps(R, &p, &maps);
        st = mok__cuda_launch_pass(ws, lr, R, &p, kernel, COMPUTE_THREADS, smem, stream,
                                   a->num_tokens, &maps);
        if (st != MOK_OK) return st;
        if (T > 0)
            st = mok__cuda_backward_slot_sums(p, R->num_sms, (uint16_t *)a->dx, a->d_router_w, R->sym, cw->sym.dxbuf,
                                              cw->sym.drw, stream);
        if (st != MOK_OK) return st;
    }
    cuda_use_device(previous, &current);
    return MOK_OK;
}
