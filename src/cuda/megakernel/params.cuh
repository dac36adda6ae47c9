/* params.cuh — the parameters of a pass: pass_params (the layer, the schedule, every buffer and
 * counter a megakernel reads; the kernels take it by value as their first parameter), the facts
 * of a routed row tile, what the producer works out once per compute task (task_prep), the
 * pass's plan as the device rebuilds it from them, and the host code that fills them. */
#ifndef MOK_CUDA_MEGAKERNEL_PARAMS_CUH
#define MOK_CUDA_MEGAKERNEL_PARAMS_CUH

#include <string.h>

#include "core/fp8_weights.h"
#include "cuda/backend.cuh"
#include "cuda/sm90/tile_operands.cuh"

struct pass_params {
    mok_sched_layout layout;
    const void *schedule;
    int num_local_experts, topk, rank, recompute, backward, accumulate, n_tile, n_tile_h;
    /* backward: columns of I per router-dot partial (ring_rdot, I / 64 floats a row): a dh tile
       writes n_tile / rdot_cols of them, the dx side sums I / rdot_cols in column order. n_tile,
       or 128 in FP8 (a partial per 128-block at either dh width) */
    int rdot_cols;
    /* comm CTAs: the tuning's count; with comm_auto (config 0) spans_kernel scales it by the rows
       this rank's comm tasks move per FLOP of its compute (mok__cuda_comm_ctas_scaled), up to
       comm_max, and every CTA reads the pass's count from comm_dev at its start (pass_start) */
    int comm_ctas, comm_auto, comm_max;
    int *comm_dev;
    long long hidden, inter, shared_inter, num_tokens, ring_rows, minibatch_rows, context_rows;
    char *const *peers;
    /* x, dy and router_w: the caller's buffers, which this rank's own reads use; the copies at
       off_x, off_dy, off_router_w of every window are there for the peers (input_row_base) */
    size_t off_x, off_comb, off_dy, off_router_w, off_dxbuf, off_drw;
    const uint16_t *x, *dy, *w_gate, *w_up, *w_down, *s_gate, *s_up, *s_down;
    const float *router_w;
    /* the context: its routed rows (context) and shared rows (context_shared), past its tag */
    uint16_t *ring_x, *ring_h, *ring_y, *sh_h, *sh_out, *context, *context_shared;
    /* The tags (core/schedule.h), which spans_kernel checks and writes: the context's, at its
       start, and the workspace's, which the schedule and the context must carry */
    mok_context_tag *context_tag;
    unsigned long long workspace_tag;
    /* backward */
    uint16_t *ring_dy, *ring_dyw, *ring_gu, *ring_dgu, *sh_dgu;
    float *ring_w, *ring_rdot, *carry;
    void *dw[3], *ds[3];
    float limit;
    /* FP8 passes (shape.precision, include/mok.h's FP8 section): x^'s codes at off_x of every
       window and its scales at off_xs (xs); the weights' codes and scales from the caller's
       fp8_weights, by mok_fp8_matrix. The forward: x is this rank's x^ codes; the E4M3 rows of
       ring_x, ring_h and sh_h with their scales after them, at ring_xs, ring_hs, sh_hs (a buffer's
       bf16 size holds both: n codes and n / 32 bytes of scales). The backward keeps its E4M3 rows
       as "code rows": a row's n codes, then its n / 128 scales, in the bf16 row's bytes (ring_dy:
       dy^; ring_y: x^ for a replay, until the dx tiles write there; sh_out: the shared expert's
       dy^ where the window has no dy^ rows, until its dx tiles write there), or in rows of 4I bytes (ring_gu: dg^|du^) and of
       sh_gq_ld bytes (sh_gq: the shared dg^|du^); x is bf16(x^) (the shared weight gradients'),
       backward_fp8.cuh */
    int fp8;
    const mok_fp8_header *fp8_header; /* the start of fp8_weights, checked by pass_refusal */
    size_t off_xs;
    const float *xs;
    float *ring_xs, *ring_hs, *sh_hs;
    uint8_t *sh_gq;
    long long sh_gq_ld;
    /* the backward's dy^ code rows (n = H codes, then the scales, dyq_ld bytes a row) of every
       window at off_dyq, made once per token before the pass; dyq_ld 0: none, the pulls
       quantize dy themselves (backward_fp8.cuh). The shared expert's dh tiles read this rank's
       at sh_dyq (sh_dyq_ld bytes a row): those rows, or where there are none, code rows in sh_out */
    size_t off_dyq;
    long long dyq_ld;
    uint8_t *sh_dyq;
    long long sh_dyq_ld;
    const uint8_t *wq[MOK_FP8_NUM_MATRICES];
    const float *wqs[MOK_FP8_NUM_MATRICES];
    unsigned long long *counters;
    long long counters_cap;
    /* Transfers in other than their default direction (docs/design.md §2.4a): the plan's switches
       (this pass's: a recompute pass turns none), every rank's copy of its schedule and counters at
       these offsets of its window, and `turned` (the counters are in the window: their releases
       and acquires are system-scope) */
    int combine_pull, dispatch_pull, dispatch_push, combine_push, nranks, turned;
    size_t off_sched, off_counters, off_ring_x, off_ring_y, off_ring_dy, off_ring_dyw, off_ring_w, off_ring_rdot;
    int *error;        /* the rank's cuda_error_word, as its first member (set_error, error_word.cuh) */
    long long timeout_ns;
    unsigned tma_mask; /* bit m: map m of the kernel's pass_maps is usable (tma.cuh) */
    int handoff;       /* 1: the gate|up tiles' h to warps 1-3 (compute_walk.cuh, NOTE (handoff)) */
    int direct_rows;   /* down (forward) and dx (backward) rows from the accumulators, not staged (tuning.h) */
    int raster;        /* GEMM spans' walk (mok__span_tile): the tuning's raster */
    mok_task_span *spans; /* the pass's task list: built by spans_kernel, or in the megakernel
                             (stream_spans), published through spans_published (task_list.cuh) */
    long long spans_cap;
    unsigned long long *spans_published;
    int stream_spans; /* the tuning's stream_spans */
    mok_trace_event *trace; /* config.trace: one event per task; NULL when off */
    long long trace_cap;
    unsigned long long *trace_count;
};

