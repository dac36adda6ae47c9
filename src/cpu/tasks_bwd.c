/* tasks_bwd.c — the backward's tasks on the cpu backend and its epilogue.
 *
 * Rounding points beyond the forward's: dh = w * (dy · W_down) in fp32 (the router-weight
 * gradient is <dy·W_down, h>, never a division by w); dg, du rounded to bf16; each dx part
 * rounded to bf16; the down projection's weight gradient uses bf16(w * dy) as its operand.
 * Weight gradients: one task owns a tile and walks its expert's rows of a macrobatch in
 * schedule order, adding each row in turn to an fp32 accumulator that it carries to the next
 * macrobatch (the caller's fp32 buffer in accumulate mode, else a carry slot), so the result
 * does not depend on ring or minibatch sizes.
 *
 * FP8 (include/mok.h): the ring keeps dy and dg, du in bf16 (the weight gradients take them so)
 * and the dh and dx tiles quantize the rows they load; x arrives in the ring as E4M3 rows and
 * scales. The dh tile's h^ needs its row's amax over the whole 128 columns of I around the tile,
 * so it also forms h for the other tiles of that block (from the context, or replayed); it
 * leaves h^ (dequantized: exact in bf16) in ring_h, where the down projection's weight gradient
 * reads it. */
#include "core/fp8.h"
#include "cpu.h"

#define NT CPU_N_TILE
#define WT CPU_WGRAD_TILE

static size_t kmax_of(const mok_shape *sh) {
    size_t kmax = (size_t)(sh->hidden > sh->intermediate ? sh->hidden : sh->intermediate);
    if (2 * (size_t)sh->intermediate > kmax) kmax = 2 * (size_t)sh->intermediate;
    if (2 * (size_t)sh->shared_intermediate > kmax) kmax = 2 * (size_t)sh->shared_intermediate;
    return kmax;
}
static float *scratch_bt(const cpu_pass *p, float *s, int which) {
    size_t kmax = kmax_of(&p->ws->shape);
    return s + (size_t)MOK_ROW_TILE * kmax + (size_t)which * kmax * NT;
}
static float *scratch_acc(const cpu_pass *p, float *s, int which) {
    return scratch_bt(p, s, 2) + (size_t)which * MOK_ROW_TILE * NT;
}

static int is_fp8(const cpu_pass *pass) { return pass->ws->shape.precision == MOK_PRECISION_FP8; }

/* FP8: h^'s scale per row of a tile whose h is h(r, n) for n < NT (bf16-rounded values): folds
 * the tile's h into the rows' running amax. */
static void fold_h_amax(float *amax, int rows, const float *g, const float *u, float limit) {
    for (int r = 0; r < rows; ++r)
        for (int n = 0; n < NT; ++n)
            amax[r] = mok__fp8_amax(amax[r], mok__round_bf16(mok__swiglu(g[r * NT + n], u[r * NT + n], limit)));
}

/* The 128-column block of I around columns [n0, n0 + NT), as tiles: the first tile's column. */
static int64_t fp8_block_first(int64_t n0) { return n0 - n0 % MOK_FP8_BLOCK; }

static int token_rows(const cpu_pass *pass, int64_t t0) {
    int64_t left = pass->plan.num_tokens - t0;
    return (int)(left < MOK_ROW_TILE ? left : MOK_ROW_TILE);
}

