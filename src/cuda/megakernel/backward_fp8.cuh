/* backward_fp8.cuh — the FP8 backward (include/mok.h, FP8 section) on the backward megakernel
 * (backward.cu): the same tasks, counters and ring, with E4M3 operands in the dgrad GEMMs.
 *
 * Before the pass (mok__cuda_backward): x^ = Q(x) into this rank's window, as in the forward
 * (codes, then scales, at off_x / off_xs), where the pulls of every rank read it; dy^ = Q(dy)
 * once per token as code rows in the window's combine region, which a backward does not use
 * (off_dyq), where the pulls and the shared expert's dh tiles read it: without it every routed
 * row's pull would quantize its token's dy again, k times a token (where those rows do not fit
 * the region, the pulls do so, and the shared expert's dy^ goes into sh_out); with a shared expert
 * also bf16(x^) (its weight gradients' x, pass_params.x, at the region's start).
 *
 * Code rows (params.cuh): a row's n E4M3 codes, then its n / 128 scales, in one row of a buffer.
 *   ring_dy  dy^ of the ring row (pull): the dh GEMM's A;
 *   ring_y   x^ of the ring row, copied by the pull when its tile replays g|u: the replay's A
 *            (the dx tiles write the row's dx part there after every dh tile of the row tile);
 *   ring_gu  dg^|du^ (rows of 4I bytes): the dx GEMM's A, written by the dh tiles;
 *   dyq      dy^ of each token (window, off_dyq): the pulls' source and the shared dh tiles' A;
 *   sh_out   the shared expert's dy^ where there is no dyq, until its dx tiles write there;
 *   sh_gq    the shared expert's dg^|du^.
 * ring_x holds bf16(x^) (exact) for the weight gradients, ring_dyw bf16(w · dy), ring_h bf16(h^),
 * ring_dgu bf16 dg|du: the weight-gradient GEMMs are the bf16 ones, on these operands. A replayed
 * g|u goes into ring_dgu's columns of its tile, which the tile's dh epilogue reads before it
 * writes dg|du there (swiglu_backward_fp8.cuh).
 *
 * GEMMs (all K-major, FP8 tiles of fp8_tile.cuh): the replay x^ · [W^_gate; W^_up] (128 columns
 * of each: the forward's gate|up tile, so g and u are the forward's bits; one per 128-block of the
 * dh tile); dh0 = dy^ · W^_down against its transposed copy [I, H]; the dx part [dg^ | du^] ·
 * [W^_gate ; W^_up] against the transposed copies [H, I], one K loop split between them
 * (tile_operands.bk_split). The dh tiles are whole 128-blocks wide (pass_params.n_tile: the
 * tuning's cols_dh, 256 or 128); every column's dh0 is the same sum at either width, and the
 * router dot keeps a partial per 128-block (pass_params.rdot_cols), so the pass gives the same
 * bits at either. */
#ifndef MOK_CUDA_MEGAKERNEL_BACKWARD_FP8_CUH
#define MOK_CUDA_MEGAKERNEL_BACKWARD_FP8_CUH

#include "cuda/megakernel/swiglu_backward_fp8.cuh"

/* ---- GEMMs -------------------------------------------------------------------------------- */

/* A code-row operand A of a K-major FP8 GEMM: rows from `row` of a buffer whose rows are row_bytes
 * apart, k codes each, then their scales. */
static __device__ __forceinline__ void code_row_a(tile_operands *op, const void *buffer, long long row,
                                                  long long row_bytes, long long k, int rows) {
    const uint8_t *base = (const uint8_t *)buffer + row * row_bytes;
    op->a = (const uint16_t *)base;
    op->lda = row_bytes / 2;
    op->k = op->k_valid = k / 2;
    op->sa = (const float *)(base + k);
    op->sa_ld = row_bytes / 4;
    op->a_rows = rows;
}

/* GEMM i of a compute task of the FP8 backward: 1 + its layout (compute_walk.cuh: 0 K-major E4M3,
 * 1 the same with B split along K: the dx tiles, 3 the bf16 weight gradients), 0 when there is
 * none. */
