/* test_ref.c — checks of the reference itself, since every other test trusts it: its gradients
 * against central finite differences of its own unrounded fp64 form (with and without the SwiGLU
 * clamp), a layer small enough to work out by hand (empty slots, zero and negative router
 * weights, the shared expert), a straight-line evaluation of the contract on random bf16 layers
 * compared bit for bit, and the bad inputs every rule of the API names. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/portable.h"
#include "mok.h"
#include "ref/ref.h"
#include "test.h"

/* Tolerances of the finite-difference checks, and why:
 *   FD_STEP 1e-5   central differences of a smooth fp64 function: truncation ~ step^2 ~ 1e-10,
 *                  cancellation ~ 1e-16 * |loss| / step ~ 1e-10 for a loss of order 10;
 *   FD_RTOL 1e-6   relative agreement of the backward and the finite difference;
 *   FD_ATOL 1e-8   floor for derivatives at or near zero (experts without rows, clamped values);
 *   FD_MARGIN 1e-4 the least distance of every g and u from the clamp's kinks: a step moves them
 *                  by less than 1e-5 * |weight or x| < 1e-4, so no step crosses a kink.
 * The rounded checks (hand case, straight line) are exact: both sides round the same fp64 values. */
#define FD_STEP 1e-5
#define FD_RTOL 1e-6
#define FD_ATOL 1e-8
#define FD_MARGIN 1e-4

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t next_random(uint64_t *state) { /* splitmix64 */
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double random_uniform(uint64_t *state) { return (double)(next_random(state) >> 11) * 0x1.0p-53; }

static double random_normal(uint64_t *state) {
    double a = random_uniform(state), b = random_uniform(state);
    return sqrt(-2.0 * log(1.0 - a)) * cos(6.283185307179586 * b);
}

/* k distinct experts per token. */
static void random_ids(uint64_t *state, int32_t *ids, int64_t tokens, int64_t topk, int64_t experts) {
    int32_t order[256];
    for (int64_t t = 0; t < tokens; ++t) {
        for (int32_t e = 0; e < experts; ++e) order[e] = e;
        for (int64_t j = 0; j < topk; ++j) {
            int64_t pick = j + (int64_t)(next_random(state) % (uint64_t)(experts - j));
            int32_t swap = order[j];
            order[j] = order[pick];
            order[pick] = swap;
            ids[t * topk + j] = order[j];
        }
    }
}

/* bf16 rounding of an fp64 value, done another way than the reference does it: round to odd into
 * fp32 (which keeps what decides the final rounding), then ties-to-even on the bits. */
static uint16_t to_bf16(double value) {
    float narrow = (float)value;
    uint32_t bits;
    if (isnan(narrow)) {
        memcpy(&bits, &narrow, sizeof bits);
        return (uint16_t)((bits >> 16) | 0x0040u);
    }
    if ((double)narrow != value) { /* inexact: truncate toward zero, then set the sticky bit */
        if (fabs((double)narrow) > fabs(value)) narrow = nextafterf(narrow, 0.0f);
        memcpy(&bits, &narrow, sizeof bits);
        bits |= 1u;
        memcpy(&narrow, &bits, sizeof bits);
    }
    memcpy(&bits, &narrow, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static double from_bf16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static double round_bf16(double value) { return from_bf16(to_bf16(value)); }

static void *zalloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test_ref: out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- 1. gradients against finite differences ------------------------------------------------ */

#define FD_RANKS 2

typedef struct fd_fixture {
    mok_shape shape;
    int64_t num_tokens[FD_RANKS];
    int32_t *ids[FD_RANKS];
    double *x[FD_RANKS], *router_w[FD_RANKS], *w_gate[FD_RANKS], *w_up[FD_RANKS], *w_down[FD_RANKS];
    double *s_gate, *s_up, *s_down;
    double *dy[FD_RANKS], *y[FD_RANKS];
    const double *cx[FD_RANKS], *crouter_w[FD_RANKS], *cw_gate[FD_RANKS], *cw_up[FD_RANKS],
        *cw_down[FD_RANKS], *cdy[FD_RANKS];
    const int32_t *cids[FD_RANKS];
    mok__ref_layer64 layer;
    /* the backward's gradients */
    double *dx[FD_RANKS], *d_router_w[FD_RANKS];
    double *dw_gate[FD_RANKS], *dw_up[FD_RANKS], *dw_down[FD_RANKS];
    double *ds_gate[FD_RANKS], *ds_up[FD_RANKS], *ds_down[FD_RANKS];
} fd_fixture;

static double *fd_normal(uint64_t *state, int64_t count, double scale) {
    double *a = zalloc((size_t)count * sizeof(double));
    for (int64_t i = 0; i < count; ++i) a[i] = scale * random_normal(state);
    return a;
}

/* P = 2, H = I = I_s = 64, E = 4, k = 2, three tokens per rank; one empty slot, one negative
 * router weight. */
static void fd_build(fd_fixture *f, uint64_t seed) {
    uint64_t state = seed;
    memset(f, 0, sizeof *f);
    f->shape = (mok_shape){.hidden = 64, .intermediate = 64, .num_experts = 4, .topk = 2,
                           .shared_intermediate = 64, .max_tokens = 3, .precision = MOK_PRECISION_BF16};
    int64_t H = f->shape.hidden, I = f->shape.intermediate, Is = f->shape.shared_intermediate;
    int64_t k = f->shape.topk, E_local = f->shape.num_experts / FD_RANKS;
    for (int p = 0; p < FD_RANKS; ++p) {
        int64_t T = f->num_tokens[p] = 3;
        f->ids[p] = zalloc((size_t)(T * k) * sizeof(int32_t));
        random_ids(&state, f->ids[p], T, k, f->shape.num_experts);
        f->x[p] = fd_normal(&state, T * H, 1.0);
        f->dy[p] = fd_normal(&state, T * H, 1.0);
        f->y[p] = zalloc((size_t)(T * H) * sizeof(double));
        f->router_w[p] = zalloc((size_t)(T * k) * sizeof(double));
        for (int64_t i = 0; i < T * k; ++i) f->router_w[p][i] = 0.1 + 0.9 * random_uniform(&state);
        f->w_gate[p] = fd_normal(&state, E_local * I * H, 1.0 / sqrt((double)H));
        f->w_up[p] = fd_normal(&state, E_local * I * H, 1.0 / sqrt((double)H));
        f->w_down[p] = fd_normal(&state, E_local * H * I, 1.0 / sqrt((double)I));
        f->dx[p] = zalloc((size_t)(T * H) * sizeof(double));
        f->d_router_w[p] = zalloc((size_t)(T * k) * sizeof(double));
        f->dw_gate[p] = zalloc((size_t)(E_local * I * H) * sizeof(double));
        f->dw_up[p] = zalloc((size_t)(E_local * I * H) * sizeof(double));
        f->dw_down[p] = zalloc((size_t)(E_local * I * H) * sizeof(double));
        f->ds_gate[p] = zalloc((size_t)(Is * H) * sizeof(double));
        f->ds_up[p] = zalloc((size_t)(Is * H) * sizeof(double));
        f->ds_down[p] = zalloc((size_t)(Is * H) * sizeof(double));
        f->cx[p] = f->x[p], f->crouter_w[p] = f->router_w[p], f->cids[p] = f->ids[p];
        f->cw_gate[p] = f->w_gate[p], f->cw_up[p] = f->w_up[p], f->cw_down[p] = f->w_down[p];
        f->cdy[p] = f->dy[p];
    }
    f->ids[0][1 * k + 1] = -1;      /* rank 0, token 1, slot 1: empty */
    f->router_w[1][2 * k + 0] = -0.7; /* rank 1, token 2, slot 0: negative */
    f->s_gate = fd_normal(&state, Is * H, 1.0 / sqrt((double)H));
    f->s_up = fd_normal(&state, Is * H, 1.0 / sqrt((double)H));
    f->s_down = fd_normal(&state, H * Is, 1.0 / sqrt((double)Is));
    f->layer = (mok__ref_layer64){.shape = &f->shape, .nranks = FD_RANKS, .swiglu_limit = 0.0,
                                  .num_tokens = f->num_tokens, .x = f->cx, .topk_ids = f->cids,
                                  .router_w = f->crouter_w, .w_gate = f->cw_gate, .w_up = f->cw_up,
                                  .w_down = f->cw_down, .s_gate = f->s_gate, .s_up = f->s_up,
                                  .s_down = f->s_down};
}

static void fd_free(fd_fixture *f) {
    for (int p = 0; p < FD_RANKS; ++p) {
        free(f->ids[p]), free(f->x[p]), free(f->router_w[p]), free(f->w_gate[p]), free(f->w_up[p]);
        free(f->w_down[p]), free(f->dy[p]), free(f->y[p]), free(f->dx[p]), free(f->d_router_w[p]);
        free(f->dw_gate[p]), free(f->dw_up[p]), free(f->dw_down[p]);
        free(f->ds_gate[p]), free(f->ds_up[p]), free(f->ds_down[p]);
    }
    free(f->s_gate), free(f->s_up), free(f->s_down);
}

/* loss = sum(y .* dy) of the unrounded layer, whose gradient the unrounded backward computes. */
static double fd_loss(fd_fixture *f) {
    if (mok__ref_forward_ex(&f->layer, f->y, 0) != MOK_OK) return NAN;
    double loss = 0.0;
    for (int p = 0; p < FD_RANKS; ++p)
        for (int64_t i = 0; i < f->num_tokens[p] * f->shape.hidden; ++i) loss += f->y[p][i] * f->dy[p][i];
    return loss;
}

static void fd_expect(fd_fixture *f, double *param, double analytic, const char *what, int64_t index) {
    double old = *param, step = FD_STEP * fmax(1.0, fabs(old));
    double above = old + step, below = old - step;
    *param = above;
    double loss_above = fd_loss(f);
    *param = below;
    double loss_below = fd_loss(f);
    *param = old;
    double numeric = (loss_above - loss_below) / (above - below);
    double bound = FD_RTOL * fmax(fabs(analytic), fabs(numeric)) + FD_ATOL;
    CHECK(fabs(analytic - numeric) <= bound, "%s[%lld]: backward %.12g, finite difference %.12g (limit %g)",
          what, (long long)index, analytic, numeric, f->layer.swiglu_limit);
}

/* Every g and u (routed and shared) of the layer, for placing the clamp away from them. */
static int64_t fd_preactivations(const fd_fixture *f, double *gates, double *ups) {
    int64_t H = f->shape.hidden, I = f->shape.intermediate, k = f->shape.topk, n = 0;
    int64_t E_local = f->shape.num_experts / FD_RANKS;
    for (int p = 0; p < FD_RANKS; ++p)
        for (int64_t t = 0; t < f->num_tokens[p]; ++t)
            for (int64_t j = -1; j < k; ++j) { /* j = -1: the shared expert */
                const double *wg = f->s_gate, *wu = f->s_up;
                int64_t rows = f->shape.shared_intermediate;
                if (j >= 0) {
                    int32_t e = f->ids[p][t * k + j];
                    if (e < 0) continue;
                    wg = f->w_gate[e / E_local] + (e % E_local) * I * H;
                    wu = f->w_up[e / E_local] + (e % E_local) * I * H;
                    rows = I;
                }
                for (int64_t i = 0; i < rows; ++i, ++n) {
                    gates[n] = ups[n] = 0.0;
                    for (int64_t h = 0; h < H; ++h) {
                        gates[n] += wg[i * H + h] * f->x[p][t * H + h];
                        ups[n] += wu[i * H + h] * f->x[p][t * H + h];
                    }
                }
            }
    return n;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A limit in the widest gap between the kinks' candidates (g and |u|) in the upper half of the
 * positive values, so that a good share of values is clamped and none sits near a kink. */
static double fd_pick_limit(const fd_fixture *f, double *margin, int64_t *clamped_gates, int64_t *clamped_ups) {
    int64_t rows = f->shape.intermediate > f->shape.shared_intermediate ? f->shape.intermediate
                                                                        : f->shape.shared_intermediate;
    int64_t capacity = FD_RANKS * f->shape.max_tokens * (f->shape.topk + 1) * rows;
    double *gates = zalloc((size_t)capacity * sizeof(double)), *ups = zalloc((size_t)capacity * sizeof(double));
    double *kinks = zalloc((size_t)(2 * capacity) * sizeof(double));
    int64_t n = fd_preactivations(f, gates, ups), m = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (gates[i] > 0.0) kinks[m++] = gates[i];
        kinks[m++] = fabs(ups[i]);
    }
    qsort(kinks, (size_t)m, sizeof(double), compare_doubles);
    double limit = 0.0, gap = 0.0;
    for (int64_t i = m / 2; i + 1 < m * 9 / 10; ++i)
        if (kinks[i + 1] - kinks[i] > gap) gap = kinks[i + 1] - kinks[i], limit = 0.5 * (kinks[i + 1] + kinks[i]);
    *margin = 0.5 * gap;
    *clamped_gates = *clamped_ups = 0;
    for (int64_t i = 0; i < n; ++i) {
        *clamped_gates += gates[i] > limit;
        *clamped_ups += fabs(ups[i]) > limit;
    }
    free(gates), free(ups), free(kinks);
    return limit;
}

static void fd_run(uint64_t seed, int clamp) {
    fd_fixture f;
    fd_build(&f, seed);
    if (clamp) {
        double margin;
        int64_t clamped_gates, clamped_ups;
        f.layer.swiglu_limit = fd_pick_limit(&f, &margin, &clamped_gates, &clamped_ups);
        CHECK(margin > FD_MARGIN, "no value may sit within %g of a kink; the closest is %g away", FD_MARGIN, margin);
        CHECK(clamped_gates > 0 && clamped_ups > 0, "limit %g clamps %lld gates and %lld ups",
              f.layer.swiglu_limit, (long long)clamped_gates, (long long)clamped_ups);
    }
    mok_status status = mok__ref_backward_ex(&f.layer, f.cdy, 0, f.dx, f.d_router_w, f.dw_gate, f.dw_up,
                                             f.dw_down, f.ds_gate, f.ds_up, f.ds_down);
    CHECK(status == MOK_OK, "mok__ref_backward_ex: %s", mok_last_error());
    if (status != MOK_OK) {
        fd_free(&f);
        return;
    }
    int64_t H = f.shape.hidden, k = f.shape.topk;
    int64_t expert_size = (f.shape.num_experts / FD_RANKS) * f.shape.intermediate * H;
    int64_t shared_size = f.shape.shared_intermediate * H;
    int stride = mok_test_quick() ? 5 : 1;
    for (int p = 0; p < FD_RANKS; ++p) {
        for (int64_t i = 0; i < f.num_tokens[p] * H; i += stride) fd_expect(&f, &f.x[p][i], f.dx[p][i], "dx", i);
        for (int64_t i = 0; i < f.num_tokens[p] * k; ++i)
            fd_expect(&f, &f.router_w[p][i], f.d_router_w[p][i], "d_router_w", i);
    }
    CHECK(f.d_router_w[0][1 * k + 1] == 0.0, "an empty slot gets d_router_w = 0, not %g", f.d_router_w[0][1 * k + 1]);

    uint64_t state = seed ^ 0x5eed;
    int samples = mok_test_quick() ? 8 : 24;
    for (int s = 0; s < samples; ++s) {
        int p = (int)(next_random(&state) % FD_RANKS);
        int64_t i = (int64_t)(next_random(&state) % (uint64_t)expert_size);
        fd_expect(&f, &f.w_gate[p][i], f.dw_gate[p][i], "dw_gate", i);
        fd_expect(&f, &f.w_up[p][i], f.dw_up[p][i], "dw_up", i);
        fd_expect(&f, &f.w_down[p][i], f.dw_down[p][i], "dw_down", i);
        /* One copy of the shared weights serves every rank: its gradient is the ranks' sum. */
        int64_t si = (int64_t)(next_random(&state) % (uint64_t)shared_size);
        double gate = 0.0, up = 0.0, down = 0.0;
        for (int q = 0; q < FD_RANKS; ++q) gate += f.ds_gate[q][si], up += f.ds_up[q][si], down += f.ds_down[q][si];
        fd_expect(&f, &f.s_gate[si], gate, "ds_gate", si);
        fd_expect(&f, &f.s_up[si], up, "ds_up", si);
        fd_expect(&f, &f.s_down[si], down, "ds_down", si);
    }
    fd_free(&f);
}

MOK_TEST(ref_gradients_match_finite_differences) { fd_run(mok_test_seed() * 2654435761ull + 1, 0); }

MOK_TEST(ref_gradients_match_finite_differences_clamped) { fd_run(mok_test_seed() * 2654435761ull + 2, 1); }

/* ---- 2. a layer worked out by hand ---------------------------------------------------------- */

/* H = I = I_s = 64, E = 2 on one rank, one token, x = 1 everywhere, dy = 1 everywhere.
 * Expert 1 (the one routed to) and the shared expert: W_gate = 1/64, W_up = 2/64, W_down = 1/64,
 * so g = 1, u = 2 and every output element is the same number:
 *   h = bf16(silu(1) * 2) = bf16(1.46211716) = 1.4609375 (187/128), FFN(x) = h,
 *   d_router_w = <dy, FFN(x)> = 64 h = 93.5 whatever the weight w.
 * Routed backward with w: dh = w * 64 / 64 = w, s = sigmoid(1),
 *   dg = bf16(w * 2 s (1 + (1 - s))), du = bf16(w s), dx part = bf16(dg + 2 du),
 *   dW_gate = dg, dW_up = du, dW_down = bf16(w) h; for w = 0.5: 0.92578125, 0.365234375,
 *   1.65625, 0.73046875.
 * Shared (w = 1): dg = 1.8515625, du = 0.73046875, dx part 3.3125; y = bf16(h + 0.5 h) = 2.1875,
 *   dx = bf16(3.3125 + 1.65625) = 4.96875.
 * Expert 0 holds 100 everywhere: any use of it shows. */
#define HAND_DIM 64
#define HAND_SIZE (HAND_DIM * HAND_DIM)

typedef struct hand_case {
    mok_shape shape;
    int64_t num_tokens[1];
    int32_t ids[2];
    float router_w[2];
    uint16_t x[HAND_DIM], dy[HAND_DIM], y[HAND_DIM], dx[HAND_DIM];
    uint16_t w_gate[2 * HAND_SIZE], w_up[2 * HAND_SIZE], w_down[2 * HAND_SIZE];
    uint16_t s_gate[HAND_SIZE], s_up[HAND_SIZE], s_down[HAND_SIZE];
    float d_router_w[2];
    float dw_gate[2 * HAND_SIZE], dw_up[2 * HAND_SIZE], dw_down[2 * HAND_SIZE];
    float ds_gate[HAND_SIZE], ds_up[HAND_SIZE], ds_down[HAND_SIZE];
} hand_case;

static void fill(uint16_t *a, int64_t n, double value) {
    for (int64_t i = 0; i < n; ++i) a[i] = to_bf16(value);
}

static void poison(void *a, size_t bytes) { memset(a, 0xff, bytes); /* NaN in bf16 and fp32 */ }

/* Runs forward and backward with k slots (ids, router weights) and the shared expert or not. */
static mok_status hand_run(hand_case *c, int64_t topk, const int32_t *ids, const float *router_w,
                           int shared, float limit) {
    c->shape = (mok_shape){.hidden = HAND_DIM, .intermediate = HAND_DIM, .num_experts = 2, .topk = topk,
                           .shared_intermediate = shared ? HAND_DIM : 0, .max_tokens = 1,
                           .precision = MOK_PRECISION_BF16};
    c->num_tokens[0] = 1;
    for (int64_t j = 0; j < topk; ++j) c->ids[j] = ids[j], c->router_w[j] = router_w[j];
    fill(c->x, HAND_DIM, 1.0);
    fill(c->dy, HAND_DIM, 1.0);
    fill(c->w_gate, HAND_SIZE, 100.0), fill(c->w_up, HAND_SIZE, 100.0), fill(c->w_down, HAND_SIZE, 100.0);
    fill(c->w_gate + HAND_SIZE, HAND_SIZE, 1.0 / 64), fill(c->w_up + HAND_SIZE, HAND_SIZE, 2.0 / 64);
    fill(c->w_down + HAND_SIZE, HAND_SIZE, 1.0 / 64);
    fill(c->s_gate, HAND_SIZE, 1.0 / 64), fill(c->s_up, HAND_SIZE, 2.0 / 64), fill(c->s_down, HAND_SIZE, 1.0 / 64);
    poison(c->y, sizeof c->y), poison(c->dx, sizeof c->dx), poison(c->d_router_w, sizeof c->d_router_w);
    poison(c->dw_gate, sizeof c->dw_gate), poison(c->dw_up, sizeof c->dw_up), poison(c->dw_down, sizeof c->dw_down);
    poison(c->ds_gate, sizeof c->ds_gate), poison(c->ds_up, sizeof c->ds_up), poison(c->ds_down, sizeof c->ds_down);

    const void *x[1] = {c->x}, *dy[1] = {c->dy};
    const int32_t *topk_ids[1] = {c->ids};
    const float *weights[1] = {c->router_w};
    const void *w_gate[1] = {c->w_gate}, *w_up[1] = {c->w_up}, *w_down[1] = {c->w_down};
    mok_ref_layer layer = {.shape = &c->shape, .nranks = 1, .swiglu_limit = limit, .num_tokens = c->num_tokens,
                           .x = x, .topk_ids = topk_ids, .router_w = weights, .w_gate = w_gate, .w_up = w_up,
                           .w_down = w_down, .s_gate = shared ? c->s_gate : NULL,
                           .s_up = shared ? c->s_up : NULL, .s_down = shared ? c->s_down : NULL};
    void *y[1] = {c->y}, *dx[1] = {c->dx};
    float *d_router_w[1] = {c->d_router_w};
    float *dw_gate[1] = {c->dw_gate}, *dw_up[1] = {c->dw_up}, *dw_down[1] = {c->dw_down};
    float *ds_gate[1] = {c->ds_gate}, *ds_up[1] = {c->ds_up}, *ds_down[1] = {c->ds_down};
    mok_status status = mok_ref_forward(&layer, y);
    if (status != MOK_OK) return status;
    return mok_ref_backward(&layer, dy, dx, d_router_w, dw_gate, dw_up, dw_down, shared ? ds_gate : NULL,
                            shared ? ds_up : NULL, shared ? ds_down : NULL);
}

/* Every element of a bf16 / fp32 array equals value (+0 and -0 are equal). */
static int all_bf16(const uint16_t *a, int64_t n, double value) {
    for (int64_t i = 0; i < n; ++i)
        if (from_bf16(a[i]) != value) return 0;
    return 1;
}

static int all_f32(const float *a, int64_t n, double value) {
    for (int64_t i = 0; i < n; ++i)
        if ((double)a[i] != value) return 0;
    return 1;
}

/* The hand values of one routed expert at router weight w, checked against the outputs. */
static void hand_expect_routed(const hand_case *c, double w, double y, double dx) {
    const double h = 1.4609375, s = 1.0 / (1.0 + exp(-1.0));
    double dg = round_bf16(w * 2.0 * s * (1.0 + (1.0 - s))), du = round_bf16(w * s);
    CHECK(all_bf16(c->y, HAND_DIM, y), "w = %g: y[0] = %g, want %g", w, from_bf16(c->y[0]), y);
    CHECK(all_bf16(c->dx, HAND_DIM, dx), "w = %g: dx[0] = %g, want %g", w, from_bf16(c->dx[0]), dx);
    CHECK(all_f32(c->dw_gate + HAND_SIZE, HAND_SIZE, dg), "w = %g: dw_gate = %g, want %g", w, c->dw_gate[HAND_SIZE], dg);
    CHECK(all_f32(c->dw_up + HAND_SIZE, HAND_SIZE, du), "w = %g: dw_up = %g, want %g", w, c->dw_up[HAND_SIZE], du);
    CHECK(all_f32(c->dw_down + HAND_SIZE, HAND_SIZE, round_bf16(w) * h), "w = %g: dw_down = %g, want %g", w,
          c->dw_down[HAND_SIZE], round_bf16(w) * h);
    CHECK(all_f32(c->dw_gate, HAND_SIZE, 0.0) && all_f32(c->dw_up, HAND_SIZE, 0.0) && all_f32(c->dw_down, HAND_SIZE, 0.0),
          "w = %g: expert 0 received no rows; its gradients must be zeros", w);
}

MOK_TEST(ref_hand_case) {
    hand_case *c = zalloc(sizeof *c);
    const double s = 1.0 / (1.0 + exp(-1.0));
    /* The constants of the comment above, from their definitions. */
    CHECK(round_bf16(s * 2.0) == 1.4609375, "h");
    CHECK(round_bf16(s * (2.0 - s)) == 0.92578125 && round_bf16(0.5 * s) == 0.365234375, "dg, du at w = 0.5");
    CHECK(round_bf16(0.92578125 + 2 * 0.365234375) == 1.65625, "dx part at w = 0.5");
    CHECK(round_bf16(2.0 * s * (2.0 - s)) == 1.8515625 && round_bf16(s) == 0.73046875, "shared dg, du");
    CHECK(round_bf16(1.4609375 + 0.5 * 1.4609375) == 2.1875 && round_bf16(3.3125 + 1.65625) == 4.96875, "sums");

    /* One slot, w = 0.5, no shared expert. */
    mok_status status = hand_run(c, 1, (int32_t[]){1}, (float[]){0.5f}, 0, 0.0f);
    CHECK(status == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, 0.5, 0.73046875, 1.65625);
    CHECK(c->d_router_w[0] == 93.5f, "d_router_w = %g, want 93.5", c->d_router_w[0]);

    /* With the shared expert. */
    status = hand_run(c, 1, (int32_t[]){1}, (float[]){0.5f}, 1, 0.0f);
    CHECK(status == MOK_OK, "%s", mok_last_error());
    CHECK(all_bf16(c->y, HAND_DIM, 2.1875), "shared: y[0] = %g, want 2.1875", from_bf16(c->y[0]));
    CHECK(all_bf16(c->dx, HAND_DIM, 4.96875), "shared: dx[0] = %g, want 4.96875", from_bf16(c->dx[0]));
    CHECK(c->d_router_w[0] == 93.5f, "shared: d_router_w = %g", c->d_router_w[0]);
    CHECK(all_f32(c->ds_gate, HAND_SIZE, 1.8515625) && all_f32(c->ds_up, HAND_SIZE, 0.73046875) &&
              all_f32(c->ds_down, HAND_SIZE, 1.4609375),
          "shared gradients: %g %g %g", c->ds_gate[0], c->ds_up[0], c->ds_down[0]);
    CHECK(all_f32(c->dw_gate + HAND_SIZE, HAND_SIZE, 0.92578125), "shared: routed dw_gate = %g", c->dw_gate[HAND_SIZE]);

    /* A NaN in x flows through as NaN (also through the clamp). */
    c->x[0] = 0x7fc0;
    {
        const void *x[1] = {c->x};
        const int32_t *ids[1] = {c->ids};
        const float *weights[1] = {c->router_w};
        const void *w_gate[1] = {c->w_gate}, *w_up[1] = {c->w_up}, *w_down[1] = {c->w_down};
        mok_ref_layer layer = {.shape = &c->shape, .nranks = 1, .swiglu_limit = 1.0f, .num_tokens = c->num_tokens,
                               .x = x, .topk_ids = ids, .router_w = weights, .w_gate = w_gate, .w_up = w_up,
                               .w_down = w_down, .s_gate = c->s_gate, .s_up = c->s_up, .s_down = c->s_down};
        void *y[1] = {c->y};
        CHECK(mok_ref_forward(&layer, y) == MOK_OK, "%s", mok_last_error());
        int nans = 0;
        for (int i = 0; i < HAND_DIM; ++i) nans += isnan(from_bf16(c->y[i]));
        CHECK(nans == HAND_DIM, "a NaN in x gives NaN everywhere in y; %d of %d are NaN", nans, HAND_DIM);
    }
    free(c);
}

MOK_TEST(ref_hand_case_slots_and_weights) {
    hand_case *c = zalloc(sizeof *c);
    const float nan = NAN;

    /* An empty slot is skipped whatever its weight, before or after the routed one. */
    CHECK(hand_run(c, 2, (int32_t[]){1, -1}, (float[]){0.5f, nan}, 0, 0.0f) == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, 0.5, 0.73046875, 1.65625);
    CHECK(c->d_router_w[0] == 93.5f && c->d_router_w[1] == 0.0f, "d_router_w = %g %g", c->d_router_w[0], c->d_router_w[1]);
    CHECK(hand_run(c, 2, (int32_t[]){-1, 1}, (float[]){nan, 0.5f}, 0, 0.0f) == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, 0.5, 0.73046875, 1.65625);
    CHECK(c->d_router_w[0] == 0.0f && c->d_router_w[1] == 93.5f, "d_router_w = %g %g", c->d_router_w[0], c->d_router_w[1]);

    /* Only empty slots: y and dx are zero, and so is every gradient. */
    CHECK(hand_run(c, 2, (int32_t[]){-1, -1}, (float[]){1.0f, 1.0f}, 0, 0.0f) == MOK_OK, "%s", mok_last_error());
    CHECK(all_bf16(c->y, HAND_DIM, 0.0) && all_bf16(c->dx, HAND_DIM, 0.0), "all slots empty: y, dx = 0");
    CHECK(c->d_router_w[0] == 0.0f && c->d_router_w[1] == 0.0f, "all slots empty: d_router_w = 0");
    CHECK(all_f32(c->dw_gate, 2 * HAND_SIZE, 0.0) && all_f32(c->dw_up, 2 * HAND_SIZE, 0.0) &&
              all_f32(c->dw_down, 2 * HAND_SIZE, 0.0),
          "all slots empty: zero weight gradients");

    /* Weight 0: no contribution to y, dx or the weight gradients, but the router gradient is
     * still <dy, FFN(x)>. */
    CHECK(hand_run(c, 1, (int32_t[]){1}, (float[]){0.0f}, 0, 0.0f) == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, 0.0, 0.0, 0.0);
    CHECK(c->d_router_w[0] == 93.5f, "w = 0: d_router_w = %g, want 93.5", c->d_router_w[0]);

    /* A negative weight: everything but d_router_w changes sign. */
    CHECK(hand_run(c, 1, (int32_t[]){1}, (float[]){-0.5f}, 0, 0.0f) == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, -0.5, -0.73046875, -1.65625);
    CHECK(c->d_router_w[0] == 93.5f, "w = -0.5: d_router_w = %g, want 93.5", c->d_router_w[0]);

    /* The clamp at 1.5 cuts u = 2 (and leaves g = 1): h = bf16(silu(1) 1.5), du = 0. */
    CHECK(hand_run(c, 1, (int32_t[]){1}, (float[]){1.0f}, 0, 1.5f) == MOK_OK, "%s", mok_last_error());
    {
        const double s = 1.0 / (1.0 + exp(-1.0)), h = round_bf16(s * 1.5);
        double dg = round_bf16(1.5 * s * (1.0 + (1.0 - s)));
        CHECK(all_bf16(c->y, HAND_DIM, h), "clamped: y[0] = %g, want %g", from_bf16(c->y[0]), h);
        CHECK(all_f32(c->dw_up + HAND_SIZE, HAND_SIZE, 0.0), "clamped: du = 0, dw_up = %g", c->dw_up[HAND_SIZE]);
        CHECK(all_f32(c->dw_gate + HAND_SIZE, HAND_SIZE, dg), "clamped: dw_gate = %g, want %g", c->dw_gate[HAND_SIZE], dg);
        CHECK(all_bf16(c->dx, HAND_DIM, dg), "clamped: dx = %g, want %g", from_bf16(c->dx[0]), dg);
    }
    /* At the limit exactly the gradient passes: with L = 1, g = 1 = L passes and u = 2 is cut. */
    CHECK(hand_run(c, 1, (int32_t[]){1}, (float[]){1.0f}, 0, 1.0f) == MOK_OK, "%s", mok_last_error());
    {
        const double s = 1.0 / (1.0 + exp(-1.0));
        double dg = round_bf16(1.0 * s * (1.0 + (1.0 - s)));
        CHECK(all_f32(c->dw_gate + HAND_SIZE, HAND_SIZE, dg), "g at the limit: dw_gate = %g, want %g",
              c->dw_gate[HAND_SIZE], dg);
        CHECK(all_f32(c->dw_up + HAND_SIZE, HAND_SIZE, 0.0), "u past the limit: dw_up = %g", c->dw_up[HAND_SIZE]);
    }
    /* At the limit exactly (u = 2 = L) the gradient passes. */
    CHECK(hand_run(c, 1, (int32_t[]){1}, (float[]){0.5f}, 0, 2.0f) == MOK_OK, "%s", mok_last_error());
    hand_expect_routed(c, 0.5, 0.73046875, 1.65625);
    free(c);
}

/* ---- 2b. the contract written out straight, on random bf16 layers --------------------------- */

#define LINE_RANKS 2

typedef struct line_layer {
    mok_shape shape;
    float limit;
    int64_t num_tokens[LINE_RANKS];
    int32_t *ids[LINE_RANKS];
    float *router_w[LINE_RANKS];
    uint16_t *x[LINE_RANKS], *dy[LINE_RANKS], *w_gate[LINE_RANKS], *w_up[LINE_RANKS], *w_down[LINE_RANKS];
    uint16_t *s_gate, *s_up, *s_down;
} line_layer;

static uint16_t *random_bf16(uint64_t *state, int64_t count, double scale) {
    uint16_t *a = zalloc((size_t)count * sizeof(uint16_t));
    for (int64_t i = 0; i < count; ++i) a[i] = to_bf16(scale * random_normal(state));
    return a;
}

/* One expert on one token, as the header of include/mok.h states it: g, u, h [I] and out [H]. */
static void line_expert(const line_layer *L, const uint16_t *wg, const uint16_t *wu, const uint16_t *wd,
                        int64_t I, const uint16_t *x, double *g, double *u, double *h, double *out) {
    int64_t H = L->shape.hidden;
    double limit = L->limit;
    for (int64_t i = 0; i < I; ++i) {
        double gate = 0.0, up = 0.0;
        for (int64_t c = 0; c < H; ++c) gate += from_bf16(wg[i * H + c]) * from_bf16(x[c]);
        for (int64_t c = 0; c < H; ++c) up += from_bf16(wu[i * H + c]) * from_bf16(x[c]);
        g[i] = round_bf16(gate), u[i] = round_bf16(up);
        double gc = g[i], uc = u[i];
        if (limit > 0 && gc > limit) gc = limit;
        if (limit > 0 && uc > limit) uc = limit;
        if (limit > 0 && uc < -limit) uc = -limit;
        h[i] = round_bf16(gc * (1.0 / (1.0 + exp(-gc))) * uc);
    }
    for (int64_t r = 0; r < H; ++r) {
        double sum = 0.0;
        for (int64_t i = 0; i < I; ++i) sum += from_bf16(wd[r * I + i]) * h[i];
        out[r] = round_bf16(sum);
    }
}

/* The backward of one expert on one token with weight w: the rounded dx part, and the fp64
 * weight gradients added into gate, up [I, H] and down [H, I]. */
static void line_expert_backward(const line_layer *L, const uint16_t *wg, const uint16_t *wu, const uint16_t *wd,
                                 int64_t I, const uint16_t *x, const uint16_t *dy, double w, const double *g,
                                 const double *u, const double *h, double *part, double *gate_grad,
                                 double *up_grad, double *down_grad) {
    int64_t H = L->shape.hidden;
    double limit = L->limit;
    double *dg = zalloc((size_t)I * sizeof(double)), *du = zalloc((size_t)I * sizeof(double));
    for (int64_t i = 0; i < I; ++i) {
        double dh0 = 0.0;
        for (int64_t r = 0; r < H; ++r) dh0 += from_bf16(wd[r * I + i]) * from_bf16(dy[r]);
        double dh = w * dh0;
        int gate_cut = limit > 0 && g[i] > limit, up_cut = limit > 0 && (u[i] > limit || u[i] < -limit);
        double gc = gate_cut ? limit : g[i], uc = up_cut ? (u[i] > 0 ? limit : -limit) : u[i];
        double s = 1.0 / (1.0 + exp(-gc));
        dg[i] = round_bf16(dh * uc * s * (1.0 + gc * (1.0 - s)) * (gate_cut ? 0.0 : 1.0));
        du[i] = round_bf16(dh * gc * s * (up_cut ? 0.0 : 1.0));
    }
    for (int64_t c = 0; c < H; ++c) {
        double sum = 0.0;
        for (int64_t i = 0; i < I; ++i) sum += from_bf16(wg[i * H + c]) * dg[i];
        for (int64_t i = 0; i < I; ++i) sum += from_bf16(wu[i * H + c]) * du[i];
        part[c] = round_bf16(sum);
    }
    for (int64_t i = 0; i < I; ++i)
        for (int64_t c = 0; c < H; ++c) {
            gate_grad[i * H + c] += dg[i] * from_bf16(x[c]);
            up_grad[i * H + c] += du[i] * from_bf16(x[c]);
        }
    for (int64_t r = 0; r < H; ++r)
        for (int64_t i = 0; i < I; ++i) down_grad[r * I + i] += round_bf16(w * from_bf16(dy[r])) * h[i];
    free(dg), free(du);
}

static void line_case(uint64_t seed, const int64_t *num_tokens, float limit, const int64_t *dims) {
    uint64_t state = seed;
    line_layer L;
    memset(&L, 0, sizeof L);
    L.shape = (mok_shape){.hidden = dims[0], .intermediate = dims[1], .num_experts = 4, .topk = 2,
                          .shared_intermediate = dims[2], .max_tokens = 4, .precision = MOK_PRECISION_BF16};
    L.limit = limit;
    int64_t H = L.shape.hidden, I = L.shape.intermediate, Is = L.shape.shared_intermediate, k = L.shape.topk;
    int64_t E_local = L.shape.num_experts / LINE_RANKS, expert_size = E_local * I * H;
    for (int p = 0; p < LINE_RANKS; ++p) {
        int64_t T = L.num_tokens[p] = num_tokens[p];
        if (T > 0) {
            L.ids[p] = zalloc((size_t)(T * k) * sizeof(int32_t));
            random_ids(&state, L.ids[p], T, k, L.shape.num_experts);
            L.router_w[p] = zalloc((size_t)(T * k) * sizeof(float));
            for (int64_t i = 0; i < T * k; ++i) L.router_w[p][i] = (float)(2.0 * random_uniform(&state) - 1.0);
            L.x[p] = random_bf16(&state, T * H, 1.0);
            L.dy[p] = random_bf16(&state, T * H, 1.0);
        }
        L.w_gate[p] = random_bf16(&state, expert_size, 1.0 / 8);
        L.w_up[p] = random_bf16(&state, expert_size, 1.0 / 8);
        L.w_down[p] = random_bf16(&state, expert_size, 1.0 / 8);
    }
    L.ids[0][k * (num_tokens[0] - 1) + 1] = -1; /* the last token of rank 0 has an empty slot */
    L.s_gate = random_bf16(&state, Is * H, 1.0 / 8);
    L.s_up = random_bf16(&state, Is * H, 1.0 / 8);
    L.s_down = random_bf16(&state, Is * H, 1.0 / 8);

    /* The expected values, token by token. */
    size_t wide = (size_t)(I > Is ? I : Is) * sizeof(double);
    double *g = zalloc(wide), *u = zalloc(wide), *h = zalloc(wide);
    double *out = zalloc((size_t)H * sizeof(double)), *part = zalloc((size_t)H * sizeof(double));
    double *y_sum = zalloc((size_t)H * sizeof(double)), *dx_sum = zalloc((size_t)H * sizeof(double));
    double *want_y[LINE_RANKS], *want_dx[LINE_RANKS], *want_drw[LINE_RANKS];
    double *want_dwg[LINE_RANKS], *want_dwu[LINE_RANKS], *want_dwd[LINE_RANKS];
    double *want_dsg[LINE_RANKS], *want_dsu[LINE_RANKS], *want_dsd[LINE_RANKS];
    for (int p = 0; p < LINE_RANKS; ++p) {
        want_y[p] = zalloc((size_t)(L.num_tokens[p] * H) * sizeof(double));
        want_dx[p] = zalloc((size_t)(L.num_tokens[p] * H) * sizeof(double));
        want_drw[p] = zalloc((size_t)(L.num_tokens[p] * k) * sizeof(double));
        want_dwg[p] = zalloc((size_t)expert_size * sizeof(double));
        want_dwu[p] = zalloc((size_t)expert_size * sizeof(double));
        want_dwd[p] = zalloc((size_t)expert_size * sizeof(double));
        want_dsg[p] = zalloc((size_t)(Is * H) * sizeof(double));
        want_dsu[p] = zalloc((size_t)(Is * H) * sizeof(double));
        want_dsd[p] = zalloc((size_t)(Is * H) * sizeof(double));
    }
    for (int p = 0; p < LINE_RANKS; ++p)
        for (int64_t t = 0; t < L.num_tokens[p]; ++t) {
            const uint16_t *x = L.x[p] + t * H, *dy = L.dy[p] + t * H;
            line_expert(&L, L.s_gate, L.s_up, L.s_down, Is, x, g, u, h, out);
            line_expert_backward(&L, L.s_gate, L.s_up, L.s_down, Is, x, dy, 1.0, g, u, h, part, want_dsg[p],
                                 want_dsu[p], want_dsd[p]);
            for (int64_t c = 0; c < H; ++c) y_sum[c] = out[c], dx_sum[c] = part[c];
            for (int64_t j = 0; j < k; ++j) {
                int32_t e = L.ids[p][t * k + j];
                if (e < 0) continue;
                int owner = (int)(e / E_local);
                int64_t offset = (e % E_local) * I * H;
                const uint16_t *wg = L.w_gate[owner] + offset, *wu = L.w_up[owner] + offset;
                const uint16_t *wd = L.w_down[owner] + offset;
                double w = L.router_w[p][t * k + j];
                line_expert(&L, wg, wu, wd, I, x, g, u, h, out);
                /* <dy, W_down h>: the expert output before its rounding */
                double dot = 0.0;
                for (int64_t c = 0; c < H; ++c) {
                    double o = 0.0;
                    for (int64_t i = 0; i < I; ++i) o += from_bf16(wd[c * I + i]) * h[i];
                    dot += from_bf16(dy[c]) * o;
                }
                want_drw[p][t * k + j] = dot;
                line_expert_backward(&L, wg, wu, wd, I, x, dy, w, g, u, h, part, want_dwg[owner] + offset,
                                     want_dwu[owner] + offset, want_dwd[owner] + offset);
                for (int64_t c = 0; c < H; ++c) y_sum[c] += w * out[c], dx_sum[c] += part[c];
            }
            for (int64_t c = 0; c < H; ++c)
                want_y[p][t * H + c] = round_bf16(y_sum[c]), want_dx[p][t * H + c] = round_bf16(dx_sum[c]);
        }

    /* The reference, outputs poisoned first. */
    uint16_t *y[LINE_RANKS], *dx[LINE_RANKS];
    float *drw[LINE_RANKS], *dwg[LINE_RANKS], *dwu[LINE_RANKS], *dwd[LINE_RANKS];
    float *dsg[LINE_RANKS], *dsu[LINE_RANKS], *dsd[LINE_RANKS];
    for (int p = 0; p < LINE_RANKS; ++p) {
        int64_t T = L.num_tokens[p];
        y[p] = T ? zalloc((size_t)(T * H) * 2) : NULL, dx[p] = T ? zalloc((size_t)(T * H) * 2) : NULL;
        drw[p] = T ? zalloc((size_t)(T * k) * 4) : NULL;
        if (T) poison(y[p], (size_t)(T * H) * 2), poison(dx[p], (size_t)(T * H) * 2), poison(drw[p], (size_t)(T * k) * 4);
        dwg[p] = zalloc((size_t)expert_size * 4), dwu[p] = zalloc((size_t)expert_size * 4);
        dwd[p] = zalloc((size_t)expert_size * 4);
        dsg[p] = zalloc((size_t)(Is * H) * 4), dsu[p] = zalloc((size_t)(Is * H) * 4), dsd[p] = zalloc((size_t)(Is * H) * 4);
        poison(dwg[p], (size_t)expert_size * 4), poison(dwu[p], (size_t)expert_size * 4);
        poison(dwd[p], (size_t)expert_size * 4), poison(dsg[p], (size_t)(Is * H) * 4);
        poison(dsu[p], (size_t)(Is * H) * 4), poison(dsd[p], (size_t)(Is * H) * 4);
    }
    const void *cx[LINE_RANKS], *cdy[LINE_RANKS], *cwg[LINE_RANKS], *cwu[LINE_RANKS], *cwd[LINE_RANKS];
    const int32_t *cids[LINE_RANKS];
    const float *crw[LINE_RANKS];
    void *vy[LINE_RANKS], *vdx[LINE_RANKS];
    for (int p = 0; p < LINE_RANKS; ++p) {
        cx[p] = L.x[p], cdy[p] = L.dy[p], cwg[p] = L.w_gate[p], cwu[p] = L.w_up[p], cwd[p] = L.w_down[p];
        cids[p] = L.ids[p], crw[p] = L.router_w[p], vy[p] = y[p], vdx[p] = dx[p];
    }
    mok_ref_layer layer = {.shape = &L.shape, .nranks = LINE_RANKS, .swiglu_limit = limit,
                           .num_tokens = L.num_tokens, .x = cx, .topk_ids = cids, .router_w = crw,
                           .w_gate = cwg, .w_up = cwu, .w_down = cwd, .s_gate = L.s_gate,
                           .s_up = L.s_up, .s_down = L.s_down};
    CHECK(mok_ref_forward(&layer, vy) == MOK_OK, "%s", mok_last_error());
    CHECK(mok_ref_backward(&layer, cdy, vdx, drw, dwg, dwu, dwd, dsg, dsu, dsd) == MOK_OK, "%s", mok_last_error());

    int64_t bad_y = 0, bad_dx = 0, bad_drw = 0, bad_dw = 0, bad_ds = 0;
    for (int p = 0; p < LINE_RANKS; ++p) {
        for (int64_t i = 0; i < L.num_tokens[p] * H; ++i) {
            bad_y += from_bf16(y[p][i]) != want_y[p][i];
            bad_dx += from_bf16(dx[p][i]) != want_dx[p][i];
        }
        for (int64_t i = 0; i < L.num_tokens[p] * k; ++i) bad_drw += drw[p][i] != (float)want_drw[p][i];
        for (int64_t i = 0; i < expert_size; ++i)
            bad_dw += (dwg[p][i] != (float)want_dwg[p][i]) + (dwu[p][i] != (float)want_dwu[p][i]) +
                      (dwd[p][i] != (float)want_dwd[p][i]);
        for (int64_t i = 0; i < Is * H; ++i)
            bad_ds += (dsg[p][i] != (float)want_dsg[p][i]) + (dsu[p][i] != (float)want_dsu[p][i]) +
                      (dsd[p][i] != (float)want_dsd[p][i]);
    }
    CHECK(bad_y == 0 && bad_dx == 0 && bad_drw == 0,
          "T = {%lld, %lld}, limit %g: %lld y, %lld dx, %lld d_router_w differ from the straight-line values",
          (long long)num_tokens[0], (long long)num_tokens[1], limit, (long long)bad_y, (long long)bad_dx,
          (long long)bad_drw);
    CHECK(bad_dw == 0 && bad_ds == 0, "T = {%lld, %lld}, limit %g: %lld dw, %lld ds differ",
          (long long)num_tokens[0], (long long)num_tokens[1], limit, (long long)bad_dw, (long long)bad_ds);
    if (num_tokens[1] == 0)
        CHECK(all_f32(dsg[1], Is * H, 0.0) && all_f32(dsu[1], Is * H, 0.0) && all_f32(dsd[1], Is * H, 0.0),
              "a rank without tokens has zero shared-expert gradients");

    for (int p = 0; p < LINE_RANKS; ++p) {
        free(L.ids[p]), free(L.router_w[p]), free(L.x[p]), free(L.dy[p]);
        free(L.w_gate[p]), free(L.w_up[p]), free(L.w_down[p]);
        free(want_y[p]), free(want_dx[p]), free(want_drw[p]), free(want_dwg[p]), free(want_dwu[p]);
        free(want_dwd[p]), free(want_dsg[p]), free(want_dsu[p]), free(want_dsd[p]);
        free(y[p]), free(dx[p]), free(drw[p]), free(dwg[p]), free(dwu[p]), free(dwd[p]);
        free(dsg[p]), free(dsu[p]), free(dsd[p]);
    }
    free(L.s_gate), free(L.s_up), free(L.s_down);
    free(g), free(u), free(h), free(out), free(part), free(y_sum), free(dx_sum);
}

MOK_TEST(ref_matches_straight_line_contract) {
    uint64_t seed = mok_test_seed() * 0x2545f4914f6cdd1dull + 3;
    const int64_t tiled[3] = {64, 64, 64}, odd[3] = {10, 7, 5}; /* H, I, I_s */
    line_case(seed, (int64_t[]){3, 2}, 0.0f, tiled);
    line_case(seed + 1, (int64_t[]){4, 0}, 0.0f, tiled);
    line_case(seed + 2, (int64_t[]){3, 4}, 0.25f, tiled); /* g, u ~ N(0, 1): most are clamped */
    line_case(seed + 3, (int64_t[]){2, 3}, 0.25f, odd);   /* the reference takes any size */
}

/* ---- 3. bad inputs -------------------------------------------------------------------------- */

/* A valid layer (P = 2, E = 4, k = 2, H = I = I_s = 64, T = {2, 1}) that each case breaks once. */
typedef struct bad_fixture {
    mok_shape shape;
    int64_t num_tokens[2];
    int32_t ids0[4], ids1[2];
    float rw0[4], rw1[2];
    uint16_t x0[128], x1[64], y0[128], y1[64];
    uint16_t *weights; /* [3][2][2 * 64 * 64] routed, then [3][64 * 64] shared */
    float *grads;      /* the same sizes, fp32 */
    float drw0[4], drw1[2];
    const void *x[2], *w_gate[2], *w_up[2], *w_down[2], *dy[2];
    const int32_t *ids[2];
    const float *router_w[2];
    void *y[2], *dx[2];
    float *d_router_w[2], *dw_gate[2], *dw_up[2], *dw_down[2], *ds_gate[2], *ds_up[2], *ds_down[2];
    mok_ref_layer layer;
} bad_fixture;

static void bad_reset(bad_fixture *b) {
    const int64_t expert = 2 * 64 * 64, shared = 64 * 64;
    b->shape = (mok_shape){.hidden = 64, .intermediate = 64, .num_experts = 4, .topk = 2,
                           .shared_intermediate = 64, .max_tokens = 2, .precision = MOK_PRECISION_BF16};
    b->num_tokens[0] = 2, b->num_tokens[1] = 1;
    int32_t ids0[4] = {0, 3, 2, -1}, ids1[2] = {1, 2};
    memcpy(b->ids0, ids0, sizeof ids0), memcpy(b->ids1, ids1, sizeof ids1);
    for (int i = 0; i < 4; ++i) b->rw0[i] = 0.25f;
    b->rw1[0] = b->rw1[1] = 0.5f;
    fill(b->x0, 128, 0.5), fill(b->x1, 64, -0.25);
    fill(b->weights, 6 * expert + 3 * shared, 1.0 / 64);
    b->x[0] = b->x0, b->x[1] = b->x1, b->dy[0] = b->x0, b->dy[1] = b->x1;
    b->ids[0] = b->ids0, b->ids[1] = b->ids1, b->router_w[0] = b->rw0, b->router_w[1] = b->rw1;
    b->y[0] = b->y0, b->y[1] = b->y1, b->dx[0] = b->y0, b->dx[1] = b->y1;
    b->d_router_w[0] = b->drw0, b->d_router_w[1] = b->drw1;
    for (int p = 0; p < 2; ++p) {
        b->w_gate[p] = b->weights + (0 * 2 + p) * expert;
        b->w_up[p] = b->weights + (1 * 2 + p) * expert;
        b->w_down[p] = b->weights + (2 * 2 + p) * expert;
        b->dw_gate[p] = b->grads + (0 * 2 + p) * expert;
        b->dw_up[p] = b->grads + (1 * 2 + p) * expert;
        b->dw_down[p] = b->grads + (2 * 2 + p) * expert;
        b->ds_gate[p] = b->grads + 6 * expert + (0 * 2 + p) * shared;
        b->ds_up[p] = b->grads + 6 * expert + (1 * 2 + p) * shared;
        b->ds_down[p] = b->grads + 6 * expert + (2 * 2 + p) * shared;
    }
    b->layer = (mok_ref_layer){.shape = &b->shape, .nranks = 2, .swiglu_limit = 0.0f, .num_tokens = b->num_tokens,
                               .x = b->x, .topk_ids = b->ids, .router_w = b->router_w, .w_gate = b->w_gate,
                               .w_up = b->w_up, .w_down = b->w_down, .s_gate = b->weights + 6 * expert,
                               .s_up = b->weights + 6 * expert + shared,
                               .s_down = b->weights + 6 * expert + 2 * shared};
}

static mok_status bad_forward(bad_fixture *b) { return mok_ref_forward(&b->layer, b->y); }

static mok_status bad_backward(bad_fixture *b) {
    return mok_ref_backward(&b->layer, b->dy, b->dx, b->d_router_w, b->dw_gate, b->dw_up, b->dw_down, b->ds_gate,
                            b->ds_up, b->ds_down);
}

/* Both calls fail with `want` and a message that names `word`; then the fixture is valid again. */
static void bad_expect(bad_fixture *b, mok_status want, const char *word, const char *what) {
    mok_status forward = bad_forward(b);
    CHECK(forward == want, "%s: mok_ref_forward returned %d, want %d", what, (int)forward, (int)want);
    CHECK(strstr(mok_last_error(), word) != NULL, "%s: forward message \"%s\" does not name %s", what,
          mok_last_error(), word);
    mok_status backward = bad_backward(b);
    CHECK(backward == want, "%s: mok_ref_backward returned %d, want %d", what, (int)backward, (int)want);
    CHECK(strstr(mok_last_error(), word) != NULL, "%s: backward message \"%s\" does not name %s", what,
          mok_last_error(), word);
    bad_reset(b);
}

static void bad_expect_backward(bad_fixture *b, const char *word, const char *what) {
    mok_status backward = bad_backward(b);
    CHECK(backward == MOK_ERR_INVALID_ARGUMENT, "%s: mok_ref_backward returned %d", what, (int)backward);
    CHECK(strstr(mok_last_error(), word) != NULL, "%s: message \"%s\" does not name %s", what, mok_last_error(), word);
    bad_reset(b);
}

MOK_TEST(ref_rejects_bad_inputs) {
    const mok_status bad = MOK_ERR_INVALID_ARGUMENT;
    bad_fixture *b = zalloc(sizeof *b);
    b->weights = zalloc((6 * 2 * 64 * 64 + 3 * 64 * 64) * sizeof(uint16_t));
    b->grads = zalloc((6 * 2 * 64 * 64 + 6 * 64 * 64) * sizeof(float));
    bad_reset(b);
    CHECK(bad_forward(b) == MOK_OK && bad_backward(b) == MOK_OK, "the valid layer: %s", mok_last_error());

    CHECK(mok_ref_forward(NULL, b->y) == bad && strstr(mok_last_error(), "layer"), "layer NULL (forward)");
    CHECK(mok_ref_backward(NULL, b->dy, b->dx, b->d_router_w, b->dw_gate, b->dw_up, b->dw_down, b->ds_gate,
                           b->ds_up, b->ds_down) == bad && strstr(mok_last_error(), "layer"),
          "layer NULL (backward)");
    b->layer.shape = NULL, bad_expect(b, bad, "shape", "shape NULL");
    b->layer.nranks = 0, bad_expect(b, bad, "nranks", "nranks 0");
    b->layer.nranks = MOK_MAX_RANKS + 1, bad_expect(b, bad, "nranks", "nranks past MOK_MAX_RANKS");
    b->shape.num_experts = 3, bad_expect(b, bad, "num_experts", "E not a multiple of P");
    b->shape.topk = 0, bad_expect(b, bad, "topk", "k = 0");
    b->shape.topk = 5, bad_expect(b, bad, "topk", "k > E");
    b->shape.hidden = 0, bad_expect(b, bad, "hidden", "H = 0");
    b->shape.intermediate = -64, bad_expect(b, bad, "intermediate", "I < 0");
    b->shape.shared_intermediate = -1, bad_expect(b, bad, "shared_intermediate", "I_s < 0");
    b->shape.max_tokens = 0, bad_expect(b, bad, "max_tokens", "T_max = 0");
    b->shape.precision = 7, bad_expect(b, bad, "precision", "unknown precision");
    b->shape.precision = MOK_PRECISION_FP8, bad_expect(b, bad, "precision", "fp8 with H = I = I_s = 64");
    b->layer.swiglu_limit = -1.0f, bad_expect(b, bad, "swiglu_limit", "negative limit");
    b->layer.swiglu_limit = NAN, bad_expect(b, bad, "swiglu_limit", "NaN limit");
    b->layer.num_tokens = NULL, bad_expect(b, bad, "num_tokens", "num_tokens NULL");
    b->num_tokens[1] = -1, bad_expect(b, bad, "num_tokens[1]", "T < 0");
    b->num_tokens[0] = 3, bad_expect(b, bad, "num_tokens[0]", "T > T_max");
    b->layer.topk_ids = NULL, bad_expect(b, bad, "topk_ids", "topk_ids NULL");
    b->ids[1] = NULL, bad_expect(b, bad, "topk_ids[1]", "topk_ids[1] NULL with tokens");
    b->ids0[2] = 4, bad_expect(b, bad, "topk_ids[0][2]", "id = E");
    b->ids1[1] = -2, bad_expect(b, bad, "topk_ids[1][1]", "id = -2");
    b->layer.x = NULL, bad_expect(b, bad, "x", "x NULL");
    b->x[1] = NULL, bad_expect(b, bad, "x[1]", "x[1] NULL with tokens");
    b->layer.router_w = NULL, bad_expect(b, bad, "router_w", "router_w NULL");
    b->router_w[0] = NULL, bad_expect(b, bad, "router_w[0]", "router_w[0] NULL with tokens");
    b->layer.w_gate = NULL, bad_expect(b, bad, "w_gate", "w_gate NULL");
    b->w_up[1] = NULL, bad_expect(b, bad, "w_up[1]", "w_up[1] NULL");
    b->w_down[0] = NULL, bad_expect(b, bad, "w_down[0]", "w_down[0] NULL");
    b->layer.s_gate = NULL, bad_expect(b, bad, "s_gate", "s_gate NULL with I_s > 0");
    b->layer.s_down = NULL, bad_expect(b, bad, "s_down", "s_down NULL with I_s > 0");

    CHECK(mok_ref_forward(&b->layer, NULL) == bad && strstr(mok_last_error(), "y"), "y NULL");
    b->y[1] = NULL;
    CHECK(mok_ref_forward(&b->layer, b->y) == bad && strstr(mok_last_error(), "y[1]"), "y[1] NULL");
    bad_reset(b);

    b->dy[0] = NULL, bad_expect_backward(b, "dy[0]", "dy[0] NULL");
    b->dx[1] = NULL, bad_expect_backward(b, "dx[1]", "dx[1] NULL");
    b->d_router_w[0] = NULL, bad_expect_backward(b, "d_router_w[0]", "d_router_w[0] NULL");
    b->dw_gate[1] = NULL, bad_expect_backward(b, "dw_gate[1]", "dw_gate[1] NULL");
    b->dw_down[0] = NULL, bad_expect_backward(b, "dw_down[0]", "dw_down[0] NULL");
    b->ds_up[1] = NULL, bad_expect_backward(b, "ds_up[1]", "ds_up[1] NULL with I_s > 0");
    CHECK(mok_ref_backward(&b->layer, NULL, b->dx, b->d_router_w, b->dw_gate, b->dw_up, b->dw_down, b->ds_gate,
                           b->ds_up, b->ds_down) == bad && strstr(mok_last_error(), "dy"),
          "dy NULL");
    CHECK(mok_ref_backward(&b->layer, b->dy, b->dx, b->d_router_w, b->dw_gate, b->dw_up, b->dw_down, NULL,
                           b->ds_up, b->ds_down) == bad && strstr(mok_last_error(), "ds_gate"),
          "ds_gate NULL with I_s > 0");

    /* What may be NULL: a rank without tokens needs no token arrays, and without a shared
     * expert the shared pointers are ignored. */
    b->num_tokens[1] = 0, b->x[1] = NULL, b->ids[1] = NULL, b->router_w[1] = NULL;
    b->y[1] = NULL, b->dx[1] = NULL, b->dy[1] = NULL, b->d_router_w[1] = NULL;
    CHECK(bad_forward(b) == MOK_OK && bad_backward(b) == MOK_OK, "a rank without tokens: %s", mok_last_error());
    bad_reset(b);
    b->shape.shared_intermediate = 0, b->layer.s_gate = b->layer.s_up = b->layer.s_down = NULL;
    CHECK(bad_forward(b) == MOK_OK, "no shared expert (forward): %s", mok_last_error());
    CHECK(mok_ref_backward(&b->layer, b->dy, b->dx, b->d_router_w, b->dw_gate, b->dw_up, b->dw_down, NULL, NULL,
                           NULL) == MOK_OK,
          "no shared expert (backward): %s", mok_last_error());

    /* The fp64 entry points check the same rules. */
    CHECK(mok__ref_forward_ex(NULL, NULL, 1) == bad, "mok__ref_forward_ex(NULL)");
    CHECK(mok__ref_backward_ex(NULL, NULL, 1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL) == bad,
          "mok__ref_backward_ex(NULL)");
    free(b->weights), free(b->grads), free(b);
}

/* The fused SwiGLU forward-and-backward of the SwiGLU-backward tiles gives the bits of the two
 * functions called apart, inside and outside the clamp, at its edges and for special values. */
MOK_TEST(portable_swiglu_with_backward_matches) {
    uint64_t s = mok_test_seed() * 6364136223846793005ull + 1442695040888963407ull;
    const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 7.0f, -7.0f, 30.0f, -30.0f, 100.0f, INFINITY, -INFINITY, NAN};
    const int nspecial = (int)(sizeof specials / sizeof specials[0]);
    int bad = 0;
    for (int i = 0; i < 200000 && bad < 5; ++i) {
        float v[3];
        for (int k = 0; k < 3; ++k) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            const uint32_t r = (uint32_t)(s >> 33);
            v[k] = (r & 15) == 0 ? specials[(r >> 4) % nspecial] : ((float)(r >> 4) / (float)(1u << 27) - 0.5f) * 40.0f;
        }
        const float limit = (i & 1) ? 7.0f : 0.0f;
        float h1, dg1, du1, h2, dg2, du2;
        h1 = mok__swiglu(v[0], v[1], limit);
        mok__swiglu_backward(v[2], v[0], v[1], limit, &dg1, &du1);
        mok__swiglu_with_backward(v[2], v[0], v[1], limit, &h2, &dg2, &du2);
        /* bits equal, or both NaN (a NaN's sign follows the operand order the compiler picks) */
#define SAME(a, b) (memcmp(&(a), &(b), 4) == 0 || (isnan(a) && isnan(b)))
        if (!SAME(h1, h2) || !SAME(dg1, dg2) || !SAME(du1, du2)) {
            ++bad;
            CHECK(0, "g %g u %g dh %g limit %g: apart (%a, %a, %a), fused (%a, %a, %a)", v[0], v[1], v[2], limit, h1,
                  dg1, du1, h2, dg2, du2);
        }
#undef SAME
    }
}
