/* ref.c — the naive reference of the function in include/mok.h, which every test compares
 * against: plain loops over ranks, tokens and slots, every dot product accumulated in fp64, and
 * the rounding points of the contract applied one by one where the contract puts them.
 *
 * It shares no code with the backends (its own bf16 rounding, E4M3 rounding, block scales, clamp
 * and SiLU below), so that a mistake in the shared code cannot hide by being made twice.
 *
 * FP8 (shape precision MOK_PRECISION_FP8, with rounding on): the same loops on quantized operands.
 * The weights and x are replaced by their dequantized block quantizations up front, h by its
 * quantization once rounded to bf16; the backward takes dy^ for dy · W_down and the router dot,
 * dg^, du^ for the dx part, and the unquantized bf16 dy, dg, du in the weight gradients. Every
 * dequantized value is exact in fp64, so each dot product is the FP8 GEMM's exact value up to
 * fp64's rounding. The public entry points widen the
 * bf16/fp32 inputs to fp64 and run the fp64 core (mok__ref_forward_ex / mok__ref_backward_ex,
 * see ref.h), whose rounding can be switched off for finite-difference tests. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "mok.h"
#include "ref/ref.h"

/* ---- bf16, clamp, SiLU ---------------------------------------------------------------------- */

#define REF_BF16_MAX 0x1.fep127 /* the largest finite bf16 */

/* Rounds an fp64 value to the nearest bf16 value, ties to even, in one step (no detour through
 * fp32, which could round twice). NaN stays NaN; magnitudes past the largest bf16 become inf. */
static double ref_round_bf16(double value) {
    if (isnan(value) || isinf(value) || value == 0.0) return value;
    double magnitude = fabs(value);
    int exponent;
    frexp(magnitude, &exponent); /* magnitude in [2^(exponent-1), 2^exponent) */
    /* bf16 keeps 8 significant bits, so the spacing there is 2^(exponent-8); below the smallest
     * normal (2^-126) the spacing stays 2^-133. */
    int spacing = exponent - 8 < -133 ? -133 : exponent - 8;
    double rounded = ldexp(rint(ldexp(magnitude, -spacing)), spacing); /* rint: ties to even */
    if (rounded > REF_BF16_MAX) rounded = INFINITY;
    return copysign(rounded, value);
}

static double ref_maybe_round(double value, int round) { return round ? ref_round_bf16(value) : value; }

static double ref_bf16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static uint16_t ref_bf16_bits(double value) {
    float rounded = (float)ref_round_bf16(value); /* exact: the value is a bf16 value (or NaN) */
    uint32_t bits;
    memcpy(&bits, &rounded, sizeof bits);
    if (isnan(rounded)) bits |= 0x00400000u; /* keep it a NaN once the low bits are cut */
    return (uint16_t)(bits >> 16);
}

/* The SwiGLU limit (limit > 0): gate clamped above, up clamped to [-limit, limit]. Comparisons,
 * so that NaN passes through. The masks say where the clamp lets the gradient through
 * (inclusive at the limit). */
static double ref_clamp_gate(double g, double limit) { return (limit > 0.0 && g > limit) ? limit : g; }

static double ref_clamp_up(double u, double limit) {
    if (limit > 0.0 && u > limit) return limit;
    if (limit > 0.0 && u < -limit) return -limit;
    return u;
}

static double ref_gate_mask(double g, double limit) { return (limit > 0.0 && g > limit) ? 0.0 : 1.0; }

static double ref_up_mask(double u, double limit) {
    return (limit > 0.0 && (u > limit || u < -limit)) ? 0.0 : 1.0;
}

static double ref_sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

static double ref_dot(const double *a, const double *b, int64_t n) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* out[r] = m[r, :] · v for a row-major m [rows, cols]: each row one plain fp64 sum in increasing
 * column order (the same value as ref_dot). Four rows run side by side only so that their sums
 * overlap in time instead of waiting on one another. */
static void ref_matvec(const double *m, const double *v, int64_t rows, int64_t cols, double *out) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const double *m0 = m + r * cols, *m1 = m0 + cols, *m2 = m1 + cols, *m3 = m2 + cols;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
            s0 += m0[c] * v[c];
            s1 += m1[c] * v[c];
            s2 += m2[c] * v[c];
            s3 += m3[c] * v[c];
        }
        out[r] = s0, out[r + 1] = s1, out[r + 2] = s2, out[r + 3] = s3;
    }
    for (; r < rows; ++r) out[r] = ref_dot(m + r * cols, v, cols);
}

/* ---- E4M3 and block scales (FP8) ------------------------------------------------------------ */

#define REF_FP8_BLOCK 128
#define REF_E4M3_MAX 448.0
#define REF_FP8_EXP_MIN (-124)

/* The E4M3 value nearest to v, ties to the even mantissa, in one step: E4M3 keeps 4 significant
 * bits (spacing 2^(exponent-3)) down to its smallest normal 2^-6, and a spacing of 2^-9 below.
 * NaN for a non-finite v and for one that rounds past 448 (E4M3 has no infinities). */
static double ref_e4m3(double v) {
    if (!isfinite(v)) return NAN;
    if (v == 0.0) return v;
    int exponent;
    frexp(fabs(v), &exponent); /* |v| in [2^(exponent-1), 2^exponent) */
    int spacing = exponent - 4 < -9 ? -9 : exponent - 4;
    double rounded = ldexp(rint(ldexp(fabs(v), -spacing)), spacing); /* rint: ties to even */
    return rounded > REF_E4M3_MAX ? NAN : copysign(rounded, v);
}

/* The exponent of a block's scale: the smallest e >= -124 with amax <= 448 * 2^e (0 for amax = 0),
 * found by counting up. */
static int ref_fp8_exponent(double amax) {
    if (amax == 0.0) return 0;
    int e = REF_FP8_EXP_MIN;
    while (amax > ldexp(REF_E4M3_MAX, e)) ++e;
    return e;
}

/* One block of quantization: the count values at v[i * stride + j * inner] (i < count / width,
 * j < width) replaced by their dequantized E4M3 values q * 2^e, in place. Non-finite values do not
 * count in amax and become NaN. */
