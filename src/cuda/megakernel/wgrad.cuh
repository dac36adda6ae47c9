/* wgrad.cuh — the weight-gradient tiles of the backward: dW = A^T B over an expert's rows of one
 * macrobatch (or the shared expert's over all tokens), one CTA per output tile, its fp32
 * accumulator starting from the caller's buffer (accumulate) or the carry slot of the macrobatch
 * before, and stored as bf16, fp32, or carried on; and the zeroing of experts with no rows. */
#ifndef MOK_CUDA_MEGAKERNEL_WGRAD_CUH
#define MOK_CUDA_MEGAKERNEL_WGRAD_CUH

#include "cuda/megakernel/row_stores.cuh"

/* A weight-gradient tile: out = init + A^T B over `rows` rows (A M-major, B N-major), where the
 * fp32 init comes from the caller's buffer (accumulate) or the carry slot, and the result goes to
 * the carry slot (the expert continues in the next macrobatch) or the destination. */
struct wgrad_job {
    tile_operands op;
    const float *init;
    float *carry_out;
    char *dest;
    int dest_f32, m_valid, n_valid;
    long long ld;
    int store_map, store_row, store_col; /* a bf16 destination's TMA map and box origin; -1: none */
};

static __device__ void wgrad_operands(const pass_params &p, int matrix, long long inter, long long i, long long j,
                                      const uint16_t *dgu, const uint16_t *x, const uint16_t *dyw, const uint16_t *h,
                                      long long rows, bool shared, long long ring0, wgrad_job *w) {
    const long long H = p.hidden, m0 = i * CUDA_WGRAD_M, c0 = j * CUDA_WGRAD_N;
    const long long mdim = matrix == MOK_WGRAD_DOWN ? H : inter, ndim = matrix == MOK_WGRAD_DOWN ? inter : H;
    w->m_valid = (int)(mdim - m0 < CUDA_WGRAD_M ? mdim - m0 : CUDA_WGRAD_M);
    w->n_valid = (int)(ndim - c0 < CUDA_WGRAD_N ? ndim - c0 : CUDA_WGRAD_N);
    tile_operands &op = w->op;
    op = tile_operands{};
    if (matrix == MOK_WGRAD_DOWN) {
        op.a = dyw + m0;
        op.lda = H;
        op.b_lo = h + c0;
        op.ldb = inter;
    } else {
        op.a = dgu + (matrix == MOK_WGRAD_UP ? inter : 0) + m0;
        op.lda = 2 * inter;
        op.b_lo = x + c0;
        op.ldb = H;
    }
    op.a_rows = w->m_valid;
    op.n_valid = w->n_valid;
    op.k_split = 1ll << 62;
    op.k = rows;
    op.k_valid = rows;
    /* TMA: the ring (rows from ring0; padding rows are zeros) or the token-indexed buffers (rows
       past T arrive as zeros) */
    const int a_halves = (w->m_valid + 63) / 64, b_halves = (w->n_valid + 63) / 64;
    if (matrix == MOK_WGRAD_DOWN)
        use_tma_mn(p, &op, shared ? MAP_DY : MAP_RING_DYW, ring0, m0, a_halves, shared ? MAP_SH_H : MAP_RING_H, ring0,
                   c0, b_halves);
    else
        use_tma_mn(p, &op, shared ? MAP_SH_DGU : MAP_RING_DGU, ring0, (matrix == MOK_WGRAD_UP ? inter : 0) + m0,
                   a_halves, shared ? MAP_X : MAP_RING_X, ring0, c0, b_halves);
}

/* Producer thread 0, once per weight-gradient task (task_prep, params.cuh): the tile's matrix and
 * tile indices, and for a routed expert its rows in this macrobatch (from the schedule). */
static __device__ void wgrad_prepare(const pass_params &p, const mok_sched_view &v, const mok_task_span &span,
                                     long long t, task_prep *tp) {
    int64_t i, j;
    int matrix;
    if (span.kind == MOK_TASK_SHARED_WGRAD) {
        mok_plan plan = {};
        plan.hidden = p.hidden;
        plan.wgrad_tile = CUDA_WGRAD_M;
        plan.wgrad_tile_n = CUDA_WGRAD_N;
        plan.raster = p.raster;
        mok__wgrad_tile(&plan, p.shared_inter, t, &matrix, &i, &j);
        tp->wg_ring0 = tp->wg_carry = 0;
        tp->wg_rows = p.num_tokens;
        tp->wg_began = tp->wg_continues = 0;
    } else {
        mok_plan plan;
        make_plan(p, v, &plan);
        const int e = span.first_tile;
        int64_t first, end;
        mok__expert_rows_in(&plan, e, span.minibatch, &first, &end);
        mok__wgrad_tile(&plan, p.inter, t, &matrix, &i, &j);
        const long long start = v.expert_start[e];
        tp->wg_ring0 = first % p.ring_rows;
        tp->wg_rows = end - first;
        tp->wg_carry = start / p.ring_rows;
        tp->wg_began = first > start;
        tp->wg_continues = start + v.expert_rows[e] > end;
    }
    tp->wg_matrix = matrix;
    tp->wg_i = i;
    tp->wg_j = j;
}