static void shared_dh(cpu_pass *pass, int64_t mt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, Is = s->shared_intermediate, n0 = nt * NT, t0 = mt * MOK_ROW_TILE;
    const float limit = pass->ws->config.swiglu_limit;
    int rows = token_rows(pass, t0);
    float *a = scratch, *bt = scratch_bt(pass, scratch, 0), *dh = scratch_acc(pass, scratch, 0);
    const uint16_t *ctx = (const uint16_t *)((const char *)pass->ba->context + pass->ws->context_shared_offset);
    const int fp8 = is_fp8(pass);
    float h_scale[MOK_ROW_TILE], h_inverse[MOK_ROW_TILE];
    if (fp8) {
        mok__cpu_rows_quantize(a, mok__cpu_scratch_a_scale(pass, scratch), (const uint16_t *)pass->ba->dy + t0 * H,
                               rows, H);
        mok__cpu_gemm_fp8_weight(pass, scratch, dh, rows, H, MOK_FP8_S_DOWN_T, 0, Is, n0);
        /* h^'s scales: h over the whole 128-column block, from the context's g, u */
        float *g = scratch_acc(pass, scratch, 1), *u = scratch_acc(pass, scratch, 2), amax[MOK_ROW_TILE] = {0};
        for (int64_t c0 = fp8_block_first(n0); c0 < fp8_block_first(n0) + MOK_FP8_BLOCK; c0 += NT) {
            for (int r = 0; r < rows; ++r)
                for (int n = 0; n < NT; ++n) {
                    g[r * NT + n] = mok__bf16_to_f32(ctx[(t0 + r) * 2 * Is + c0 + n]);
                    u[r * NT + n] = mok__bf16_to_f32(ctx[(t0 + r) * 2 * Is + Is + c0 + n]);
                }
            fold_h_amax(amax, rows, g, u, limit);
        }
        for (int r = 0; r < rows; ++r) {
            const int e = mok__fp8_scale_exp(amax[r]);
            h_scale[r] = mok__fp8_pow2(e);
            h_inverse[r] = mok__fp8_pow2(-e);
        }
    } else {
        mok__cpu_rows_to_f32(a, (const uint16_t *)pass->ba->dy + t0 * H, H, rows, H);
        mok__cpu_bt_from_kn(bt, pass->ba->s_down, Is, n0, NT, H);
        mok__cpu_gemm(dh, a, rows, H, bt, NT);
    }
    for (int r = 0; r < rows; ++r) {
        const int64_t t = t0 + r;
        for (int n = 0; n < NT; ++n) {
            float g = mok__bf16_to_f32(ctx[t * 2 * Is + n0 + n]), u = mok__bf16_to_f32(ctx[t * 2 * Is + Is + n0 + n]);
            float h, dg, du;
            mok__swiglu_with_backward(dh[r * NT + n], g, u, limit, &h, &dg, &du);
            if (fp8) h = mok__fp8_round(mok__round_bf16(h), h_scale[r], h_inverse[r]); /* h^, exact in bf16 */
            pass->R->sh_h[t * Is + n0 + n] = mok__bf16_from_f32(h);
            pass->R->sh_dgu[t * 2 * Is + n0 + n] = mok__bf16_from_f32(dg);
            pass->R->sh_dgu[t * 2 * Is + Is + n0 + n] = mok__bf16_from_f32(du);
        }
    }
}

/* dx part = dg · W_gate + du · W_up: one K loop over [dg | du] against [W_gate ; W_up]. FP8: dg^,
 * du^ (the rows quantized per 128 of I as they load) against the transposed copies, K-major
 * [H, inter]; expert: the local expert, or -1 for the shared one. */
static void dx_tile(const cpu_pass *pass, const uint16_t *dgu, int rows, int64_t inter, int expert,
                    const uint16_t *w_gate, const uint16_t *w_up, int64_t n0, float *scratch, uint16_t *out,
                    int64_t ld_out) {
    const int64_t H = pass->ws->shape.hidden;
    float *a = scratch, *bt = scratch_bt(pass, scratch, 0), *acc = scratch_acc(pass, scratch, 0);
    if (is_fp8(pass)) {
        const cpu_fp8_weights w = mok__cpu_fp8_weights(pass);
        const int shared = expert < 0, gate = shared ? MOK_FP8_S_GATE_T : MOK_FP8_W_GATE_T;
        const int up = shared ? MOK_FP8_S_UP_T : MOK_FP8_W_UP_T;
        const int64_t e = shared ? 0 : expert;
        float *a_scale = mok__cpu_scratch_a_scale(pass, scratch);
        float *b_scale = a_scale + (size_t)MOK_ROW_TILE * (kmax_of(&pass->ws->shape) / MOK_FP8_BLOCK);
        mok__cpu_rows_quantize(a, a_scale, dgu, rows, 2 * inter);
        mok__cpu_bt_from_e4m3(bt, b_scale, mok__cpu_fp8_codes(&w, gate, e, H, inter),
                              mok__cpu_fp8_scales(&w, gate, e, H, inter), n0, NT, inter);
        mok__cpu_bt_from_e4m3(bt + inter * NT, b_scale + inter / MOK_FP8_BLOCK, mok__cpu_fp8_codes(&w, up, e, H, inter),
                              mok__cpu_fp8_scales(&w, up, e, H, inter), n0, NT, inter);
        mok__cpu_gemm_fp8(acc, a, a_scale, rows, 2 * inter, bt, b_scale, NT);
    } else {
        mok__cpu_rows_to_f32(a, dgu, 2 * inter, rows, 2 * inter);
        mok__cpu_bt_from_kn(bt, w_gate, H, n0, NT, inter);
        mok__cpu_bt_from_kn(bt + inter * NT, w_up, H, n0, NT, inter);
        mok__cpu_gemm(acc, a, rows, 2 * inter, bt, NT);
    }
    for (int r = 0; r < rows; ++r)
        for (int n = 0; n < NT; ++n) out[r * ld_out + n0 + n] = mok__bf16_from_f32(acc[r * NT + n]);
}