static void ref_fp8_block(double *v, int64_t rows, int64_t width, int64_t stride) {
    double amax = 0.0;
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < width; ++j)
            if (isfinite(v[i * stride + j]) && fabs(v[i * stride + j]) > amax) amax = fabs(v[i * stride + j]);
    int e = ref_fp8_exponent(amax);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < width; ++j) {
            double *x = &v[i * stride + j];
            *x = isfinite(*x) ? ldexp(ref_e4m3(ldexp(*x, -e)), e) : NAN;
        }
}

/* Activations: every 1 x 128 block of each row of m [rows, cols]. */
static void ref_fp8_rows(double *m, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; c += REF_FP8_BLOCK) ref_fp8_block(m + r * cols + c, 1, REF_FP8_BLOCK, cols);
}

/* Weights: every 128 x 128 block of m [rows, cols]. */
static void ref_fp8_matrix(double *m, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r += REF_FP8_BLOCK)
        for (int64_t c = 0; c < cols; c += REF_FP8_BLOCK)
            ref_fp8_block(m + r * cols + c, REF_FP8_BLOCK, REF_FP8_BLOCK, cols);
}

/* ---- validation ----------------------------------------------------------------------------- */

/* Every array the reference allocates has fewer elements than this. */
#define REF_MAX_ELEMENTS ((int64_t)(SIZE_MAX / sizeof(double) / 2))

static int ref_fits(int64_t a, int64_t b, int64_t c) { return a <= REF_MAX_ELEMENTS / b / c; }

/* The shape, the group size, the limit, the token counts and the routing. */
static mok_status ref_check_routing(const char *fn, const mok_shape *shape, int nranks,
                                    double swiglu_limit, const int64_t *num_tokens,
                                    const int32_t *const *topk_ids) {
    const mok_status bad = MOK_ERR_INVALID_ARGUMENT;
    if (!shape) return mok__fail(bad, "%s: layer->shape is NULL", fn);
    if (nranks < 1 || nranks > MOK_MAX_RANKS)
        return mok__fail(bad, "%s: layer->nranks = %d is outside [1, %d]", fn, nranks, MOK_MAX_RANKS);
    if (shape->hidden < 1) return mok__fail(bad, "%s: shape->hidden = %lld < 1", fn, (long long)shape->hidden);
    if (shape->intermediate < 1)
        return mok__fail(bad, "%s: shape->intermediate = %lld < 1", fn, (long long)shape->intermediate);
    if (shape->shared_intermediate < 0)
        return mok__fail(bad, "%s: shape->shared_intermediate = %lld < 0", fn,
                         (long long)shape->shared_intermediate);
    if (shape->max_tokens < 1)
        return mok__fail(bad, "%s: shape->max_tokens = %lld < 1", fn, (long long)shape->max_tokens);
    if (shape->num_experts < 1 || shape->num_experts % nranks != 0)
        return mok__fail(bad, "%s: shape->num_experts = %lld is not a positive multiple of nranks = %d",
                         fn, (long long)shape->num_experts, nranks);
    if (shape->topk < 1 || shape->topk > shape->num_experts)
        return mok__fail(bad, "%s: shape->topk = %lld is outside [1, num_experts = %lld]", fn,
                         (long long)shape->topk, (long long)shape->num_experts);
    if (shape->precision != MOK_PRECISION_BF16 && shape->precision != MOK_PRECISION_FP8)
        return mok__fail(bad, "%s: shape->precision = %d is not a mok_precision", fn, shape->precision);
    if (shape->precision == MOK_PRECISION_FP8 &&
        (shape->hidden % REF_FP8_BLOCK || shape->intermediate % REF_FP8_BLOCK ||
         shape->shared_intermediate % REF_FP8_BLOCK))
        return mok__fail(bad, "%s: shape->precision = MOK_PRECISION_FP8 needs hidden, intermediate and "
                              "shared_intermediate multiples of %d (%lld, %lld, %lld)",
                         fn, REF_FP8_BLOCK, (long long)shape->hidden, (long long)shape->intermediate,
                         (long long)shape->shared_intermediate);
    if (!(swiglu_limit >= 0.0) || isinf(swiglu_limit))
        return mok__fail(bad, "%s: layer->swiglu_limit = %g is not finite and >= 0", fn, swiglu_limit);
    int64_t hidden = shape->hidden, inter = shape->intermediate, shared = shape->shared_intermediate;
    int64_t wide = inter > shared ? inter : shared;
    if (!ref_fits(shape->max_tokens, hidden, 1) || !ref_fits(shape->max_tokens, shape->topk, 1) ||
        !ref_fits(shape->num_experts / nranks, inter, hidden) || !ref_fits(wide, hidden, 1))
        return mok__fail(bad, "%s: the shape is too large for the reference", fn);

    if (!num_tokens) return mok__fail(bad, "%s: layer->num_tokens is NULL", fn);
    if (!topk_ids) return mok__fail(bad, "%s: layer->topk_ids is NULL", fn);
    for (int p = 0; p < nranks; ++p) {
        int64_t tokens = num_tokens[p];
        if (tokens < 0 || tokens > shape->max_tokens)
            return mok__fail(bad, "%s: layer->num_tokens[%d] = %lld is outside [0, max_tokens = %lld]", fn,
                             p, (long long)tokens, (long long)shape->max_tokens);
        if (tokens > 0 && !topk_ids[p]) return mok__fail(bad, "%s: layer->topk_ids[%d] is NULL", fn, p);
        for (int64_t i = 0; i < tokens * shape->topk; ++i) {
            int32_t id = topk_ids[p][i];
            if (id < -1 || id >= shape->num_experts)
                return mok__fail(bad, "%s: layer->topk_ids[%d][%lld] = %d is outside [-1, num_experts = %lld)",
                                 fn, p, (long long)i, (int)id, (long long)shape->num_experts);
        }
    }
    return MOK_OK;
}

/* A per-rank array of pointers must be set, and so must each entry that is read: every rank's
 * when all_ranks, otherwise those of ranks with tokens. */
#define REF_REQUIRE_PER_RANK(fn, array, name, all_ranks, nranks, num_tokens)                      \
    do {                                                                                          \
        if (!(array)) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);     \
        for (int p_ = 0; p_ < (nranks); ++p_)                                                     \
            if (!(array)[p_] && ((all_ranks) || (num_tokens)[p_] > 0))                            \
                return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: %s[%d] is NULL", fn, name, p_);    \
    } while (0)