static __device__ int bwd_gemm_fp8(const pass_params &p, const mok_task_span &span, long long rt, long long nt,
                                   const task_prep &tp, int i, tile_operands *op) {
    const long long H = p.hidden, I = p.inter, Is = p.shared_inter, KB = H / MOK_FP8_BLOCK;
    *op = tile_operands{};
    switch (span.kind) {
    case MOK_TASK_DH: {
        const tile_info t = tp.tile;
        if (t.nreal == 0) return 0;
        /* a replaying tile first runs the forward's gate|up tile on each of its 128-blocks */
        const int replays = tile_replays(p, rt) ? p.n_tile / MOK_FP8_BLOCK : 0;
        const long long n0 = nt * p.n_tile, w_row = t.expert * I + n0;
        if (i < replays) { /* g|u of block i: 128 columns of each */
            const long long b_row = w_row + MOK_FP8_BLOCK * i;
            code_row_a(op, p.ring_y, t.ring0, 2 * H, H, t.nreal);
            op->b_lo = (const uint16_t *)(p.wq[MOK_FP8_W_GATE] + b_row * H);
            op->b_hi = (const uint16_t *)(p.wq[MOK_FP8_W_UP] + b_row * H);
            op->ldb = H / 2;
            op->n_valid = 2 * MOK_FP8_BLOCK;
            op->b_split = MOK_FP8_BLOCK / 64;
            fp8_b_scales(op, p.wqs[MOK_FP8_W_GATE], b_row, p.wqs[MOK_FP8_W_UP], b_row, KB);
            use_tma_k(p, op, MAP_RING_XQ, t.ring0, MAP_W_GATE, b_row, MAP_W_UP, b_row);
            return 1;
        }
        if (i != replays) return 0;
        code_row_a(op, p.ring_dy, t.ring0, 2 * H, H, t.nreal);
        op->b_lo = (const uint16_t *)(p.wq[MOK_FP8_W_DOWN_T] + w_row * H);
        op->ldb = H / 2;
        op->n_valid = p.n_tile;
        op->b_split = p.n_tile / 64;
        fp8_b_scales(op, p.wqs[MOK_FP8_W_DOWN_T], w_row, nullptr, 0, KB);
        use_tma_k(p, op, MAP_RING_DY, t.ring0, MAP_W_DOWN, w_row);
        return 1;
    }
    case MOK_TASK_SHARED_DH: {
        if (i > 0) return 0;
        const long long t0 = rt * MOK_ROW_TILE, n0 = nt * p.n_tile;
        code_row_a(op, p.sh_dyq, t0, p.sh_dyq_ld, H, token_rows(p, t0));
        op->b_lo = (const uint16_t *)(p.wq[MOK_FP8_S_DOWN_T] + n0 * H);
        op->ldb = H / 2;
        op->n_valid = p.n_tile;
        op->b_split = p.n_tile / 64;
        fp8_b_scales(op, p.wqs[MOK_FP8_S_DOWN_T], n0, nullptr, 0, KB);
        use_tma_k(p, op, MAP_SH_DYQ, t0, MAP_S_DOWN, n0);
        return 1;
    }
    case MOK_TASK_DX:
    case MOK_TASK_SHARED_DX: {
        if (i > 0) return 0;
        const bool shared = span.kind == MOK_TASK_SHARED_DX;
        const long long inter = shared ? Is : I, n0 = nt * p.n_tile_h;
        long long w_row, a_row;
        if (shared) {
            a_row = rt * MOK_ROW_TILE;
            w_row = n0;
            code_row_a(op, p.sh_gq, a_row, p.sh_gq_ld, 2 * inter, token_rows(p, a_row));
        } else {
            const tile_info t = tp.tile;
            if (t.nreal == 0) return 0;
            a_row = t.ring0;
            w_row = t.expert * H + n0;
            code_row_a(op, p.ring_gu, a_row, 4 * I, 2 * I, t.nreal);
        }
        const int g = shared ? MOK_FP8_S_GATE_T : MOK_FP8_W_GATE_T, u = shared ? MOK_FP8_S_UP_T : MOK_FP8_W_UP_T;
        op->b_lo = (const uint16_t *)(p.wq[g] + w_row * inter);
        op->b_hi = (const uint16_t *)(p.wq[u] + w_row * inter);
        op->ldb = inter / 2;
        op->n_valid = p.n_tile_h;
        op->b_split = p.n_tile_h / 64;
        op->bk_split = inter / 2;
        fp8_b_scales(op, p.wqs[g], w_row, nullptr, 0, inter / MOK_FP8_BLOCK);
        fp8_b_scales_split(op, p.wqs[u], w_row, inter / MOK_FP8_BLOCK);
        if (shared) use_tma_k(p, op, MAP_SH_GQ, a_row, MAP_S_GATE, w_row, MAP_S_UP, w_row);
        else use_tma_k(p, op, MAP_RING_GQ, a_row, MAP_W_GATE_T, w_row, MAP_W_UP_T, w_row);
        return 2;
    }
    case MOK_TASK_WGRAD:
    case MOK_TASK_SHARED_WGRAD: return wgrad_gemm(p, span, tp, i, op);
    default: return 0;
    }
}