static void shared_dx(cpu_pass *pass, int64_t mt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, Is = s->shared_intermediate, t0 = mt * MOK_ROW_TILE;
    dx_tile(pass, pass->R->sh_dgu + t0 * 2 * Is, token_rows(pass, t0), Is, -1, pass->ba->s_gate, pass->ba->s_up,
            nt * NT, scratch, pass->R->sh_out + t0 * H, H);
}

static void pull(cpu_pass *pass, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden, k = pass->ws->shape.topk;
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    for (int r = 0; r < tile.nreal; ++r) {
        int p = pass->sched.row_peer[tile.row0 + r];
        int64_t slot = pass->sched.row_slot[tile.row0 + r], token = slot / k;
        memcpy(R->ring_dy + (tile.ring0 + r) * H, sym_bf16(R, L, p, L->dy) + token * H, (size_t)H * 2);
        mok__cpu_copy_x_row(pass, R->rank, tile.ring0 + r, p, token);
        R->ring_w[tile.ring0 + r] = ((const float *)(R->peers[p] + L->router_w))[slot];
    }
}

/* g, u ([nreal][NT], bf16 values) of the tile's columns [c0, c0 + NT): from the context, or, for
 * rows the context does not keep, replayed exactly as the forward computed them. */
static void load_gu(const cpu_pass *pass, const cpu_tile *tile, int64_t c0, float *scratch, float *g, float *u) {
    const int64_t I = pass->ws->shape.intermediate;
    if (tile->row0 < pass->ws->context_rows) {
        const uint16_t *ctx = (const uint16_t *)((const char *)pass->ba->context + pass->ws->context_routed_offset);
        for (int r = 0; r < tile->nreal; ++r)
            for (int n = 0; n < NT; ++n) {
                g[r * NT + n] = mok__bf16_to_f32(ctx[(tile->row0 + r) * 2 * I + c0 + n]);
                u[r * NT + n] = mok__bf16_to_f32(ctx[(tile->row0 + r) * 2 * I + I + c0 + n]);
            }
    } else {
        mok__cpu_gateup(pass, tile, c0, scratch, g, u);
    }
}