#define REF_REQUIRE(fn, pointer, name)                                                            \
    do {                                                                                          \
        if (!(pointer)) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);   \
    } while (0)

/* The checks of a layer's routing and pointers, for both layer types (the same fields: bf16 in
 * mok_ref_layer, fp64 in mok__ref_layer64); returns from the enclosing function on a failure. */
#define REF_CHECK_LAYER(fn, layer)                                                                     \
    do {                                                                                               \
        REF_REQUIRE(fn, layer, "layer");                                                               \
        mok_status status_ = ref_check_routing(fn, (layer)->shape, (layer)->nranks, (layer)->swiglu_limit, \
                                               (layer)->num_tokens, (layer)->topk_ids);                \
        if (status_ != MOK_OK) return status_;                                                         \
        const int nranks_ = (layer)->nranks;                                                           \
        const int64_t *num_tokens_ = (layer)->num_tokens;                                              \
        REF_REQUIRE_PER_RANK(fn, (layer)->x, "layer->x", 0, nranks_, num_tokens_);                     \
        REF_REQUIRE_PER_RANK(fn, (layer)->router_w, "layer->router_w", 0, nranks_, num_tokens_);       \
        REF_REQUIRE_PER_RANK(fn, (layer)->w_gate, "layer->w_gate", 1, nranks_, num_tokens_);           \
        REF_REQUIRE_PER_RANK(fn, (layer)->w_up, "layer->w_up", 1, nranks_, num_tokens_);               \
        REF_REQUIRE_PER_RANK(fn, (layer)->w_down, "layer->w_down", 1, nranks_, num_tokens_);           \
        if ((layer)->shape->shared_intermediate > 0) {                                                 \
            REF_REQUIRE(fn, (layer)->s_gate, "layer->s_gate");                                         \
            REF_REQUIRE(fn, (layer)->s_up, "layer->s_up");                                             \
            REF_REQUIRE(fn, (layer)->s_down, "layer->s_down");                                         \
        }                                                                                              \
    } while (0)

static mok_status ref_check_layer64(const char *fn, const mok__ref_layer64 *layer) {
    REF_CHECK_LAYER(fn, layer);
    return MOK_OK;
}

/* ---- one expert on one token ---------------------------------------------------------------- */

typedef struct ref_expert {
    const double *gate, *up; /* [I, H] */
    const double *down;      /* [H, I] */
    int64_t inter;           /* I */
    int fp8;                 /* the weights are quantized; h, dg, du get quantized where they are operands */
} ref_expert;

/* Expert e lives on rank e / E_local as local expert e % E_local. */
static int ref_owner(const mok__ref_layer64 *layer, int32_t e) {
    return (int)(e / (layer->shape->num_experts / layer->nranks));
}

static int64_t ref_local(const mok__ref_layer64 *layer, int32_t e) {
    return e % (layer->shape->num_experts / layer->nranks);
}

static ref_expert ref_routed_expert(const mok__ref_layer64 *layer, int32_t e) {
    int64_t hidden = layer->shape->hidden, inter = layer->shape->intermediate;
    int owner = ref_owner(layer, e);
    int64_t offset = ref_local(layer, e) * inter * hidden;
    ref_expert expert = {layer->w_gate[owner] + offset, layer->w_up[owner] + offset,
                         layer->w_down[owner] + offset, inter, 0};
    return expert;
}

static ref_expert ref_shared_expert(const mok__ref_layer64 *layer) {
    ref_expert expert = {layer->s_gate, layer->s_up, layer->s_down, layer->shape->shared_intermediate, 0};
    return expert;
}

/* FFN of one expert on one token x [H]: g, u, h [I] and out [H], each rounded to bf16 when round.
 * FP8: x is x^ and h leaves as h^. */
static void ref_ffn(ref_expert ex, int64_t hidden, const double *x, double limit, int round,
                    double *g, double *u, double *h, double *out) {
    ref_matvec(ex.gate, x, ex.inter, hidden, g);
    ref_matvec(ex.up, x, ex.inter, hidden, u);
    for (int64_t i = 0; i < ex.inter; ++i) {
        g[i] = ref_maybe_round(g[i], round);
        u[i] = ref_maybe_round(u[i], round);
        double gc = ref_clamp_gate(g[i], limit), uc = ref_clamp_up(u[i], limit);
        h[i] = ref_maybe_round(gc * ref_sigmoid(gc) * uc, round);
    }
    if (ex.fp8) ref_fp8_rows(h, 1, ex.inter);
    ref_matvec(ex.down, h, hidden, ex.inter, out);
    for (int64_t o = 0; o < hidden; ++o) out[o] = ref_maybe_round(out[o], round);
}

/* Backward of one expert on one token with router weight w, given the forward's g, u, h: the dx
 * part [H] (rounded when round), and the weight gradients added into dw_gate, dw_up [I, H] and
 * dw_down [H, I]. dg, du [I] are scratch; so are dgq, duq [I] (FP8). FP8: x is x^, h is h^, dy_q is
 * dy^ (else dy itself): dy^ in W_down^T dy, dy in w · dy; dg, du quantized for the dx part only. */
