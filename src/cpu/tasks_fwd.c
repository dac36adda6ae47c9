/* tasks_fwd.c — the forward's tasks on the cpu backend (kinds in core/tasks.h) and its
 * epilogue. Buffer ownership: ring rows are written by DISPATCH (x) and GATEUP/DOWN (h, y) of
 * the row tile that owns them and read by later tasks of the same tile; a peer's combine buffer
 * row (token, slot) is written by exactly one COMBINE, of the rank that owns the expert.
 *
 * FP8 (include/mok.h): x is quantized when the pass stages it, and the ring holds its E4M3 rows
 * and scales; h stays bf16 in the ring and the down tile quantizes its rows as it loads them (a
 * pure function of those bf16 values, so any tile that quantizes a row gets the same bits: the
 * GPU's gate/up epilogue may do it instead); the weights come quantized in args fp8_weights. */
#include "core/fp8_weights.h"
#include "cpu.h"

#define NT CPU_N_TILE

static size_t kmax_of(const mok_shape *sh) {
    size_t kmax = (size_t)(sh->hidden > sh->intermediate ? sh->hidden : sh->intermediate);
    if (2 * (size_t)sh->intermediate > kmax) kmax = 2 * (size_t)sh->intermediate;
    if (2 * (size_t)sh->shared_intermediate > kmax) kmax = 2 * (size_t)sh->shared_intermediate;
    return kmax;
}
static float *scratch_a(float *s) { return s; }
static float *scratch_bt(const cpu_pass *p, float *s, int which) {
    const size_t kmax = kmax_of(&p->ws->shape);
    return s + (size_t)MOK_ROW_TILE * kmax + (size_t)which * kmax * NT;
}
static float *scratch_acc(const cpu_pass *p, float *s, int which) {
    return scratch_bt(p, s, 2) + (size_t)which * MOK_ROW_TILE * NT;
}
/* FP8: the A operand's scales, then B's, in the second B buffer (FP8 tiles load their B operands
 * one at a time into the first): MOK_ROW_TILE * kmax / 128 + kmax / 128 floats of its kmax * NT.
 * The A operand itself (E4M3 values as fp32) is where a bf16 tile's is. */
float *mok__cpu_scratch_a_scale(const cpu_pass *p, float *s) { return scratch_bt(p, s, 1); }
static float *scratch_b_scale(const cpu_pass *p, float *s) {
    return scratch_bt(p, s, 1) + (size_t)MOK_ROW_TILE * (kmax_of(&p->ws->shape) / MOK_FP8_BLOCK);
}

static int is_fp8(const cpu_pass *pass) { return pass->ws->shape.precision == MOK_PRECISION_FP8; }

cpu_fp8_weights mok__cpu_fp8_weights(const cpu_pass *pass) {
    mok_fp8_layout layout;
    mok__fp8_layout(&pass->ws->shape, pass->ws->num_local_experts, &layout);
    const char *buffer = pass->fa ? pass->fa->fp8_weights : pass->ba->fp8_weights;
    cpu_fp8_weights w;
    for (int m = 0; m < MOK_FP8_NUM_MATRICES; ++m) {
        w.codes[m] = (const uint8_t *)(buffer + layout.codes[m]);
        w.scales[m] = (const float *)(buffer + layout.scales[m]);
    }
    return w;
}

const uint8_t *mok__cpu_fp8_codes(const cpu_fp8_weights *w, int m, int64_t e, int64_t rows, int64_t cols) {
    return w->codes[m] + e * rows * cols;
}

const float *mok__cpu_fp8_scales(const cpu_fp8_weights *w, int m, int64_t e, int64_t rows, int64_t cols) {
    return w->scales[m] + e * (rows / MOK_FP8_BLOCK) * (cols / MOK_FP8_BLOCK);
}

void mok__cpu_gemm_fp8_weight(const cpu_pass *pass, float *scratch, float *acc, int rows, int64_t k, int m, int64_t e,
                              int64_t N, int64_t n0) {
    const cpu_fp8_weights w = mok__cpu_fp8_weights(pass);
    float *bt = scratch_bt(pass, scratch, 0), *b_scale = scratch_b_scale(pass, scratch);
    mok__cpu_bt_from_e4m3(bt, b_scale, mok__cpu_fp8_codes(&w, m, e, N, k), mok__cpu_fp8_scales(&w, m, e, N, k), n0, NT,
                          k);
    mok__cpu_gemm_fp8(acc, scratch_a(scratch), mok__cpu_scratch_a_scale(pass, scratch), rows, k, bt, b_scale, NT);
}