static void dh_task(cpu_pass *pass, int64_t rt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, I = s->intermediate, n0 = nt * NT, nI = I / NT;
    const float limit = pass->ws->config.swiglu_limit;
    cpu_rank *R = pass->R;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    if (tile.nreal == 0) return;
    float *dh = scratch_acc(pass, scratch, 0), *g = scratch_acc(pass, scratch, 1), *u = scratch_acc(pass, scratch, 2);
    float *a = scratch, *bt = scratch_bt(pass, scratch, 0);
    const int fp8 = is_fp8(pass);
    if (fp8) { /* dy^ · W^_down, against its transposed copy [I, H] (K-major) */
        mok__cpu_rows_quantize(a, mok__cpu_scratch_a_scale(pass, scratch), R->ring_dy + tile.ring0 * H, tile.nreal, H);
        mok__cpu_gemm_fp8_weight(pass, scratch, dh, tile.nreal, H, MOK_FP8_W_DOWN_T, tile.expert, I, n0);
    } else {
        mok__cpu_rows_to_f32(a, R->ring_dy + tile.ring0 * H, H, tile.nreal, H);
        mok__cpu_bt_from_kn(bt, (const uint16_t *)pass->ba->w_down + (int64_t)tile.expert * H * I, I, n0, NT, H);
        mok__cpu_gemm(dh, a, tile.nreal, H, bt, NT);
    }
    /* FP8: h^'s scale of each row needs h over the whole 128-column block: the other tiles of the
       block first (g, u of columns c0 then overwritten by the tile's own) */
    float amax[MOK_ROW_TILE] = {0}, h_scale[MOK_ROW_TILE], h_inverse[MOK_ROW_TILE];
    for (int64_t c0 = fp8_block_first(n0); fp8 && c0 < fp8_block_first(n0) + MOK_FP8_BLOCK; c0 += NT)
        if (c0 != n0) {
            load_gu(pass, &tile, c0, scratch, g, u);
            fold_h_amax(amax, tile.nreal, g, u, limit);
        }
    load_gu(pass, &tile, n0, scratch, g, u);
    if (fp8) {
        fold_h_amax(amax, tile.nreal, g, u, limit);
        for (int r = 0; r < tile.nreal; ++r) {
            const int e = mok__fp8_scale_exp(amax[r]);
            h_scale[r] = mok__fp8_pow2(e);
            h_inverse[r] = mok__fp8_pow2(-e);
        }
    }
    for (int r = 0; r < tile.nreal; ++r) {
        const int64_t ring = tile.ring0 + r;
        const float w = R->ring_w[ring];
        float dot = 0.0f;
        for (int n = 0; n < NT; ++n) {
            const int i = r * NT + n;
            uint16_t hb = mok__bf16_from_f32(mok__swiglu(g[i], u[i], limit));
            /* FP8: h^ (exact in bf16) takes h's place in the router dot and the weight gradient */
            if (fp8) hb = mok__bf16_from_f32(mok__fp8_round(mok__bf16_to_f32(hb), h_scale[r], h_inverse[r]));
            R->ring_h[ring * I + n0 + n] = hb;
            dot += dh[i] * mok__bf16_to_f32(hb);
            float dg, du;
            mok__swiglu_backward(w * dh[i], g[i], u[i], limit, &dg, &du);
            R->ring_dgu[ring * 2 * I + n0 + n] = mok__bf16_from_f32(dg);
            R->ring_dgu[ring * 2 * I + I + n0 + n] = mok__bf16_from_f32(du);
        }
        R->ring_rdot[ring * nI + nt] = dot;
    }
}

/* A row's d_router_w: the sum of its dh tiles' partial dot products, in column order. */
static float router_grad(const float *rdot, int64_t n) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += rdot[j];
    return sum;
}

static void dx_task(cpu_pass *pass, int64_t rt, int64_t nt, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, I = s->intermediate;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    if (tile.nreal == 0) return;
    const uint16_t *wg = (const uint16_t *)pass->ba->w_gate + (int64_t)tile.expert * I * H;
    const uint16_t *wu = (const uint16_t *)pass->ba->w_up + (int64_t)tile.expert * I * H;
    dx_tile(pass, pass->R->ring_dgu + tile.ring0 * 2 * I, tile.nreal, I, tile.expert, wg, wu, nt * NT, scratch,
            pass->R->ring_y + tile.ring0 * H, H);
    if (!mok__plan_in_place(&pass->plan)) return;
    /* in place (mok__plan_in_place): what push does, by each dx tile for its columns; the first
       column tile also sums the rows' d_router_w partials, which every dh tile of the row tile
       wrote before this task could start (its wait) */
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    for (int r = 0; r < tile.nreal; ++r) {
        const int64_t slot = pass->sched.row_slot[tile.row0 + r], ring = tile.ring0 + r;
        memcpy(sym_bf16(R, L, R->rank, L->dxbuf) + slot * H + nt * NT, R->ring_y + ring * H + nt * NT, (size_t)NT * 2);
        if (nt == 0) ((float *)(R->region + L->drw))[slot] = router_grad(R->ring_rdot + ring * (I / NT), I / NT);
    }
}

static void push(cpu_pass *pass, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden, nI = pass->ws->shape.intermediate / NT;
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    cpu_tile tile = mok__cpu_tile(pass, rt);
    for (int r = 0; r < tile.nreal; ++r) {
        int p = pass->sched.row_peer[tile.row0 + r];
        int64_t slot = pass->sched.row_slot[tile.row0 + r], ring = tile.ring0 + r;
        memcpy(sym_bf16(R, L, p, L->dxbuf) + slot * H, R->ring_y + ring * H, (size_t)H * 2);
        ((float *)(R->peers[p] + L->drw))[slot] = router_grad(R->ring_rdot + ring * nI, nI);
    }
}