static void ref_ffn_backward(ref_expert ex, int64_t hidden, const double *x, const double *dy,
                             const double *dy_q, double w, const double *g, const double *u,
                             const double *h, double limit, int round, double *dg, double *du,
                             double *dgq, double *duq, double *dx_part, double *dw_gate,
                             double *dw_up, double *dw_down) {
    int64_t inter = ex.inter;
    /* Transposed products walk the weights row by row; each sum still adds its terms in
     * increasing index order. dg holds dh0 = W_down^T dy until it is overwritten. */
    for (int64_t i = 0; i < inter; ++i) dg[i] = 0.0;
    for (int64_t o = 0; o < hidden; ++o)
        for (int64_t i = 0; i < inter; ++i) dg[i] += ex.down[o * inter + i] * dy_q[o];
    for (int64_t i = 0; i < inter; ++i) {
        double dh = w * dg[i];
        double gc = ref_clamp_gate(g[i], limit), uc = ref_clamp_up(u[i], limit);
        double s = ref_sigmoid(gc);
        dg[i] = ref_maybe_round(dh * uc * s * (1.0 + gc * (1.0 - s)) * ref_gate_mask(g[i], limit), round);
        du[i] = ref_maybe_round(dh * gc * s * ref_up_mask(u[i], limit), round);
    }
    /* dx part = W_gate^T dg + W_up^T du: per element the gate terms, then the up terms. */
    const double *dg_op = dg, *du_op = du;
    if (ex.fp8) {
        for (int64_t i = 0; i < inter; ++i) dgq[i] = dg[i], duq[i] = du[i];
        ref_fp8_rows(dgq, 1, inter);
        ref_fp8_rows(duq, 1, inter);
        dg_op = dgq, du_op = duq;
    }
    for (int64_t o = 0; o < hidden; ++o) dx_part[o] = 0.0;
    for (int64_t i = 0; i < inter; ++i)
        for (int64_t o = 0; o < hidden; ++o) dx_part[o] += ex.gate[i * hidden + o] * dg_op[i];
    for (int64_t i = 0; i < inter; ++i)
        for (int64_t o = 0; o < hidden; ++o) dx_part[o] += ex.up[i * hidden + o] * du_op[i];
    for (int64_t o = 0; o < hidden; ++o) dx_part[o] = ref_maybe_round(dx_part[o], round);
    for (int64_t i = 0; i < inter; ++i)
        for (int64_t o = 0; o < hidden; ++o) {
            dw_gate[i * hidden + o] += dg[i] * x[o];
            dw_up[i * hidden + o] += du[i] * x[o];
        }
    for (int64_t o = 0; o < hidden; ++o) {
        double wdy = ref_maybe_round(w * dy[o], round);
        for (int64_t i = 0; i < inter; ++i) dw_down[o * inter + i] += wdy * h[i];
    }
}

/* ---- the fp64 core -------------------------------------------------------------------------- */

/* The work happens in three steps that mirror the contract: the shared expert on every token;
 * each routed expert, one after the other, on the (rank, token, slot) rows routed to it (an
 * expert's weights stay in cache while it runs); then per token the fixed-order sum, shared
 * first, then slots 0..k-1, rounded once. Between the steps the per-row results (expert outputs
 * in the forward, dx parts in the backward) wait in the scratch. Each weight gradient adds its
 * rows in (rank, token, slot) order. */

/* Rows an expert's forward takes at once: each weight row is read once per block of rows, not
 * once per row (a full-size expert does not fit in any cache). Every sum is the same dot product
 * in the same order as row by row. */
#define REF_BLOCK 16

/* FFN of one expert on n <= REF_BLOCK tokens: xs[n] -> outs[n], as ref_ffn does for one. */
static void ref_ffn_rows(ref_expert ex, int64_t hidden, const double *const *xs, int n, double limit, int round,
                         double *g, double *u, double *h, double *const *outs) {
    const int64_t inter = ex.inter;
    for (int64_t i = 0; i < inter; ++i)
        for (int r = 0; r < n; ++r) {
            g[r * inter + i] = ref_maybe_round(ref_dot(ex.gate + i * hidden, xs[r], hidden), round);
            u[r * inter + i] = ref_maybe_round(ref_dot(ex.up + i * hidden, xs[r], hidden), round);
        }
    for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < inter; ++i) {
            double gc = ref_clamp_gate(g[r * inter + i], limit), uc = ref_clamp_up(u[r * inter + i], limit);
            h[r * inter + i] = ref_maybe_round(gc * ref_sigmoid(gc) * uc, round);
        }
    if (ex.fp8) ref_fp8_rows(h, n, inter);
    for (int64_t o = 0; o < hidden; ++o)
        for (int r = 0; r < n; ++r) outs[r][o] = ref_maybe_round(ref_dot(ex.down + o * inter, h + r * inter, inter), round);
}

/* Scratch of one pass. */
typedef struct ref_scratch {
    double *g, *u, *h, *dg, *du; /* g, u, h: [REF_BLOCK, max(I, I_s)]; dg, du: [max(I, I_s)] */
    double *dgq, *duq;           /* FP8: dg^, du^ [max(I, I_s)] */
    double *out;                 /* [H] */
    /* Per rank p: the routed experts' outputs or dx parts [T_p, k, H], the shared expert's
     * [T_p, H]. */
    double *routed[MOK_MAX_RANKS], *shared[MOK_MAX_RANKS];
} ref_scratch;

static void ref_scratch_free(ref_scratch *s, int nranks) {
    free(s->g);
    free(s->u);
    free(s->h);
    free(s->dg);
    free(s->du);
    free(s->dgq);
    free(s->duq);
    free(s->out);
    for (int p = 0; p < nranks; ++p) {
        free(s->routed[p]);
        free(s->shared[p]);
    }
}

static mok_status ref_scratch_alloc(const char *fn, const mok__ref_layer64 *layer, ref_scratch *s) {
    const mok_shape *shape = layer->shape;
    int64_t wide = shape->intermediate > shape->shared_intermediate ? shape->intermediate
                                                                     : shape->shared_intermediate;
    size_t wide_bytes = (size_t)wide * sizeof(double), hidden_bytes = (size_t)shape->hidden * sizeof(double);
    int ok = 1;
    memset(s, 0, sizeof *s);
    s->g = malloc(wide_bytes * REF_BLOCK);
    s->u = malloc(wide_bytes * REF_BLOCK);
    s->h = malloc(wide_bytes * REF_BLOCK);
    s->dg = malloc(wide_bytes);
    s->du = malloc(wide_bytes);
    s->dgq = malloc(wide_bytes);
    s->duq = malloc(wide_bytes);
    s->out = malloc(hidden_bytes);
    ok = s->g && s->u && s->h && s->dg && s->du && s->dgq && s->duq && s->out;
    for (int p = 0; p < layer->nranks; ++p) {
        size_t tokens = (size_t)layer->num_tokens[p];
        s->routed[p] = malloc(tokens * (size_t)shape->topk * hidden_bytes + 1);
        s->shared[p] = malloc(tokens * hidden_bytes + 1);
        ok = ok && s->routed[p] && s->shared[p];
    }
    if (!ok) {
        ref_scratch_free(s, layer->nranks);
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory for scratch", fn);
    }
    return MOK_OK;
}

/* FP8: a layer whose x and weights are their dequantized quantizations (x^ per token per 128 of
 * H, W^ per 128 x 128 block), and dy^ beside it (backward), in arrays of its own. */