void mok__cpu_stage_x(const cpu_pass *pass, const void *x, int64_t num_tokens) {
    const int64_t H = pass->ws->shape.hidden, blocks = H / MOK_FP8_BLOCK;
    char *region = pass->R->region;
    const mok_region_layout *L = &pass->cw->sym;
    if (num_tokens == 0) return;
    if (!is_fp8(pass)) {
        memcpy(region + L->x, x, (size_t)(num_tokens * H) * 2);
        return;
    }
    uint8_t *codes = (uint8_t *)(region + L->x);
    float *scales = (float *)(region + L->x_scale);
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t *v = (const uint16_t *)x + t * H + b * MOK_FP8_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < MOK_FP8_BLOCK; ++i) amax = mok__fp8_amax(amax, mok__bf16_to_f32(v[i]));
            const int e = mok__fp8_scale_exp(amax);
            const float inverse = mok__fp8_pow2(-e);
            for (int i = 0; i < MOK_FP8_BLOCK; ++i)
                codes[t * H + b * MOK_FP8_BLOCK + i] = mok__fp8_quantize(mok__bf16_to_f32(v[i]), inverse);
            scales[t * blocks + b] = mok__fp8_pow2(e);
        }
}

void mok__cpu_copy_x_row(const cpu_pass *pass, int q, int64_t slot, int p, int64_t token) {
    const int64_t H = pass->ws->shape.hidden, blocks = H / MOK_FP8_BLOCK;
    const mok_region_layout *L = &pass->cw->sym;
    const char *src = pass->R->peers[p];
    char *dst = pass->R->peers[q];
    if (!is_fp8(pass)) {
        memcpy(dst + L->ring_x + (size_t)(slot * H) * 2, src + L->x + (size_t)(token * H) * 2, (size_t)H * 2);
        return;
    }
    memcpy(dst + L->ring_x + (size_t)(slot * H), src + L->x + (size_t)(token * H), (size_t)H);
    memcpy(dst + L->ring_x_scale + (size_t)(slot * blocks) * 4, src + L->x_scale + (size_t)(token * blocks) * 4,
           (size_t)blocks * 4);
}

cpu_tile mok__cpu_tile(const cpu_pass *pass, int64_t rt) {
    cpu_tile t;
    t.row0 = rt * MOK_ROW_TILE;
    t.ring0 = t.row0 % pass->ws->config.ring_rows;
    t.expert = mok__sched_row_expert(&pass->sched, (int)pass->ws->num_local_experts, t.row0);
    t.nreal = 0;
    /* padding rows close an expert's segment, so the real rows are a prefix of the tile */
    while (t.nreal < MOK_ROW_TILE && pass->sched.row_peer[t.row0 + t.nreal] >= 0) ++t.nreal;
    return t;
}

/* g and u ([nreal][NT], bf16-rounded values) of the tile's ring x rows, columns [n0, n0+NT). */
void mok__cpu_gateup(const cpu_pass *pass, const cpu_tile *tile, int64_t n0, float *scratch, float *g, float *u) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, I = s->intermediate;
    if (is_fp8(pass)) {
        const cpu_rank *R = pass->R;
        mok__cpu_rows_from_e4m3(scratch_a(scratch), mok__cpu_scratch_a_scale(pass, scratch),
                                R->ring_x8 + tile->ring0 * H, R->ring_x_scale + tile->ring0 * (H / MOK_FP8_BLOCK),
                                tile->nreal, H);
        mok__cpu_gemm_fp8_weight(pass, scratch, g, tile->nreal, H, MOK_FP8_W_GATE, tile->expert, I, n0);
        mok__cpu_gemm_fp8_weight(pass, scratch, u, tile->nreal, H, MOK_FP8_W_UP, tile->expert, I, n0);
    } else {
        const void *w_gate = pass->fa ? pass->fa->w_gate : pass->ba->w_gate;
        const void *w_up = pass->fa ? pass->fa->w_up : pass->ba->w_up;
        float *a = scratch_a(scratch), *bg = scratch_bt(pass, scratch, 0), *bu = scratch_bt(pass, scratch, 1);
        mok__cpu_rows_to_f32(a, pass->R->ring_x + tile->ring0 * H, H, tile->nreal, H);
        mok__cpu_bt_from_nk(bg, (const uint16_t *)w_gate + (int64_t)tile->expert * I * H, H, n0, NT, H);
        mok__cpu_bt_from_nk(bu, (const uint16_t *)w_up + (int64_t)tile->expert * I * H, H, n0, NT, H);
        mok__cpu_gemm(g, a, tile->nreal, H, bg, NT);
        mok__cpu_gemm(u, a, tile->nreal, H, bu, NT);
    }
    for (int i = 0; i < tile->nreal * NT; ++i) {
        g[i] = mok__round_bf16(g[i]);
        u[i] = mok__round_bf16(u[i]);
    }
}