/* ---- epilogues ---------------------------------------------------------------------------- */

/* A replay's g (accumulator columns 0..127) and u (128..255) of the tile's 128-block i in bf16 into
 * its columns of ring_dgu, through the staging tile. */
static __device__ __forceinline__ void replay_epilogue_fp8(const pass_params &p, long long nt, const task_prep &tp,
                                                           int i, float (&acc)[TILE_ACC], uint16_t *c) {
    const long long I = p.inter, n0 = nt * p.n_tile + MOK_FP8_BLOCK * i;
    const tile_info t = tp.tile;
    const int w16 = ((threadIdx.x - PRODUCER_THREADS) >> 5) * 16;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
    uint16_t *out = p.ring_dgu + t.ring0 * 2 * I + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < TILE_C_COLS / 8; j += 2)
            stsm_blocks<STSM_PADDED>(acc, j + h * (TILE_C_COLS / 8), base, w16, h * (TILE_C_COLS / 8));
        consumer_sync();
        copy_staged(c, t.nreal, MOK_FP8_BLOCK, out + h * I, 2 * I);
        consumer_sync();
    }
}

/* The SwiGLU backward of a routed or shared FP8 dh tile. */
static __device__ __forceinline__ void dh_epilogue_fp8(const pass_params &p, const mok_task_span &span, long long rt,
                                                       long long nt, const task_prep &tp, float (&acc)[TILE_ACC],
                                                       uint16_t *c) {
    const long long I = p.inter, Is = p.shared_inter, n0 = nt * p.n_tile;
    if (span.kind == MOK_TASK_DH) {
        const tile_info t = tp.tile;
        const uint16_t *gu = tile_replays(p, rt) ? p.ring_dgu + t.ring0 * 2 * I : p.context + t.row0 * 2 * I;
        swiglu_backward_fp8(acc, t.nreal, p.n_tile, gu, 2 * I, I, n0, p.ring_w + t.ring0, p.limit,
                            p.ring_h + t.ring0 * I, I, p.ring_dgu + t.ring0 * 2 * I, 2 * I,
                            (uint8_t *)(p.ring_gu + t.ring0 * 2 * I), 4 * I,
                            p.ring_rdot + t.ring0 * (I / 64) + n0 / MOK_FP8_BLOCK, I / 64, c, true);
    } else {
        const long long t0 = rt * MOK_ROW_TILE;
        swiglu_backward_fp8(acc, token_rows(p, t0), p.n_tile, p.context_shared + t0 * 2 * Is, 2 * Is, Is, n0, nullptr,
                            p.limit, p.sh_h + t0 * Is, Is, p.sh_dgu + t0 * 2 * Is, 2 * Is, p.sh_gq + t0 * p.sh_gq_ld,
                            p.sh_gq_ld, nullptr, 0, c, false);
    }
}

template <int VAR>
static __device__ __forceinline__ void bwd_epilogue_fp8(const pass_params &p, const mok_task_span &span, long long rt,
                                                        long long nt, const task_prep &tp, int i,
                                                        float (&acc)[TILE_ACC], uint16_t *c, const CUtensorMap *maps) {
    const int tid = threadIdx.x - PRODUCER_THREADS;
    if (!(VAR == 1 && bwd_direct(p, span))) { /* as bwd_epilogue: the last TMA stores have read the staging region */
        if (tid == 0) bulk_wait_read();
        consumer_sync();
    }
    if (VAR == 0) { /* replay, dh */
        if (span.kind == MOK_TASK_DH && tile_replays(p, rt) && i < p.n_tile / MOK_FP8_BLOCK)
            replay_epilogue_fp8(p, nt, tp, i, acc, c);
        else dh_epilogue_fp8(p, span, rt, nt, tp, acc, c);
    } else if (VAR == 1) { /* dx */
        switch (span.kind) {
        case MOK_TASK_DX: dx_epilogue(p, nt, tp, acc, c, tid); return;
        case MOK_TASK_SHARED_DX: {
            const long long t0 = rt * MOK_ROW_TILE;
            hidden_rows(p, nt, acc, token_rows(p, t0), p.sh_out + t0 * p.hidden, c);
            return;
        }
        default: break;
        }
    } else if (VAR == 3) {
        wgrad_epilogue(p, span, tp, acc, c, maps, tid);
    }
    consumer_sync();
}

#endif