typedef struct ref_fp8_layer {
    mok__ref_layer64 layer;
    const double *x[MOK_MAX_RANKS], *w_gate[MOK_MAX_RANKS], *w_up[MOK_MAX_RANKS], *w_down[MOK_MAX_RANKS];
    const double *dy[MOK_MAX_RANKS];
    double *arrays[5 * MOK_MAX_RANKS + 3]; /* everything allocated here */
    int count;
} ref_fp8_layer;

static void ref_fp8_free(ref_fp8_layer *q) {
    for (int i = 0; q && i < q->count; ++i) free(q->arrays[i]);
    free(q);
}

/* A quantized copy of count matrices [rows, cols] (weights: 128 x 128 blocks, else 1 x 128 rows).
 * NULL src gives NULL; returns 0 when out of memory. */
static int ref_fp8_copy(ref_fp8_layer *q, const double *src, int64_t count, int64_t rows, int64_t cols,
                        int weights, const double **out) {
    *out = NULL;
    if (!src || count * rows * cols == 0) return 1;
    double *copy = malloc((size_t)(count * rows * cols) * sizeof(double));
    if (!copy) return 0;
    q->arrays[q->count++] = copy;
    memcpy(copy, src, (size_t)(count * rows * cols) * sizeof(double));
    for (int64_t m = 0; m < count; ++m) {
        if (weights) ref_fp8_matrix(copy + m * rows * cols, rows, cols);
        else ref_fp8_rows(copy + m * rows * cols, rows, cols);
    }
    *out = copy;
    return 1;
}

static mok_status ref_fp8_quantize(const char *fn, const mok__ref_layer64 *src, const double *const *dy,
                                   ref_fp8_layer **out) {
    const mok_shape *shape = src->shape;
    const int64_t H = shape->hidden, I = shape->intermediate, Is = shape->shared_intermediate;
    const int64_t El = shape->num_experts / src->nranks;
    ref_fp8_layer *q = calloc(1, sizeof *q);
    int ok = q != NULL;
    for (int p = 0; ok && p < src->nranks; ++p) {
        const int64_t T = src->num_tokens[p];
        ok = ref_fp8_copy(q, T > 0 ? src->x[p] : NULL, 1, T, H, 0, &q->x[p]) &&
             ref_fp8_copy(q, dy && T > 0 ? dy[p] : NULL, 1, T, H, 0, &q->dy[p]) &&
             ref_fp8_copy(q, src->w_gate[p], El, I, H, 1, &q->w_gate[p]) &&
             ref_fp8_copy(q, src->w_up[p], El, I, H, 1, &q->w_up[p]) &&
             ref_fp8_copy(q, src->w_down[p], El, H, I, 1, &q->w_down[p]);
    }
    if (ok) {
        q->layer = *src;
        ok = ref_fp8_copy(q, src->s_gate, 1, Is, H, 1, &q->layer.s_gate) &&
             ref_fp8_copy(q, src->s_up, 1, Is, H, 1, &q->layer.s_up) &&
             ref_fp8_copy(q, src->s_down, 1, H, Is, 1, &q->layer.s_down);
    }
    if (!ok) {
        ref_fp8_free(q);
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory for the quantized layer", fn);
    }
    q->layer.x = q->x;
    q->layer.w_gate = q->w_gate;
    q->layer.w_up = q->w_up;
    q->layer.w_down = q->w_down;
    *out = q;
    return MOK_OK;
}

mok_status mok__ref_forward_ex(const mok__ref_layer64 *layer, double *const *y, int round) {
    static const char fn[] = "mok__ref_forward_ex";
    mok_status status = ref_check_layer64(fn, layer);
    if (status != MOK_OK) return status;
    REF_REQUIRE_PER_RANK(fn, y, "y", 0, layer->nranks, layer->num_tokens);
    const mok_shape *shape = layer->shape;
    int64_t hidden = shape->hidden, topk = shape->topk;
    int has_shared = shape->shared_intermediate > 0;
    double limit = layer->swiglu_limit;
    ref_scratch s;
    if ((status = ref_scratch_alloc(fn, layer, &s)) != MOK_OK) return status;
    const int fp8 = round && shape->precision == MOK_PRECISION_FP8;
    ref_fp8_layer *quantized = NULL;
    if (fp8) {
        if ((status = ref_fp8_quantize(fn, layer, NULL, &quantized)) != MOK_OK) {
            ref_scratch_free(&s, layer->nranks);
            return status;
        }
        layer = &quantized->layer;
    }

    for (int p = 0; has_shared && p < layer->nranks; ++p)
        for (int64_t t0 = 0; t0 < layer->num_tokens[p]; t0 += REF_BLOCK) {
            const double *xs[REF_BLOCK];
            double *outs[REF_BLOCK];
            int n = 0;
            for (int64_t t = t0; t < layer->num_tokens[p] && n < REF_BLOCK; ++t, ++n) {
                xs[n] = layer->x[p] + t * hidden;
                outs[n] = s.shared[p] + t * hidden;
            }
            ref_expert ex = ref_shared_expert(layer);
            ex.fp8 = fp8;
            ref_ffn_rows(ex, hidden, xs, n, limit, round, s.g, s.u, s.h, outs);
        }

    for (int32_t e = 0; e < shape->num_experts; ++e) {
        ref_expert ex = ref_routed_expert(layer, e);
        ex.fp8 = fp8;
        const double *xs[REF_BLOCK];
        double *outs[REF_BLOCK];
        int n = 0;
        for (int p = 0; p < layer->nranks; ++p)
            for (int64_t t = 0; t < layer->num_tokens[p]; ++t)
                for (int64_t j = 0; j < topk; ++j)
                    if (layer->topk_ids[p][t * topk + j] == e) {
                        xs[n] = layer->x[p] + t * hidden;
                        outs[n] = s.routed[p] + (t * topk + j) * hidden;
                        if (++n == REF_BLOCK) {
                            ref_ffn_rows(ex, hidden, xs, n, limit, round, s.g, s.u, s.h, outs);
                            n = 0;
                        }
                    }
        if (n) ref_ffn_rows(ex, hidden, xs, n, limit, round, s.g, s.u, s.h, outs);
    }

    for (int p = 0; p < layer->nranks; ++p)
        for (int64_t t = 0; t < layer->num_tokens[p]; ++t)
            for (int64_t o = 0; o < hidden; ++o) {
                double sum = 0.0;
                if (has_shared) sum += s.shared[p][t * hidden + o];
                for (int64_t j = 0; j < topk; ++j)
                    if (layer->topk_ids[p][t * topk + j] >= 0) /* empty slots are skipped */
                        sum += layer->router_w[p][t * topk + j] * s.routed[p][(t * topk + j) * hidden + o];
                y[p][t * hidden + o] = ref_maybe_round(sum, round);
            }
    ref_scratch_free(&s, layer->nranks);
    ref_fp8_free(quantized);
    return MOK_OK;
}