static void shared_up(cpu_pass *pass, int64_t mt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, Is = s->shared_intermediate, n0 = nt * NT, t0 = mt * MOK_ROW_TILE;
    const float limit = pass->ws->config.swiglu_limit;
    int rows = (int)(pass->plan.num_tokens - t0 < MOK_ROW_TILE ? pass->plan.num_tokens - t0 : MOK_ROW_TILE);
    float *a = scratch_a(scratch), *bg = scratch_bt(pass, scratch, 0), *bu = scratch_bt(pass, scratch, 1);
    float *g = scratch_acc(pass, scratch, 0), *u = scratch_acc(pass, scratch, 1);
    if (is_fp8(pass)) { /* this rank's own x, as staged */
        const char *region = pass->R->region;
        const uint8_t *x = (const uint8_t *)(region + pass->cw->sym.x) + t0 * H;
        const float *x_scale = (const float *)(region + pass->cw->sym.x_scale) + t0 * (H / MOK_FP8_BLOCK);
        mok__cpu_rows_from_e4m3(a, mok__cpu_scratch_a_scale(pass, scratch), x, x_scale, rows, H);
        mok__cpu_gemm_fp8_weight(pass, scratch, g, rows, H, MOK_FP8_S_GATE, 0, Is, n0);
        mok__cpu_gemm_fp8_weight(pass, scratch, u, rows, H, MOK_FP8_S_UP, 0, Is, n0);
    } else {
        mok__cpu_rows_to_f32(a, (const uint16_t *)pass->fa->x + t0 * H, H, rows, H);
        mok__cpu_bt_from_nk(bg, pass->fa->s_gate, H, n0, NT, H);
        mok__cpu_bt_from_nk(bu, pass->fa->s_up, H, n0, NT, H);
        mok__cpu_gemm(g, a, rows, H, bg, NT);
        mok__cpu_gemm(u, a, rows, H, bu, NT);
    }
    uint16_t *ctx = (uint16_t *)((char *)pass->fa->context + pass->ws->context_shared_offset);
    for (int r = 0; r < rows; ++r) {
        uint16_t *crow = ctx + (t0 + r) * 2 * Is;
        for (int n = 0; n < NT; ++n) {
            uint16_t gb = mok__bf16_from_f32(g[r * NT + n]), ub = mok__bf16_from_f32(u[r * NT + n]);
            crow[n0 + n] = gb;
            crow[Is + n0 + n] = ub;
            pass->R->sh_h[(t0 + r) * Is + n0 + n] =
                mok__bf16_from_f32(mok__swiglu(mok__bf16_to_f32(gb), mok__bf16_to_f32(ub), limit));
        }
    }
}

static void shared_down(cpu_pass *pass, int64_t mt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, Is = s->shared_intermediate, n0 = nt * NT, t0 = mt * MOK_ROW_TILE;
    int rows = (int)(pass->plan.num_tokens - t0 < MOK_ROW_TILE ? pass->plan.num_tokens - t0 : MOK_ROW_TILE);
    float *a = scratch_a(scratch), *bt = scratch_bt(pass, scratch, 0), *acc = scratch_acc(pass, scratch, 0);
    if (is_fp8(pass)) {
        mok__cpu_rows_quantize(a, mok__cpu_scratch_a_scale(pass, scratch), pass->R->sh_h + t0 * Is, rows, Is);
        mok__cpu_gemm_fp8_weight(pass, scratch, acc, rows, Is, MOK_FP8_S_DOWN, 0, H, n0);
    } else {
        mok__cpu_rows_to_f32(a, pass->R->sh_h + t0 * Is, Is, rows, Is);
        mok__cpu_bt_from_nk(bt, pass->fa->s_down, Is, n0, NT, Is);
        mok__cpu_gemm(acc, a, rows, Is, bt, NT);
    }
    for (int r = 0; r < rows; ++r)
        for (int n = 0; n < NT; ++n) pass->R->sh_out[(t0 + r) * H + n0 + n] = mok__bf16_from_f32(acc[r * NT + n]);
}