/* dispatch_pull: the rows of peer q's row tile rt that this rank owns: their dx parts and
 * router-weight gradients (summed as push sums them), from q's ring into this rank's buffers. */
static void gather(cpu_pass *pass, int q, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden, nI = pass->ws->shape.intermediate / NT, ring = pass->ws->config.ring_rows;
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    const mok_sched_view v = mok__sched_view(&pass->ws->sched_layout, R->peers[q] + L->sched);
    const uint16_t *ring_y = (const uint16_t *)(R->peers[q] + L->ring_y);
    const float *rdot = (const float *)(R->peers[q] + L->ring_rdot);
    for (int64_t row = rt * MOK_ROW_TILE; row < (rt + 1) * MOK_ROW_TILE; ++row) {
        if (v.row_peer[row] != R->rank) continue;
        const int64_t slot = v.row_slot[row], r = row % ring;
        memcpy(sym_bf16(R, L, R->rank, L->dxbuf) + slot * H, ring_y + r * H, (size_t)H * 2);
        ((float *)(R->region + L->drw))[slot] = router_grad(rdot + r * nI, nI);
    }
}

/* combine_push: this rank's dy and x rows and router weights of peer q's row tile rt, into q's
 * ring (what q's PULL of the tile would have read from this rank). */
static void scatter(cpu_pass *pass, int q, int64_t rt) {
    const int64_t H = pass->ws->shape.hidden, k = pass->ws->shape.topk, ring = pass->ws->config.ring_rows;
    cpu_rank *R = pass->R;
    const mok_region_layout *L = &pass->cw->sym;
    const mok_sched_view v = mok__sched_view(&pass->ws->sched_layout, R->peers[q] + L->sched);
    uint16_t *ring_dy = (uint16_t *)(R->peers[q] + L->ring_dy);
    float *ring_w = (float *)(R->peers[q] + L->ring_w);
    for (int64_t row = rt * MOK_ROW_TILE; row < (rt + 1) * MOK_ROW_TILE; ++row) {
        if (v.row_peer[row] != R->rank) continue;
        const int64_t slot = v.row_slot[row], token = slot / k, r = row % ring;
        memcpy(ring_dy + r * H, sym_bf16(R, L, R->rank, L->dy) + token * H, (size_t)H * 2);
        mok__cpu_copy_x_row(pass, q, r, R->rank, token);
        ring_w[r] = ((const float *)(R->region + L->router_w))[slot];
    }
}

/* One weight-gradient tile: out[i0 + ii][j0 + jj] (+)= sum over rows of coef[row][ii] * vec[row][jj]. */
typedef struct wgrad_job {
    int matrix;
    int64_t i0, j0;
    int64_t cols;          /* row length of the output matrix */
    int64_t inter;         /* I (routed) or I_s (shared) */
    const uint16_t *dgu;   /* [rows, 2 inter] */
    const uint16_t *x;     /* [rows, H]; NULL for FP8 */
    const uint8_t *x8;     /* FP8: x^'s codes [rows, H] and scales [rows, H / 128]; else NULL */
    const float *x_scale;
    const uint16_t *dy;    /* [rows, H] */
    const uint16_t *h;     /* [rows, inter] */
    const float *w;        /* [rows] router weights, NULL = 1 */
} wgrad_job;