/* A per-rank array of any row type, for the checks that only ask which entries are NULL. */
#define REF_ROWS(array) ((const void *const *)(array))

/* The backward's per-rank arguments, for both forms of it (bf16, float or double rows): every
 * array given, a rank's rows wherever it has tokens, the weight gradients on every rank, the
 * shared expert's where the layer has one. */
static mok_status ref_check_backward_args(const char *fn, int nranks, const int64_t *num_tokens, int has_shared,
                                          const void *const *dy, const void *const *dx,
                                          const void *const *d_router_w, const void *const *dw_gate,
                                          const void *const *dw_up, const void *const *dw_down,
                                          const void *const *ds_gate, const void *const *ds_up,
                                          const void *const *ds_down) {
    REF_REQUIRE_PER_RANK(fn, dy, "dy", 0, nranks, num_tokens);
    REF_REQUIRE_PER_RANK(fn, dx, "dx", 0, nranks, num_tokens);
    REF_REQUIRE_PER_RANK(fn, d_router_w, "d_router_w", 0, nranks, num_tokens);
    REF_REQUIRE_PER_RANK(fn, dw_gate, "dw_gate", 1, nranks, num_tokens);
    REF_REQUIRE_PER_RANK(fn, dw_up, "dw_up", 1, nranks, num_tokens);
    REF_REQUIRE_PER_RANK(fn, dw_down, "dw_down", 1, nranks, num_tokens);
    if (has_shared) {
        REF_REQUIRE_PER_RANK(fn, ds_gate, "ds_gate", 1, nranks, num_tokens);
        REF_REQUIRE_PER_RANK(fn, ds_up, "ds_up", 1, nranks, num_tokens);
        REF_REQUIRE_PER_RANK(fn, ds_down, "ds_down", 1, nranks, num_tokens);
    }
    return MOK_OK;
}

mok_status mok__ref_backward_ex(const mok__ref_layer64 *layer, const double *const *dy, int round,
                                double *const *dx, double *const *d_router_w,
                                double *const *dw_gate, double *const *dw_up,
                                double *const *dw_down, double *const *ds_gate,
                                double *const *ds_up, double *const *ds_down) {
    static const char fn[] = "mok__ref_backward_ex";
    mok_status status = ref_check_layer64(fn, layer);
    if (status != MOK_OK) return status;
    int nranks = layer->nranks;
    const int64_t *num_tokens = layer->num_tokens;
    const mok_shape *shape = layer->shape;
    int has_shared = shape->shared_intermediate > 0;
    status = ref_check_backward_args(fn, nranks, num_tokens, has_shared, REF_ROWS(dy), REF_ROWS(dx),
                                     REF_ROWS(d_router_w), REF_ROWS(dw_gate), REF_ROWS(dw_up), REF_ROWS(dw_down),
                                     REF_ROWS(ds_gate), REF_ROWS(ds_up), REF_ROWS(ds_down));
    if (status != MOK_OK) return status;
    int64_t hidden = shape->hidden, inter = shape->intermediate, topk = shape->topk;
    int64_t expert_size = (shape->num_experts / nranks) * inter * hidden;
    int64_t shared_size = shape->shared_intermediate * hidden;
    double limit = layer->swiglu_limit;
    ref_scratch s;
    if ((status = ref_scratch_alloc(fn, layer, &s)) != MOK_OK) return status;
    const int fp8 = round && shape->precision == MOK_PRECISION_FP8;
    ref_fp8_layer *quantized = NULL;
    const double *const *dy_q = dy; /* dy^ for FP8 (W_down^T dy and the router dot), else dy */
    if (fp8) {
        if ((status = ref_fp8_quantize(fn, layer, dy, &quantized)) != MOK_OK) {
            ref_scratch_free(&s, nranks);
            return status;
        }
        layer = &quantized->layer;
        dy_q = quantized->dy;
    }

    /* Experts that receive no rows keep these zeros. */
    for (int p = 0; p < nranks; ++p) {
        for (int64_t i = 0; i < expert_size; ++i) dw_gate[p][i] = dw_up[p][i] = dw_down[p][i] = 0.0;
        for (int64_t i = 0; has_shared && i < shared_size; ++i) ds_gate[p][i] = ds_up[p][i] = ds_down[p][i] = 0.0;
    }

    /* The shared expert (router weight 1): its gradients stay with the rank of the token. */
    for (int p = 0; has_shared && p < nranks; ++p)
        for (int64_t t = 0; t < num_tokens[p]; ++t) {
            ref_expert ex = ref_shared_expert(layer);
            ex.fp8 = fp8;
            const double *x = layer->x[p] + t * hidden, *dyt = dy[p] + t * hidden, *dyq = dy_q[p] + t * hidden;
            ref_ffn(ex, hidden, x, limit, round, s.g, s.u, s.h, s.out);
            ref_ffn_backward(ex, hidden, x, dyt, dyq, 1.0, s.g, s.u, s.h, limit, round, s.dg, s.du, s.dgq, s.duq,
                             s.shared[p] + t * hidden, ds_gate[p], ds_up[p], ds_down[p]);
        }

    for (int32_t e = 0; e < shape->num_experts; ++e) {
        ref_expert ex = ref_routed_expert(layer, e);
        ex.fp8 = fp8;
        int owner = ref_owner(layer, e);
        int64_t offset = ref_local(layer, e) * inter * hidden;
        for (int p = 0; p < nranks; ++p)
            for (int64_t t = 0; t < num_tokens[p]; ++t)
                for (int64_t j = 0; j < topk; ++j) {
                    if (layer->topk_ids[p][t * topk + j] != e) continue;
                    const double *x = layer->x[p] + t * hidden, *dyt = dy[p] + t * hidden;
                    const double *dyq = dy_q[p] + t * hidden;
                    double w = layer->router_w[p][t * topk + j];
                    ref_ffn(ex, hidden, x, limit, round, s.g, s.u, s.h, s.out);
                    /* <dy, W_down h>: the expert output before its bf16 rounding (the contract in
                       mok.h); no division by w, so exact for w <= 0. FP8: <dy^, W^_down h^>. */
                    ref_matvec(ex.down, s.h, hidden, ex.inter, s.out);
                    d_router_w[p][t * topk + j] = ref_dot(dyq, s.out, hidden);
                    ref_ffn_backward(ex, hidden, x, dyt, dyq, w, s.g, s.u, s.h, limit, round, s.dg, s.du, s.dgq,
                                     s.duq, s.routed[p] + (t * topk + j) * hidden, dw_gate[owner] + offset,
                                     dw_up[owner] + offset, dw_down[owner] + offset);
                }
    }

    for (int p = 0; p < nranks; ++p)
        for (int64_t t = 0; t < num_tokens[p]; ++t) {
            for (int64_t j = 0; j < topk; ++j)
                if (layer->topk_ids[p][t * topk + j] < 0) d_router_w[p][t * topk + j] = 0.0;
            for (int64_t o = 0; o < hidden; ++o) {
                double sum = 0.0;
                if (has_shared) sum += s.shared[p][t * hidden + o];
                for (int64_t j = 0; j < topk; ++j)
                    if (layer->topk_ids[p][t * topk + j] >= 0)
                        sum += s.routed[p][(t * topk + j) * hidden + o];
                dx[p][t * hidden + o] = ref_maybe_round(sum, round);
            }
        }
    ref_scratch_free(&s, nranks);
    ref_fp8_free(quantized);
    return MOK_OK;
}