struct tile_info {
    long long row0, ring0;
    int nreal, expert;
};

static __device__ tile_info row_tile(const pass_params &p, const mok_sched_view &v, long long rt) {
    tile_info t;
    t.row0 = rt * MOK_ROW_TILE;
    t.ring0 = t.row0 % p.ring_rows;
    t.expert = mok__sched_row_expert(&v, p.num_local_experts, t.row0);
    long long end = v.expert_start[t.expert] + v.expert_rows[t.expert] - t.row0;
    t.nreal = (int)(end < 0 ? 0 : end > MOK_ROW_TILE ? MOK_ROW_TILE : end);
    return t;
}

/* What producer thread 0 works out once per compute task, before it posts the task
 * (compute_walk.cuh), for the loaders and the consumers alike: a routed row tile (a binary search
 * over the experts' starts, each step a dependent global load, and a 64-bit remainder), or a
 * weight-gradient tile's matrix, tile indices and rows. Worked out here, it stays off the
 * consumers' path, which would need it two or three times per task (gemm, preset, epilogue), in
 * front of their main loop and in their epilogue. compute_walk.cuh fills span; the runner's
 * prepare() fills the fields its task kind uses, the rest stay zero. */
struct task_prep {
    mok_task_span span;       /* the task's span, a copy of p.spans[g] */
    tile_info tile;           /* routed row tiles */
    long long wg_i, wg_j;     /* weight gradients: the tile's row and column tile in its matrix */
    long long wg_ring0;       /* routed: the macrobatch's first row of the expert, in the ring */
    long long wg_rows;        /* routed: its rows in this macrobatch; shared: the tokens */
    long long wg_carry;       /* routed: the carry slot (the macrobatch the expert began in) */
    int wg_matrix;            /* MOK_WGRAD_GATE, _UP or _DOWN */
    int wg_began, wg_continues; /* routed: rows of the expert before / after this macrobatch */
};