static void wgrad_rows(const cpu_pass *pass, const wgrad_job *j, int64_t first, int64_t end, int64_t ring_rows,
                       float *acc, float *vec) {
    const int64_t H = pass->ws->shape.hidden;
    for (int64_t row = first; row < end; ++row) {
        const int64_t r = ring_rows ? row % ring_rows : row;
        float coef[WT];
        if (j->matrix == MOK_WGRAD_DOWN) {
            const float w = j->w ? j->w[r] : 1.0f;
            for (int ii = 0; ii < WT; ++ii)
                coef[ii] = mok__round_bf16(w * mok__bf16_to_f32(j->dy[r * H + j->i0 + ii]));
            for (int jj = 0; jj < WT; ++jj) vec[jj] = mok__bf16_to_f32(j->h[r * j->inter + j->j0 + jj]);
        } else {
            const int64_t off = j->matrix == MOK_WGRAD_UP ? j->inter : 0;
            for (int ii = 0; ii < WT; ++ii) coef[ii] = mok__bf16_to_f32(j->dgu[r * 2 * j->inter + off + j->i0 + ii]);
            if (j->x8) { /* x^ dequantized (exact); the tile's columns lie in one 128-block */
                const float scale = j->x_scale[r * (H / MOK_FP8_BLOCK) + j->j0 / MOK_FP8_BLOCK];
                for (int jj = 0; jj < WT; ++jj) vec[jj] = mok__e4m3_to_f32(j->x8[r * H + j->j0 + jj]) * scale;
            } else {
                for (int jj = 0; jj < WT; ++jj) vec[jj] = mok__bf16_to_f32(j->x[r * H + j->j0 + jj]);
            }
        }
        for (int ii = 0; ii < WT; ++ii) {
            float *restrict out = acc + ii * WT;
            const float c = coef[ii];
            for (int jj = 0; jj < WT; ++jj) out[jj] += c * vec[jj];
        }
    }
}

static void tile_load_f32(float *acc, const float *src, int64_t ld) {
    for (int ii = 0; ii < WT; ++ii)
        for (int jj = 0; jj < WT; ++jj) acc[ii * WT + jj] = src[ii * ld + jj];
}
static void tile_store_f32(float *dst, const float *acc, int64_t ld) {
    for (int ii = 0; ii < WT; ++ii)
        for (int jj = 0; jj < WT; ++jj) dst[ii * ld + jj] = acc[ii * WT + jj];
}
static void tile_store_bf16(uint16_t *dst, const float *acc, int64_t ld) {
    for (int ii = 0; ii < WT; ++ii)
        for (int jj = 0; jj < WT; ++jj) dst[ii * ld + jj] = mok__bf16_from_f32(acc[ii * WT + jj]);
}

static void *wgrad_dest(const mok_backward_args *b, int matrix, int shared) {
    if (shared) return matrix == MOK_WGRAD_GATE ? b->ds_gate : matrix == MOK_WGRAD_UP ? b->ds_up : b->ds_down;
    return matrix == MOK_WGRAD_GATE ? b->dw_gate : matrix == MOK_WGRAD_UP ? b->dw_up : b->dw_down;
}

static void wgrad(cpu_pass *pass, const mok_task *t, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, I = s->intermediate, ring_rows = pass->ws->config.ring_rows;
    cpu_rank *R = pass->R;
    const int e = t->expert;
    int64_t first, end;
    mok__expert_rows_in(&pass->plan, e, t->minibatch, &first, &end);
    wgrad_job j = {t->matrix, (int64_t)t->a * WT,   (int64_t)t->b * WT, t->matrix == MOK_WGRAD_DOWN ? I : H,
                   I,         R->ring_dgu,          R->ring_x,          R->ring_x8,
                   R->ring_x_scale, R->ring_dy,     R->ring_h,          R->ring_w};
    const int64_t mat_elems = I * H, offset = (int64_t)e * mat_elems + j.i0 * j.cols + j.j0;
    float *acc = scratch_acc(pass, scratch, 3), *vec = acc + WT * WT;
    const int64_t start = pass->sched.expert_start[e];
    const int began_before = first > start;
    const int continues = start + pass->sched.expert_rows[e] > end;
    float *carry = R->carry + (start / ring_rows) * 3 * mat_elems + (int64_t)t->matrix * mat_elems +
                   (offset - (int64_t)e * mat_elems);
    void *dest = wgrad_dest(pass->ba, t->matrix, 0);
    if (pass->ba->accumulate) tile_load_f32(acc, (const float *)dest + offset, j.cols);
    else if (began_before) tile_load_f32(acc, carry, j.cols);
    else memset(acc, 0, sizeof(float) * WT * WT);
    wgrad_rows(pass, &j, first, end, ring_rows, acc, vec);
    if (pass->ba->accumulate) tile_store_f32((float *)dest + offset, acc, j.cols);
    else if (continues) tile_store_f32(carry, acc, j.cols);
    else tile_store_bf16((uint16_t *)dest + offset, acc, j.cols);
}