/* ---- the public entry points: widen to fp64, run the core with rounding, narrow ------------- */

/* Every fp64 array one public call allocates, freed together. */
#define REF_POOL_CAPACITY (16 * MOK_MAX_RANKS + 8)
typedef struct ref_pool {
    double *arrays[REF_POOL_CAPACITY];
    int count;
} ref_pool;

static double *ref_pool_alloc(ref_pool *pool, int64_t count) {
    if (pool->count == REF_POOL_CAPACITY) return NULL;
    double *array = malloc(count > 0 ? (size_t)count * sizeof(double) : 1);
    if (array) pool->arrays[pool->count++] = array;
    return array;
}

static void ref_pool_free(ref_pool *pool) {
    for (int i = 0; i < pool->count; ++i) free(pool->arrays[i]);
    pool->count = 0;
}

/* An fp64 copy of count bf16 values (NULL stays NULL). Returns 0 when out of memory. */
static int ref_widen_bf16(ref_pool *pool, const void *src, int64_t count, const double **dst) {
    *dst = NULL;
    if (!src) return 1;
    double *copy = ref_pool_alloc(pool, count);
    if (!copy) return 0;
    for (int64_t i = 0; i < count; ++i) copy[i] = ref_bf16_value(((const uint16_t *)src)[i]);
    *dst = copy;
    return 1;
}

static int ref_widen_f32(ref_pool *pool, const float *src, int64_t count, const double **dst) {
    *dst = NULL;
    if (!src) return 1;
    double *copy = ref_pool_alloc(pool, count);
    if (!copy) return 0;
    for (int64_t i = 0; i < count; ++i) copy[i] = src[i];
    *dst = copy;
    return 1;
}

/* The fp64 form of a public layer; its arrays of pointers live here, the arrays in a pool. */
typedef struct ref_wide_layer {
    mok__ref_layer64 layer;
    const double *x[MOK_MAX_RANKS], *router_w[MOK_MAX_RANKS];
    const double *w_gate[MOK_MAX_RANKS], *w_up[MOK_MAX_RANKS], *w_down[MOK_MAX_RANKS];
} ref_wide_layer;

static mok_status ref_check_public(const char *fn, const mok_ref_layer *layer) {
    REF_CHECK_LAYER(fn, layer);
    return MOK_OK;
}

/* Widens a checked public layer. */
static mok_status ref_widen_layer(const char *fn, const mok_ref_layer *src, ref_pool *pool,
                                  ref_wide_layer *wide) {
    const mok_shape *shape = src->shape;
    int64_t hidden = shape->hidden, topk = shape->topk;
    int64_t expert_size = (shape->num_experts / src->nranks) * shape->intermediate * hidden;
    int64_t shared_size = shape->shared_intermediate * hidden;
    int ok = 1;
    memset(wide, 0, sizeof *wide);
    for (int p = 0; p < src->nranks; ++p) {
        int64_t tokens = src->num_tokens[p];
        ok = ok && ref_widen_bf16(pool, tokens > 0 ? src->x[p] : NULL, tokens * hidden, &wide->x[p]);
        ok = ok && ref_widen_f32(pool, tokens > 0 ? src->router_w[p] : NULL, tokens * topk, &wide->router_w[p]);
        ok = ok && ref_widen_bf16(pool, src->w_gate[p], expert_size, &wide->w_gate[p]);
        ok = ok && ref_widen_bf16(pool, src->w_up[p], expert_size, &wide->w_up[p]);
        ok = ok && ref_widen_bf16(pool, src->w_down[p], expert_size, &wide->w_down[p]);
    }
    mok__ref_layer64 *layer = &wide->layer;
    if (shape->shared_intermediate > 0) {
        ok = ok && ref_widen_bf16(pool, src->s_gate, shared_size, &layer->s_gate);
        ok = ok && ref_widen_bf16(pool, src->s_up, shared_size, &layer->s_up);
        ok = ok && ref_widen_bf16(pool, src->s_down, shared_size, &layer->s_down);
    }
    if (!ok) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory for the fp64 copy of the layer", fn);
    layer->shape = shape;
    layer->nranks = src->nranks;
    layer->swiglu_limit = src->swiglu_limit;
    layer->num_tokens = src->num_tokens;
    layer->topk_ids = src->topk_ids;
    layer->x = wide->x;
    layer->router_w = wide->router_w;
    layer->w_gate = wide->w_gate;
    layer->w_up = wide->w_up;
    layer->w_down = wide->w_down;
    return MOK_OK;
}