/* At a megakernel's start: whether the rank's error word is set (the pass must not run), and the
 * pass's comm CTA count into *comm (CTAs below it move rows). One read of each per CTA, broadcast
 * through shared memory, instead of a read per thread of every CTA at once. */
static __device__ __forceinline__ bool pass_start(const pass_params &p, int *comm) {
    __shared__ int s_error, s_comm;
    if (threadIdx.x == 0) {
        s_error = *(volatile int *)p.error;
        s_comm = *(volatile int *)p.comm_dev;
    }
    __syncthreads();
    *comm = s_comm;
    return s_error != 0;
}

/* An input of rank `peer` (x, dy or router_w): this rank's own from the caller's buffer `own`, a
 * peer's from the copy at `off` in its window. With one rank the pass makes no copies. */
static __device__ __forceinline__ const char *input_row_base(const pass_params &p, int peer, size_t off,
                                                            const void *own) {
    return peer == p.rank ? (const char *)own : p.peers[peer] + off;
}

static __device__ void make_plan(const pass_params &p, const mok_sched_view &v, mok_plan *plan) {
    memset(plan, 0, sizeof *plan);
    plan->recompute = p.recompute;
    plan->backward = p.backward;
    plan->accumulate = p.accumulate;
    plan->padded_rows = v.header->padded_rows;
    plan->context_rows = p.context_rows;
    plan->num_tokens = p.num_tokens;
    plan->hidden = p.hidden;
    plan->intermediate = p.inter;
    plan->shared_intermediate = p.shared_inter;
    plan->num_local_experts = p.num_local_experts;
    plan->minibatch_rows = (int)p.minibatch_rows;
    plan->ring_rows = (int)p.ring_rows;
    plan->n_tile = p.n_tile;
    plan->n_tile_h = p.n_tile_h;
    plan->wgrad_tile = CUDA_WGRAD_M;
    plan->wgrad_tile_n = CUDA_WGRAD_N;
    plan->raster = p.raster;
    plan->expert_start = v.expert_start;
    plan->expert_rows = v.expert_rows;
    plan->combine_pull = p.combine_pull;
    plan->dispatch_pull = p.dispatch_pull;
    plan->dispatch_push = p.dispatch_push;
    plan->combine_push = p.combine_push;
    plan->nranks = p.nranks;
    plan->rank = p.rank;
}

/* Whether the down (dx) tiles write the pass's outputs in place: mok__plan_in_place, the rule the
 * task list is built by, so that the epilogues and the list (no COMBINE, no PUSH) always agree. */
static __device__ __forceinline__ bool outputs_in_place(const pass_params &p) {
    mok_plan plan;
    memset(&plan, 0, sizeof plan);
    plan.nranks = p.nranks;
    plan.backward = p.backward;
    plan.recompute = p.recompute;
    plan.combine_pull = p.combine_pull;
    plan.dispatch_pull = p.dispatch_pull;
    return mok__plan_in_place(&plan);
}

/* Why the pass must not run on its schedule (and, in a backward, its context): 0, or the error
 * word's code (error_word.cuh), with the value found and the one expected for a tag's. The tags
 * first, so that another workspace's schedule is named as such. */