static void dispatch(cpu_pass *pass, int64_t rt) {
    const int64_t k = pass->ws->shape.topk;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    for (int r = 0; r < tile.nreal; ++r) {
        int p = pass->sched.row_peer[tile.row0 + r];
        int64_t token = pass->sched.row_slot[tile.row0 + r] / k;
        mok__cpu_copy_x_row(pass, pass->R->rank, tile.ring0 + r, p, token);
    }
}

static void gateup(cpu_pass *pass, int64_t rt, int64_t nt, float *scratch) {
    const int64_t I = pass->ws->shape.intermediate, n0 = nt * NT;
    const float limit = pass->ws->config.swiglu_limit;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    float *g = scratch_acc(pass, scratch, 0), *u = scratch_acc(pass, scratch, 1);
    mok__cpu_gateup(pass, &tile, n0, scratch, g, u);
    uint16_t *ctx = (uint16_t *)((char *)pass->fa->context + pass->ws->context_routed_offset);
    for (int r = 0; r < MOK_ROW_TILE; ++r) {
        int64_t row = tile.row0 + r;
        int real = r < tile.nreal;
        if (row < pass->ws->context_rows) {
            uint16_t *crow = ctx + row * 2 * I;
            for (int n = 0; n < NT; ++n) {
                crow[n0 + n] = real ? mok__bf16_from_f32(g[r * NT + n]) : 0;
                crow[I + n0 + n] = real ? mok__bf16_from_f32(u[r * NT + n]) : 0;
            }
        }
        if (!real) continue;
        uint16_t *h = pass->R->ring_h + (tile.ring0 + r) * I + n0;
        for (int n = 0; n < NT; ++n) h[n] = mok__bf16_from_f32(mok__swiglu(g[r * NT + n], u[r * NT + n], limit));
    }
}

static void down(cpu_pass *pass, int64_t rt, int64_t nt, float *scratch) {
    const int64_t H = pass->ws->shape.hidden, I = pass->ws->shape.intermediate, n0 = nt * NT;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    if (tile.nreal == 0) return;
    float *a = scratch_a(scratch), *bt = scratch_bt(pass, scratch, 0), *acc = scratch_acc(pass, scratch, 0);
    if (is_fp8(pass)) { /* h^: the tile's bf16 h rows quantized per 128 of I */
        mok__cpu_rows_quantize(a, mok__cpu_scratch_a_scale(pass, scratch), pass->R->ring_h + tile.ring0 * I,
                               tile.nreal, I);
        mok__cpu_gemm_fp8_weight(pass, scratch, acc, tile.nreal, I, MOK_FP8_W_DOWN, tile.expert, H, n0);
    } else {
        mok__cpu_rows_to_f32(a, pass->R->ring_h + tile.ring0 * I, I, tile.nreal, I);
        mok__cpu_bt_from_nk(bt, (const uint16_t *)pass->fa->w_down + (int64_t)tile.expert * H * I, I, n0, NT, I);
        mok__cpu_gemm(acc, a, tile.nreal, I, bt, NT);
    }
    for (int r = 0; r < tile.nreal; ++r)
        for (int n = 0; n < NT; ++n)
            pass->R->ring_y[(tile.ring0 + r) * H + n0 + n] = mok__bf16_from_f32(acc[r * NT + n]);
    /* in place (mok__plan_in_place): the tile's columns of each row also into its (token, slot) row
       of the combine buffer, which no COMBINE task follows to copy */
    if (mok__plan_in_place(&pass->plan))
        for (int r = 0; r < tile.nreal; ++r)
            memcpy(sym_bf16(pass->R, &pass->cw->sym, pass->R->rank, pass->cw->sym.comb) +
                       pass->sched.row_slot[tile.row0 + r] * H + n0,
                   pass->R->ring_y + (tile.ring0 + r) * H + n0, (size_t)NT * 2);
}