/* One fp64 output array per rank: count elements, or count per token of the rank when per_token. */
static int ref_pool_outputs(ref_pool *pool, int nranks, const int64_t *num_tokens, int64_t count,
                            int per_token, double **out) {
    for (int p = 0; p < nranks; ++p) {
        out[p] = ref_pool_alloc(pool, per_token ? num_tokens[p] * count : count);
        if (!out[p]) return 0;
    }
    return 1;
}

mok_status mok_ref_forward(const mok_ref_layer *layer, void *const *y) {
    static const char fn[] = "mok_ref_forward";
    mok_status status = ref_check_public(fn, layer);
    if (status != MOK_OK) return status;
    int nranks = layer->nranks;
    const int64_t *num_tokens = layer->num_tokens;
    int64_t hidden = layer->shape->hidden;
    REF_REQUIRE_PER_RANK(fn, y, "y", 0, nranks, num_tokens);

    ref_pool *pool = calloc(1, sizeof *pool);
    ref_wide_layer *wide = calloc(1, sizeof *wide);
    double *y64[MOK_MAX_RANKS];
    if (!pool || !wide) {
        status = mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    } else if ((status = ref_widen_layer(fn, layer, pool, wide)) == MOK_OK) {
        if (!ref_pool_outputs(pool, nranks, num_tokens, hidden, 1, y64))
            status = mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory for y", fn);
        else
            status = mok__ref_forward_ex(&wide->layer, y64, 1);
    }
    if (status == MOK_OK)
        for (int p = 0; p < nranks; ++p)
            for (int64_t i = 0; i < num_tokens[p] * hidden; ++i) ((uint16_t *)y[p])[i] = ref_bf16_bits(y64[p][i]);
    if (pool) ref_pool_free(pool);
    free(pool);
    free(wide);
    return status;
}

mok_status mok_ref_backward(const mok_ref_layer *layer, const void *const *dy, void *const *dx,
                            float *const *d_router_w, float *const *dw_gate, float *const *dw_up,
                            float *const *dw_down, float *const *ds_gate, float *const *ds_up,
                            float *const *ds_down) {
    static const char fn[] = "mok_ref_backward";
    mok_status status = ref_check_public(fn, layer);
    if (status != MOK_OK) return status;
    int nranks = layer->nranks;
    const int64_t *num_tokens = layer->num_tokens;
    const mok_shape *shape = layer->shape;
    int has_shared = shape->shared_intermediate > 0;
    status = ref_check_backward_args(fn, nranks, num_tokens, has_shared, REF_ROWS(dy), REF_ROWS(dx),
                                     REF_ROWS(d_router_w), REF_ROWS(dw_gate), REF_ROWS(dw_up), REF_ROWS(dw_down),
                                     REF_ROWS(ds_gate), REF_ROWS(ds_up), REF_ROWS(ds_down));
    if (status != MOK_OK) return status;
    int64_t hidden = shape->hidden, topk = shape->topk;
    int64_t expert_size = (shape->num_experts / nranks) * shape->intermediate * hidden;
    int64_t shared_size = shape->shared_intermediate * hidden;

    ref_pool *pool = calloc(1, sizeof *pool);
    ref_wide_layer *wide = calloc(1, sizeof *wide);
    const double *dy64[MOK_MAX_RANKS];
    double *dx64[MOK_MAX_RANKS], *drw64[MOK_MAX_RANKS];
    double *dwg64[MOK_MAX_RANKS], *dwu64[MOK_MAX_RANKS], *dwd64[MOK_MAX_RANKS];
    double *dsg64[MOK_MAX_RANKS], *dsu64[MOK_MAX_RANKS], *dsd64[MOK_MAX_RANKS];
    if (!pool || !wide) {
        status = mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    } else if ((status = ref_widen_layer(fn, layer, pool, wide)) == MOK_OK) {
        int ok = 1;
        for (int p = 0; p < nranks; ++p)
            ok = ok && ref_widen_bf16(pool, num_tokens[p] > 0 ? dy[p] : NULL, num_tokens[p] * hidden, &dy64[p]);
        ok = ok && ref_pool_outputs(pool, nranks, num_tokens, hidden, 1, dx64);
        ok = ok && ref_pool_outputs(pool, nranks, num_tokens, topk, 1, drw64);
        ok = ok && ref_pool_outputs(pool, nranks, num_tokens, expert_size, 0, dwg64);
        ok = ok && ref_pool_outputs(pool, nranks, num_tokens, expert_size, 0, dwu64);
        ok = ok && ref_pool_outputs(pool, nranks, num_tokens, expert_size, 0, dwd64);
        ok = ok && (!has_shared || (ref_pool_outputs(pool, nranks, num_tokens, shared_size, 0, dsg64) &&
                                    ref_pool_outputs(pool, nranks, num_tokens, shared_size, 0, dsu64) &&
                                    ref_pool_outputs(pool, nranks, num_tokens, shared_size, 0, dsd64)));
        if (!ok)
            status = mok__fail(MOK_ERR_OUT_OF_MEMORY, "%s: out of memory for the fp64 gradients", fn);
        else
            status = mok__ref_backward_ex(&wide->layer, dy64, 1, dx64, drw64, dwg64, dwu64, dwd64,
                                          has_shared ? dsg64 : NULL, has_shared ? dsu64 : NULL,
                                          has_shared ? dsd64 : NULL);
    }
    if (status == MOK_OK)
        for (int p = 0; p < nranks; ++p) {
            for (int64_t i = 0; i < num_tokens[p] * hidden; ++i) ((uint16_t *)dx[p])[i] = ref_bf16_bits(dx64[p][i]);
            for (int64_t i = 0; i < num_tokens[p] * topk; ++i) d_router_w[p][i] = (float)drw64[p][i];
            for (int64_t i = 0; i < expert_size; ++i) {
                dw_gate[p][i] = (float)dwg64[p][i];
                dw_up[p][i] = (float)dwu64[p][i];
                dw_down[p][i] = (float)dwd64[p][i];
            }
            for (int64_t i = 0; has_shared && i < shared_size; ++i) {
                ds_gate[p][i] = (float)dsg64[p][i];
                ds_up[p][i] = (float)dsu64[p][i];
                ds_down[p][i] = (float)dsd64[p][i];
            }
        }
    if (pool) ref_pool_free(pool);
    free(pool);
    free(wide);
    return status;
}