static __device__ int pass_refusal(const pass_params &p, const mok_sched_view &v, long long *found,
                                   long long *expected) {
    const mok_sched_header *h = v.header;
    int64_t f = 0, e = 0;
    *found = *expected = 0;
    if (h->magic != MOK_SCHED_MAGIC) return MOK_KERR_SCHEDULE;
    int tag = mok__sched_tag_check(h, p.workspace_tag, p.rank, &f, &e);
    if (tag == MOK_TAG_OK && (h->error || h->num_tokens[p.rank] != p.num_tokens)) return MOK_KERR_SCHEDULE;
    if (tag == MOK_TAG_OK && p.backward)
        tag = mok__context_tag_check(p.context_tag, p.workspace_tag, h->build, p.rank, &f, &e);
    *found = f;
    *expected = e;
    if (tag != MOK_TAG_OK) return MOK_KERR_TAG_BASE + tag;
    if (p.fp8) {
        const mok_fp8_header *w = p.fp8_header;
        if (w->magic != MOK_FP8_WEIGHTS_MAGIC || w->hidden != p.hidden || w->intermediate != p.inter ||
            w->shared_intermediate != p.shared_inter || w->num_local_experts != p.num_local_experts)
            return MOK_KERR_FP8_WEIGHTS;
    }
    return 0;
}

/* The fields every pass shares: kind and transfer switches (core/plan.h, enum mok_pass_kind),
 * layer, schedule, buffers, counters. */