/* Every role: a weight-gradient task's job from its task_prep, with no schedule reads. */
static __device__ void wgrad_job_of(const pass_params &p, const mok_task_span &span, const task_prep &tp, wgrad_job *w) {
    const long long H = p.hidden, i = tp.wg_i, j = tp.wg_j;
    const int matrix = tp.wg_matrix;
    if (span.kind == MOK_TASK_SHARED_WGRAD) {
        const long long Is = p.shared_inter;
        w->ld = matrix == MOK_WGRAD_DOWN ? Is : H;
        w->dest = (char *)p.ds[matrix] + (i * CUDA_WGRAD_M * w->ld + j * CUDA_WGRAD_N) * (p.accumulate ? 4 : 2);
        w->init = p.accumulate ? (const float *)w->dest : nullptr;
        w->carry_out = nullptr;
        w->store_map = MAP_DS_GATE + matrix;
        w->store_row = (int)(i * CUDA_WGRAD_M);
        w->store_col = (int)(j * CUDA_WGRAD_N);
        wgrad_operands(p, matrix, Is, i, j, p.sh_dgu, p.x, p.dy, p.sh_h, p.num_tokens, true, 0, w);
    } else {
        const int e = span.first_tile;
        const long long I = p.inter, mat_elems = I * H, ring0 = tp.wg_ring0;
        w->ld = matrix == MOK_WGRAD_DOWN ? I : H;
        const long long offset = i * CUDA_WGRAD_M * w->ld + j * CUDA_WGRAD_N;
        float *carry = p.carry + tp.wg_carry * 3 * mat_elems + matrix * mat_elems + offset;
        w->dest = (char *)p.dw[matrix] + (e * mat_elems + offset) * (p.accumulate ? 4 : 2);
        w->init = p.accumulate ? (const float *)w->dest : tp.wg_began ? carry : nullptr;
        w->carry_out = (!p.accumulate && tp.wg_continues) ? carry : nullptr;
        w->store_map = MAP_DW_GATE + matrix; /* rows of [E · rows, cols]: a matrix has H rows (down) or I */
        w->store_row = (int)(e * (matrix == MOK_WGRAD_DOWN ? H : I) + i * CUDA_WGRAD_M);
        w->store_col = (int)(j * CUDA_WGRAD_N);
        wgrad_operands(p, matrix, I, i, j, p.ring_dgu + ring0 * 2 * I, p.ring_x + ring0 * H, p.ring_dyw + ring0 * H,
                       p.ring_h + ring0 * I, tp.wg_rows, false, ring0, w);
    }
    w->dest_f32 = p.accumulate;
    if (p.accumulate || w->carry_out || !((p.tma_mask >> w->store_map) & 1)) w->store_map = -1;
}

/* Two fp32 loads into f32 registers: a plain load is typed b32 and carried into the wgmma loop
 * through moves that make ptxas serialise the wgmmas (C7514). */
static __device__ __forceinline__ void ld_f32x2(const float *p, float *a, float *b) {
    asm("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(*a), "=f"(*b) : "l"(p));
}

/* A weight-gradient task's one GEMM: 1 + its layout (bf16, M-major A, N-major B: 3), 0 past it. */
static __device__ __forceinline__ int wgrad_gemm(const pass_params &p, const mok_task_span &span, const task_prep &tp,
                                                 int i, tile_operands *op) {
    if (i > 0) return 0;
    wgrad_job w;
    wgrad_job_of(p, span, tp, &w);
    *op = w.op;
    return 4;
}

/* Consumers, before GEMM i: weight-gradient tiles start from their fp32 init, the rest from zeros.
 * One path for both, every load predicated: an early branch to zeros, or starting the first
 * wgmma with scale-d 0 on the zero path, made ptxas serialise the wgmmas (C7515, which
 * slows every main loop), which the build refuses. */
template <int VAR>
static __device__ __forceinline__ void bwd_preset(const pass_params &p, const mok_task_span &span, const task_prep &tp,
                                  float (&acc)[TILE_ACC]) {
    wgrad_job w;
    w.init = nullptr;
    if (span.kind == MOK_TASK_WGRAD || span.kind == MOK_TASK_SHARED_WGRAD) wgrad_job_of(p, span, tp, &w);
    /* The thread's rows are row0 and row0 + 8, its columns col0 + 8j (+1): two row predicates
     * (both off without an init) and no column predicate: a column past n_valid reads at the
     * last valid pair's address instead (a value no epilogue stores: they store the valid part
     * only), so every load stays inside the matrix. Bounds per register (64 predicates, more than
     * a thread has, so spilled to registers) would cost about a thousand instructions per GEMM
     * phase. */
    int row0, col0;
    acc_position(0, &row0, &col0);
    const bool on0 = w.init && row0 < w.m_valid, on8 = w.init && row0 + 8 < w.m_valid;
    const int last = w.init ? w.n_valid - 2 - col0 : 0; /* the last valid pair's offset from col0 */
    const float *b0 = w.init ? w.init + row0 * w.ld + col0 : nullptr, *b8 = w.init ? b0 + 8 * w.ld : nullptr;
#pragma unroll
    for (int r = 0; r < TILE_ACC; r += 2) {
        const int dc = (r >> 2) * 8, c = dc < last ? dc : last; /* acc_position(r) - (row0, col0) */
        float a = 0.0f, b = 0.0f;
        if ((r & 2) ? on8 : on0) ld_f32x2(((r & 2) ? b8 : b0) + c, &a, &b);
        acc[r] = a;
        acc[r + 1] = b;
    }
}

/* Experts with no rows: zero weight gradients (bf16 mode; accumulate mode leaves them as they are). */
static __device__ void run_wgrad_zero(const pass_params &p, int e) {
    const long long n = p.inter * p.hidden;
    for (int m = 0; m < 3; ++m) {
        uint16_t *d = (uint16_t *)p.dw[m] + e * n;
        for (long long i = threadIdx.x - PRODUCER_THREADS; i < n / 8; i += CONSUMER_THREADS) ((int4 *)d)[i] = make_int4(0, 0, 0, 0);
    }
}

#endif