static void combine(cpu_pass *pass, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden;
    cpu_rank *R = pass->R;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    for (int r = 0; r < tile.nreal; ++r) {
        int p = pass->sched.row_peer[tile.row0 + r];
        int64_t slot = pass->sched.row_slot[tile.row0 + r];
        memcpy(sym_bf16(R, &pass->cw->sym, p, pass->cw->sym.comb) + slot * H, R->ring_y + (tile.ring0 + r) * H,
               (size_t)H * 2);
    }
}

/* combine_pull: the rows of peer q's row tile rt that this rank owns, from q's ring into this
 * rank's combine buffer; q's schedule is the copy in its region. */
static void gather(cpu_pass *pass, int q, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden, ring = pass->ws->config.ring_rows;
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    const mok_sched_view v = mok__sched_view(&pass->ws->sched_layout, R->peers[q] + L->sched);
    const uint16_t *ring_y = (const uint16_t *)(R->peers[q] + L->ring_y);
    uint16_t *comb = (uint16_t *)(R->region + L->comb);
    for (int64_t row = rt * MOK_ROW_TILE; row < (rt + 1) * MOK_ROW_TILE; ++row)
        if (v.row_peer[row] == R->rank)
            memcpy(comb + (int64_t)v.row_slot[row] * H, ring_y + (row % ring) * H, (size_t)H * 2);
}

/* dispatch_push: this rank's x rows of peer q's row tile rt, into q's ring (q's schedule is the
 * copy in its region). */
static void scatter(cpu_pass *pass, int q, int64_t rt) {
    const int64_t k = pass->ws->shape.topk, ring = pass->ws->config.ring_rows;
    cpu_rank *R = pass->R;
    const mok_sched_view v = mok__sched_view(&pass->ws->sched_layout, R->peers[q] + pass->cw->sym.sched);
    for (int64_t row = rt * MOK_ROW_TILE; row < (rt + 1) * MOK_ROW_TILE; ++row)
        if (v.row_peer[row] == R->rank) mok__cpu_copy_x_row(pass, q, row % ring, R->rank, v.row_slot[row] / k);
}

void mok__cpu_run_forward_task(cpu_pass *pass, const mok_task *t, float *scratch) {
    switch (t->kind) {
    case MOK_TASK_SHARED_UP: shared_up(pass, t->a, t->b, scratch); break;
    case MOK_TASK_SHARED_DOWN: shared_down(pass, t->a, t->b, scratch); break;
    case MOK_TASK_DISPATCH: dispatch(pass, t->a); break;
    case MOK_TASK_GATEUP: gateup(pass, t->a, t->b, scratch); break;
    case MOK_TASK_DOWN: down(pass, t->a, t->b, scratch); break;
    case MOK_TASK_COMBINE: combine(pass, t->a); break;
    case MOK_TASK_GATHER: gather(pass, t->peer, t->a); break;
    case MOK_TASK_SCATTER: scatter(pass, t->peer, t->a); break;
    default: break;
    }
}

/* y[t] = bf16(shared[t] + sum_j w[t,j] * comb[t,j]) in fp32, in that order. */
void mok__cpu_forward_epilogue(cpu_pass *pass, int64_t t0, int64_t t1) {
    const int64_t H = pass->ws->shape.hidden, k = pass->ws->shape.topk;
    const int has_shared = pass->ws->shape.shared_intermediate > 0;
    const uint16_t *comb = (const uint16_t *)(pass->R->region + pass->cw->sym.comb);
    const float *w = pass->fa->router_w;
    float *acc = pass->R->scratch;
    uint16_t *y = pass->fa->y;
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) acc[h] = has_shared ? mok__bf16_to_f32(pass->R->sh_out[t * H + h]) : 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            if (pass->sched.own_ids[t * k + j] < 0) continue;
            const float wj = w[t * k + j];
            const uint16_t *row = comb + (t * k + j) * H;
            for (int64_t h = 0; h < H; ++h) acc[h] += wj * mok__bf16_to_f32(row[h]);
        }
        for (int64_t h = 0; h < H; ++h) y[t * H + h] = mok__bf16_from_f32(acc[h]);
    }
}