static void pass_params_init(pass_params *p, const mok_workspace *ws, const cuda_rank *R, int64_t num_tokens,
                             const void *schedule, int kind) {
    const cuda_workspace *cw = (const cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    memset(p, 0, sizeof *p);
    p->direct_rows = R->tuning.direct_rows;
    p->layout = ws->sched_layout;
    p->schedule = schedule;
    p->workspace_tag = ws->tag;
    p->num_local_experts = (int)ws->num_local_experts;
    p->topk = (int)s->topk;
    p->rank = R->rank;
    const mok_plan switches = mok__plan_switches(&ws->config, kind);
    p->backward = switches.backward;
    p->recompute = switches.recompute;
    p->combine_pull = switches.combine_pull;
    p->dispatch_push = switches.dispatch_push;
    p->dispatch_pull = switches.dispatch_pull;
    p->combine_push = switches.combine_push;
    p->n_tile_h = R->tuning.cols_h;
    p->hidden = s->hidden;
    p->inter = s->intermediate;
    p->shared_inter = s->shared_intermediate;
    p->num_tokens = num_tokens;
    p->ring_rows = ws->config.ring_rows;
    p->minibatch_rows = ws->config.minibatch_rows;
    p->context_rows = ws->context_rows;
    p->peers = R->peers;
    p->off_x = cw->sym.x;
    p->off_comb = cw->sym.comb;
    p->off_dy = cw->sym.dy;
    p->off_router_w = cw->sym.router_w;
    p->off_dxbuf = cw->sym.dxbuf;
    p->off_drw = cw->sym.drw;
    p->ring_x = R->ring_x;
    p->ring_h = R->ring_h;
    p->ring_y = R->ring_y;
    p->sh_h = R->sh_h;
    p->sh_out = R->sh_out;
    p->ring_dy = R->ring_dy;
    p->ring_dyw = R->ring_dyw;
    p->ring_gu = R->ring_gu;
    p->ring_dgu = R->ring_dgu;
    p->sh_dgu = R->sh_dgu;
    p->ring_w = R->ring_w;
    p->ring_rdot = R->ring_rdot;
    p->carry = R->carry;
    p->limit = ws->config.swiglu_limit;
    p->counters = R->counters;
    p->counters_cap = R->counters_cap;
    p->nranks = ws->group->nranks;
    p->turned = cw->sym.turned;
    p->off_sched = cw->sym.sched;
    p->off_counters = cw->sym.counters;
    p->off_ring_x = cw->sym.ring_x;
    p->off_ring_y = cw->sym.ring_y;
    p->off_ring_dy = cw->sym.ring_dy;
    p->off_ring_dyw = cw->sym.ring_dyw;
    p->off_ring_w = cw->sym.ring_w;
    p->off_ring_rdot = cw->sym.ring_rdot;
    p->error = (int *)R->error_word;
    p->timeout_ns = (long long)(ws->config.peer_timeout_ms * 1e6);
    p->spans = R->spans;
    p->spans_cap = R->spans_cap;
    p->spans_published = R->spans_published;
    p->stream_spans = R->tuning.stream_spans;
    /* the pass's own trace buffer: the forward's (or recompute's) or the backward's (internal.h) */
    p->trace = R->trace ? R->trace + (p->backward ? R->trace_cap : 0) : nullptr;
    p->trace_cap = R->trace_cap;
    p->trace_count = R->trace_count ? R->trace_count + (p->backward ? 1 : 0) : nullptr;
    p->raster = R->tuning.raster;
}

/* An FP8 pass's weights (pass_params.wq, wqs: every matrix of mok_fp8_layout) from the caller's
 * fp8_weights, whose header pass_refusal checks on the device. */
static void pass_params_fp8_weights(pass_params *p, const mok_workspace *ws, const void *fp8_weights) {
    mok_fp8_layout layout;
    mok__fp8_layout(&ws->shape, ws->num_local_experts, &layout);
    p->fp8 = 1;
    p->fp8_header = (const mok_fp8_header *)fp8_weights;
    for (int m = 0; m < MOK_FP8_NUM_MATRICES; ++m) {
        p->wq[m] = (const uint8_t *)fp8_weights + layout.codes[m];
        p->wqs[m] = (const float *)((const char *)fp8_weights + layout.scales[m]);
    }
}

/* A pass's comm CTAs (pass_params): the tuning's count, and with configured = 0 the bounds of the
 * count spans_kernel picks per pass from the routing. */
static void pass_params_comm(pass_params *p, const cuda_rank *R, int configured, int backward) {
    p->comm_ctas = backward ? R->tuning.bwd_comm_ctas : R->tuning.fwd_comm_ctas;
    p->comm_auto = configured <= 0;
    const int cap = R->num_sms / 4 > 1 ? R->num_sms / 4 : 1;
    p->comm_max = cap < R->num_sms - 1 ? cap : R->num_sms - 1;
    if (p->comm_max < p->comm_ctas) p->comm_max = p->comm_ctas;
    p->comm_dev = R->comm_dev;
}

/* The layer a pass reads, as both passes' arguments name it: x, the weights, the context (the
 * forward writes it, the backward reads it). */
static void pass_params_layer(pass_params *p, const mok_workspace *ws, const void *x, const void *w_gate,
                              const void *w_up, const void *w_down, const void *s_gate, const void *s_up,
                              const void *s_down, const void *context) {
    p->x = (const uint16_t *)x;
    p->w_gate = (const uint16_t *)w_gate;
    p->w_up = (const uint16_t *)w_up;
    p->w_down = (const uint16_t *)w_down;
    p->s_gate = (const uint16_t *)s_gate;
    p->s_up = (const uint16_t *)s_up;
    p->s_down = (const uint16_t *)s_down;
    p->context_tag = (mok_context_tag *)context;
    p->context = (uint16_t *)((const char *)context + ws->context_routed_offset);
    p->context_shared = (uint16_t *)((const char *)context + ws->context_shared_offset);
}

/* The launch sequence every pass shares (launch.cu), on one rank's stream after its inputs are
 * staged: `kernel` is the megakernel, `maps` its tensor maps (its second parameter) or NULL. */
mok_status mok__cuda_launch_pass(mok_workspace *ws, int lr, const cuda_rank *R, pass_params *p, const void *kernel,
                                 int threads, size_t smem, cudaStream_t stream, int64_t num_tokens, const void *maps);

/* The slot sums that close a pass (slot_sums.cu), launched on the rank's stream after its closing
 * barrier. */
mok_status mok__cuda_forward_slot_sums(const pass_params &p, int num_sms, const float *router_w, uint16_t *y,
                                       const char *comb, cudaStream_t stream);
mok_status mok__cuda_backward_slot_sums(const pass_params &p, int num_sms, uint16_t *dx, float *d_router_w,
                                        const char *sym, size_t off_dxbuf, size_t off_drw, cudaStream_t stream);

#endif