static void shared_wgrad(cpu_pass *pass, const mok_task *t, float *scratch) {
    const mok_shape *s = &pass->ws->shape;
    const int64_t H = s->hidden, Is = s->shared_intermediate;
    cpu_rank *R = pass->R;
    const int fp8 = is_fp8(pass); /* FP8: x^ as staged in this rank's region */
    wgrad_job j = {t->matrix,
                   (int64_t)t->a * WT,
                   (int64_t)t->b * WT,
                   t->matrix == MOK_WGRAD_DOWN ? Is : H,
                   Is,
                   R->sh_dgu,
                   fp8 ? NULL : pass->ba->x,
                   fp8 ? (const uint8_t *)(R->region + pass->cw->sym.x) : NULL,
                   fp8 ? (const float *)(R->region + pass->cw->sym.x_scale) : NULL,
                   pass->ba->dy,
                   R->sh_h,
                   NULL};
    const int64_t offset = j.i0 * j.cols + j.j0;
    float *acc = scratch_acc(pass, scratch, 3), *vec = acc + WT * WT;
    void *dest = wgrad_dest(pass->ba, t->matrix, 1);
    if (pass->ba->accumulate) tile_load_f32(acc, (const float *)dest + offset, j.cols);
    else memset(acc, 0, sizeof(float) * WT * WT);
    wgrad_rows(pass, &j, 0, pass->plan.num_tokens, 0, acc, vec);
    if (pass->ba->accumulate) tile_store_f32((float *)dest + offset, acc, j.cols);
    else tile_store_bf16((uint16_t *)dest + offset, acc, j.cols);
}

static void wgrad_zero(cpu_pass *pass, int e) {
    const int64_t n = pass->ws->shape.intermediate * pass->ws->shape.hidden;
    for (int m = 0; m < 3; ++m) memset((uint16_t *)wgrad_dest(pass->ba, m, 0) + (int64_t)e * n, 0, (size_t)n * 2);
}

void mok__cpu_run_backward_task(cpu_pass *pass, const mok_task *t, float *scratch) {
    switch (t->kind) {
    case MOK_TASK_SHARED_DH: shared_dh(pass, t->a, t->b, scratch); break;
    case MOK_TASK_SHARED_DX: shared_dx(pass, t->a, t->b, scratch); break;
    case MOK_TASK_PULL: pull(pass, t->a); break;
    case MOK_TASK_DH: dh_task(pass, t->a, t->b, scratch); break;
    case MOK_TASK_DX: dx_task(pass, t->a, t->b, scratch); break;
    case MOK_TASK_PUSH: push(pass, t->a); break;
    case MOK_TASK_GATHER: gather(pass, t->peer, t->a); break;
    case MOK_TASK_SCATTER: scatter(pass, t->peer, t->a); break;
    case MOK_TASK_OPEN: break; /* its counter is all it has */
    case MOK_TASK_WGRAD: wgrad(pass, t, scratch); break;
    case MOK_TASK_SHARED_WGRAD: shared_wgrad(pass, t, scratch); break;
    case MOK_TASK_WGRAD_ZERO: wgrad_zero(pass, t->expert); break;
    default: break;
    }
}

/* dx[t] = bf16(shared part + sum_j routed parts) in fp32, in that order; d_router_w from the
 * experts' owners, 0 for empty slots. */
void mok__cpu_backward_epilogue(cpu_pass *pass, int64_t t0, int64_t t1) {
    const int64_t H = pass->ws->shape.hidden, k = pass->ws->shape.topk;
    const int has_shared = pass->ws->shape.shared_intermediate > 0;
    const uint16_t *dxbuf = (const uint16_t *)(pass->R->region + pass->cw->sym.dxbuf);
    const float *drw = (const float *)(pass->R->region + pass->cw->sym.drw);
    float *acc = pass->R->scratch;
    uint16_t *dx = pass->ba->dx;
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) acc[h] = has_shared ? mok__bf16_to_f32(pass->R->sh_out[t * H + h]) : 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const int valid = pass->sched.own_ids[t * k + j] >= 0;
            pass->ba->d_router_w[t * k + j] = valid ? drw[t * k + j] : 0.0f;
            if (!valid) continue;
            const uint16_t *row = dxbuf + (t * k + j) * H;
            for (int64_t h = 0; h < H; ++h) acc[h] += mok__bf16_to_f32(row[h]);
        }
        for (int64_t h = 0; h < H; ++h) dx[t * H + h] = mok__bf16_from_f32(acc[h]);
    }
}
