/* layer.c — random layers, the backend and reference runs, and the comparison (see layer.h).
 *
 * Tolerances. Both sides round at the same points (g, u, h, every expert output, dg, du, each dx
 * part, w·dy, the final sums), but the library sums in fp32 in its own order and the reference in
 * fp64, so now and then an intermediate that sits near a bf16 rounding boundary rounds the other
 * way. One such flip changes the quantities computed from it by about one bf16 ulp (2^-8
 * relative) of that intermediate. The error of a tensor is
 *     max |got - ref| / (atol + rtol * max |ref|),
 * with the maxima taken per block (a rank's rows, or one expert's gradient; d_router_w is one
 * block, see below), and passes at <= 1:
 *
 *   tensor       rtol   why
 *   y, dx        2e-2   bf16 outputs rounded once more at the end (half an ulp, 2^-9 relative).
 *                       2e-2 of the block's max |ref| is about five bf16 ulps at that scale: room
 *                       for the last rounding plus a few flipped intermediates landing on one
 *                       element, while a wrong row, slot or weight (an error of the order of
 *                       max |ref|) fails by far.
 *   d_router_w   3e-2   fp32 dot products <dy, FFN_e(x)> over H of bf16 products; the library forms
 *                       them from dy·W_down and h, the reference from the rounded expert output, so
 *                       they differ by the output's rounding (2^-9 per term, random signs) plus
 *                       flips. That error scales with the terms, not with the result, and a dot of
 *                       random signs often cancels: so this tensor is one block over all ranks (a
 *                       rank with one token would otherwise be judged by one or two small dots).
 *   dw_*, ds_*   3e-2   fp32 sums over an expert's rows of products of bf16 values (x, h, w·dy and
 *                       dg, du, which carry a flip of g, u or h into that row's whole outer
 *                       product), rounded to bf16 by the library in bf16 mode (2^-9), exact fp32 in
 *                       the reference. In accumulate mode the starting values (random in [-1, 1])
 *                       are subtracted again before comparing; fp32 accumulation on top of them
 *                       adds about rows * 2^-25 absolute, far below rtol of any non-zero block.
 *   atol         1e-6   only matters for a block that is zero or nearly so (an expert whose rows
 *                       all have router weight 0 has exact zero gradients on both sides).
 *
 * What the table cannot cover: with a SwiGLU clamp, a flip of g or u across the limit switches
 * that element's clamp mask, a jump of a whole gradient element rather than an ulp (about one case
 * in 300 of the clamp test before layer_avoid_clamp_flips steered inputs away from it).
 *
 * FP8 layers (shape precision MOK_PRECISION_FP8) against the FP8 reference. Both sides quantize the
 * same bf16 values by the same rule, so every quantized operand is bitwise the same on both sides
 * except where the bf16 value it quantizes (h, dg, du) flipped as above and the flip crosses an
 * E4M3 rounding boundary: that element then moves by one E4M3 ulp (2^-3 of it). The cpu backend's
 * FP8 tile sums 128 exact products per block (nearly exact in fp32), so its g, u, dh sit within an
 * fp32 ulp or two of the reference's and such flips are rare: over 530 random layers (H 128-384,
 * I 128-384, uniform, skewed, one-expert and -1-slot routing, both gradient modes) the worst errors
 * were y 7.8e-3 (a last-rounding flip), dx 8.6e-3, d_router_w 1.3e-3 (an h^ flip), gradients
 * 3.9e-3. A missing quantization point (h, dg and du, or dy left unquantized in one GEMM; h
 * instead of h^ in the router dot and dW_down) measured 1.8e-2 to 6e-2 against the FP8
 * reference (test_cpu_fp8.c's cpu_fp8_is_the_fp8_function catches them all by a wider margin);
 * the bf16 reference is 7e-2 away. So:
 *
 *   tensor       rtol    why
 *   y            1.5e-2  the last bf16 rounding flipping the block's largest value (one bf16 ulp:
 *                        up to 2^-7 = 7.8e-3 of it, seen) plus one flipped h^ element (2^-3 of
 *                        one of at least 128 terms, about 4e-3 of the block's max for a term of
 *                        typical size at I = 128).
 *   dx           2e-2    the same for the dx part, whose flips come from dg^, du^ (one of 2I terms)
 *                        and then the last rounding (8.6e-3 seen).
 *   d_router_w   1e-2    the same operands on both sides: fp32 against fp64 dot products (about
 *                        1e-6) but for an h^ flip, 2^-3 of one of I terms (1.3e-3 seen).
 *   dw_*, ds_*   1e-2    the library's own bf16 rounding of the result (up to 2^-8 of an element:
 *                        3.9e-3 of the block at worst, seen), with x^ bitwise equal on both sides
 *                        (an input) and dg, du, h^ as above.
 *   atol         1e-6    as for bf16.
 *
 * Tensor-core block sums (layer.tensor_core_sums: the cuda FP8 tiles). Hopper's FP8 accumulator
 * aligns a block's products to its largest and keeps about 13 bits below it
 * (dev/fp8_tile_probe.cu measured block sums within a few 2^-13 of sum |terms|). At K = H of a few
 * hundred sum |terms| is about sqrt(K) times |g|, so g and u differ from the reference's by up to
 * about one bf16 ulp, often; h then moves by an ulp, and crosses one of E4M3's coarser rounding
 * boundaries (3 mantissa bits against 8) about one time in 2^5: a few percent of the h^ elements
 * flip by one E4M3 step (2^-3 of the element), in every row a y element sums (k routed rows and the
 * shared one, I terms each). Their signs are random, so they add as a walk: with f flips of
 * typical terms among n = (k + 1) · I terms, an error of sqrt(f / n) · 2^-3 of y's typical size:
 * with f / n about 0.03, 2.2e-2 of it. A block's max and its worst error are both the tail of its
 * 10^4 - 10^5 values (4 - 4.5 standard deviations of each), so the worst error is about 2.2e-2 of
 * the block's max. With the last rounding (7.8e-3): y's rtol 3e-2 on those backends.
 * The cuda FP8 backward (test_cuda_fp8_backward.c, 3 seeds of 11 random layers, H 128-384) put
 * the flip fraction higher: y up to 3.7e-2 of its block's max (f about 0.09 in the walk above),
 * and the backward's tensors built from h^ alike: d_router_w (a dot over I terms of h^) 5.3e-2
 * where its block is one token's two slots, its max no tail; dw_down and ds_down (sums of
 * bf16(w dy) h^ over the rows) 3.9e-2 and 2.4e-2; dx (dg^, du^ flipped through the dh sums)
 * 2.2e-2; dw_gate, dw_up, ds_gate, ds_up (dg, du unquantized: an ulp) within the cpu's 1e-2. So on
 * those backends: y 5e-2, dx 3e-2, d_router_w 8e-2, dw_down and ds_down 5e-2. These rows cannot
 * tell a missing quantization point (1.8e-2 - 6e-2, above); the layers whose block sums are exact
 * on the tensor cores (test_cuda_fp8*.c's exact layers: every quantized operand and every GEMM
 * the reference's bits up to fp32 against fp64) keep the cpu's rows, and they can.
 *
 * Single-term flips. The walk above assumes no one term holds most of a block's largest element.
 * h, dg and du are heavy-tailed (products of sums), so a weight gradient's column or row is now
 * and then one row's term, and a flip of that term's factor moves the block's max by a step of
 * the factor itself: up to 2^-3 for h^ (one E4M3 step), a few 2^-7 for dg and du. On the cuda
 * FP8 backward 3 of 16 runs of test_cuda_fp8_backward.c (seeds 1-15 and one more) went past the
 * rows so, each explained by one row at |cos| 0.99-1.0: dw_down 1.62 and 1.07 (h^ moved by 0.25,
 * one E4M3 step, at 2.43 and 2.73), dw_up 1.14 (du moved by two bf16 ulps at 1.14); the same bits
 * on every rerun and on two trees. On tensor-core layers a weight gradient block past its row is
 * judged by judge_flips: moves that one routed (or shared-expert) row's factor element explains,
 * each at most one step of it, are taken out one at a time (up to FLIPS_MAX) and the rest must
 * meet the row. A larger move of a factor, a row's term missing or doubled, or an error no single
 * row explains stays an error (test_layer_compare.c injects each). Exact block sums flip so too,
 * though rarely: on the cpu, dg one bf16 ulp off (0.0071 of it) in a term dominating its row took
 * ds_gate to 1.005 of its row beside the result's own rounding (cpu_fp8_exact_layers, k = 1 with a
 * wide shared expert, MOK_TEST_QUICK=1 MOK_TEST_SEED=1796599302). On those layers judge_flips
 * takes out moves of dg or du of at most one bf16 ulp (2^-7 of it); dw_down and ds_down keep
 * their rows (an h^ flip there needs a g or u flip that also crosses an E4M3 boundary). */
#include "layer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T_Y, T_DX, T_DRW, T_DW_GATE, T_DW_UP, T_DW_DOWN, T_DS_GATE, T_DS_UP, T_DS_DOWN, T_NUM };

typedef struct tolerance {
    const char *name;
    double rtol, atol;
} tolerance;

static const tolerance tolerances_bf16[T_NUM] = {
    [T_Y] = {"y", 2e-2, 1e-6},
    [T_DX] = {"dx", 2e-2, 1e-6},
    [T_DRW] = {"d_router_w", 3e-2, 1e-6},
    [T_DW_GATE] = {"dw_gate", 3e-2, 1e-6},
    [T_DW_UP] = {"dw_up", 3e-2, 1e-6},
    [T_DW_DOWN] = {"dw_down", 3e-2, 1e-6},
    [T_DS_GATE] = {"ds_gate", 3e-2, 1e-6},
    [T_DS_UP] = {"ds_up", 3e-2, 1e-6},
    [T_DS_DOWN] = {"ds_down", 3e-2, 1e-6},
};

static const tolerance tolerances_fp8[T_NUM] = {
    [T_Y] = {"y", 1.5e-2, 1e-6},
    [T_DX] = {"dx", 2e-2, 1e-6},
    [T_DRW] = {"d_router_w", 1e-2, 1e-6},
    [T_DW_GATE] = {"dw_gate", 1e-2, 1e-6},
    [T_DW_UP] = {"dw_up", 1e-2, 1e-6},
    [T_DW_DOWN] = {"dw_down", 1e-2, 1e-6},
    [T_DS_GATE] = {"ds_gate", 1e-2, 1e-6},
    [T_DS_UP] = {"ds_up", 1e-2, 1e-6},
    [T_DS_DOWN] = {"ds_down", 1e-2, 1e-6},
};


/* The rows FP8 layers on tensor-core block sums change (derived above); the others are the cpu's. */
static void tolerances_of(const layer *L, tolerance *out) {
    memcpy(out, L->shape.precision == MOK_PRECISION_FP8 ? tolerances_fp8 : tolerances_bf16, sizeof(tolerance) * T_NUM);
    if (L->shape.precision == MOK_PRECISION_FP8 && L->tensor_core_sums) {
        out[T_Y].rtol = 5e-2;
        out[T_DX].rtol = 3e-2;
        out[T_DRW].rtol = 8e-2;
        out[T_DW_DOWN].rtol = 5e-2;
        out[T_DS_DOWN].rtol = 5e-2;
    }
}

/* ---- random numbers: splitmix64 streams keyed by (seed, purpose, index) -------------------- */

enum { S_X, S_DY, S_WEIGHTS, S_SHARED, S_ROUTE, S_INIT, S_HOT };

typedef struct rng {
    uint64_t state;
} rng;

static uint64_t rng_next(rng *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static rng rng_make(uint64_t seed, uint64_t stream, uint64_t index) {
    rng r = {seed};
    r.state = rng_next(&r) ^ (stream * 0xd1b54a32d192ed03ull);
    r.state = rng_next(&r) ^ (index * 0x8cb92ba72f3d8dd7ull);
    r.state = rng_next(&r);
    return r;
}

static double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-52 - 1.0; } /* [-1, 1) */

static double rng_gaussian(rng *r) {
    double u1 = ((double)(rng_next(r) >> 11) + 1.0) * 0x1.0p-53;
    double u2 = (double)(rng_next(r) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* bf16 uniform in bound * [-1, 1), never 0. */
static void fill_bf16(uint16_t *out, int64_t n, double bound, rng *r) {
    for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        do v = mok_bf16_from_float((float)(bound * rng_uniform(r)));
        while ((v & 0x7fff) == 0);
        out[i] = v;
    }
}

/* ---- memory ------------------------------------------------------------------------------- */

static void *alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63u) / 64u * 64u;
    return aligned_alloc(64, rounded ? rounded : 64);
}

static void fill_u16(void *p, size_t count, uint16_t value) {
    uint16_t *q = p;
    for (size_t i = 0; i < count; ++i) q[i] = value;
}

static void fill_f32_bits(void *p, size_t count, uint32_t bits) {
    uint32_t *q = p;
    for (size_t i = 0; i < count; ++i) q[i] = bits;
}

static int64_t local_experts(const layer *L) { return L->shape.num_experts / L->nranks; }

/* Elements of matrix m of the routed experts of one rank, and of the shared expert. */
static int64_t expert_elems(const layer *L) { return local_experts(L) * L->shape.intermediate * L->shape.hidden; }
static int64_t shared_elems(const layer *L) { return L->shape.shared_intermediate * L->shape.hidden; }

/* ---- the layer ---------------------------------------------------------------------------- */

/* Top-k of logits (entries of -inf are never taken); ids and exp(logit - max) of the chosen. */
static void top_k(const double *logits_in, double *logits, int64_t E, int64_t k, int32_t *ids, double *chosen) {
    double top = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
        logits[e] = logits_in[e];
        if (logits[e] > top) top = logits[e];
    }
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
            if (logits[e] != -INFINITY && (best < 0 || logits[e] > logits[best])) best = e;
        ids[j] = (int32_t)best;
        chosen[j] = exp(logits[best] - top);
        logits[best] = -INFINITY;
    }
}

static int route(layer *L, int p) {
    const int64_t T = L->num_tokens[p], E = L->shape.num_experts, k = L->shape.topk;
    const int mode = L->routing & LAYER_ROUTE_MODE_MASK;
    rng r = rng_make(L->seed, S_ROUTE, (uint64_t)p);
    double *scratch = malloc((size_t)(2 * E + k) * sizeof(double));
    if (!scratch) return -1;
    double *logits = scratch, *work = scratch + E, *chosen = scratch + 2 * E;
    for (int64_t t = 0; t < T; ++t) {
        int32_t *ids = L->topk_ids[p] + t * k;
        float *w = L->router_w[p] + t * k;
        if (mode == LAYER_ROUTE_ONE_EXPERT) {
            for (int64_t j = 0; j < k; ++j) {
                ids[j] = L->hot_expert;
                chosen[j] = 0.25 + 0.75 * fabs(rng_uniform(&r));
            }
        } else {
            for (int64_t e = 0; e < E; ++e) {
                logits[e] = rng_gaussian(&r);
                if (mode == LAYER_ROUTE_SKEWED && E > 1) logits[e] += 3.0 * (1.0 - (double)e / (double)(E - 1));
                if (mode == LAYER_ROUTE_EVEN && e % 2 == 1) logits[e] = -INFINITY;
            }
            top_k(logits, work, E, k, ids, chosen);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < k; ++j) sum += chosen[j];
        for (int64_t j = 0; j < k; ++j) w[j] = (float)(chosen[j] / sum);
        if (L->routing & LAYER_ENCODED)
            for (int64_t j = 0; j < k; ++j) w[j] = ldexpf(1.0f, -(int)(j % 24) - 1);
        if (L->routing & LAYER_SIGNED_WEIGHTS)
            for (int64_t j = 0; j < k; ++j) {
                uint64_t pick = rng_next(&r) % 4;
                if (pick == 0) w[j] = 0.0f;
                else if (pick == 1) w[j] = -w[j];
            }
        if (mode == LAYER_ROUTE_HOLES)
            for (int64_t j = 0; j < k; ++j)
                if (t % 5 == 3 || rng_next(&r) % 4 == 0) {
                    ids[j] = -1;
                    w[j] = NAN;
                }
    }
    free(scratch);
    return 0;
}

/* x[t] of rank p in the encoded form: the signs of the first 24 elements spell p * 2^16 + t, the
 * rest is a fixed pattern of the same code; every value is an exact bf16, none is 0. */
static void encode_x(uint16_t *x, int64_t H, int p, int64_t t) {
    uint64_t code = ((uint64_t)p << 16) + (uint64_t)t;
    for (int64_t h = 0; h < H; ++h) {
        float v;
        if (h < 24) v = ((code >> h) & 1) ? 0.75f : -0.5f;
        else v = (float)((int64_t)((h * 13 + (int64_t)code * 7) % 31) - 15) / 16.0f + 1.0f / 32.0f;
        x[h] = mok_bf16_from_float(v);
    }
}

int layer_make(layer *L, const mok_shape *shape, int nranks, const int64_t *tokens_per_rank, uint64_t seed,
               int routing) {
    memset(L, 0, sizeof *L);
    L->shape = *shape;
    L->nranks = nranks;
    L->routing = routing;
    L->seed = seed;
    L->hot_expert = -1;
    int64_t max_tokens = 1;
    for (int p = 0; p < nranks; ++p) {
        L->num_tokens[p] = tokens_per_rank[p];
        if (tokens_per_rank[p] > max_tokens) max_tokens = tokens_per_rank[p];
    }
    if (L->shape.max_tokens < max_tokens) L->shape.max_tokens = max_tokens;
    const int64_t H = shape->hidden, I = shape->intermediate, Is = shape->shared_intermediate;
    const int64_t E = shape->num_experts, k = shape->topk;
    const int mode = routing & LAYER_ROUTE_MODE_MASK;
    if (mode >= LAYER_ROUTE_NUM_MODES || (mode == LAYER_ROUTE_EVEN && 2 * k > E)) return -1;
    if (mode == LAYER_ROUTE_ONE_EXPERT) {
        rng r = rng_make(seed, S_HOT, 0);
        L->hot_expert = (int)(rng_next(&r) % (uint64_t)E);
    }
    const double bound_h = sqrt(3.0 / (double)H), bound_i = sqrt(3.0 / (double)I);
    for (int p = 0; p < nranks; ++p) {
        const int64_t T = L->num_tokens[p];
        if (T > 0) {
            L->x[p] = alloc_aligned((size_t)(T * H) * 2);
            L->dy[p] = alloc_aligned((size_t)(T * H) * 2);
            L->topk_ids[p] = alloc_aligned((size_t)(T * k) * 4);
            L->router_w[p] = alloc_aligned((size_t)(T * k) * 4);
            if (!L->x[p] || !L->dy[p] || !L->topk_ids[p] || !L->router_w[p]) return -1;
            rng rx = rng_make(seed, S_X, (uint64_t)p), rdy = rng_make(seed, S_DY, (uint64_t)p);
            if (routing & LAYER_ENCODED)
                for (int64_t t = 0; t < T; ++t) encode_x(L->x[p] + t * H, H, p, t);
            else
                fill_bf16(L->x[p], T * H, 1.0, &rx);
            fill_bf16(L->dy[p], T * H, 1.0, &rdy);
            if (route(L, p) != 0) return -1;
        }
        rng rw = rng_make(seed, S_WEIGHTS, (uint64_t)p);
        for (int m = 0; m < 3; ++m) {
            L->w[m][p] = alloc_aligned((size_t)expert_elems(L) * 2);
            if (!L->w[m][p]) return -1;
            fill_bf16(L->w[m][p], expert_elems(L), m == LAYER_DOWN ? bound_i : bound_h, &rw);
        }
    }
    if (Is > 0) {
        rng rs = rng_make(seed, S_SHARED, 0);
        for (int m = 0; m < 3; ++m) {
            L->s[m] = alloc_aligned((size_t)(Is * H) * 2);
            if (!L->s[m]) return -1;
            fill_bf16(L->s[m], Is * H, m == LAYER_DOWN ? sqrt(3.0 / (double)Is) : bound_h, &rs);
        }
    }
    return 0;
}

/* The bf16 rounding midpoint whose two sides fall on either side of the clamp test v > limit. */
static double clamp_midpoint(float limit) {
    uint32_t bits;
    memcpy(&bits, &limit, 4);
    bits &= 0xffff0000u; /* the largest bf16 <= limit (limit > 0) */
    float below, above;
    memcpy(&below, &bits, 4);
    bits += 0x10000u;
    memcpy(&above, &bits, 4);
    return 0.5 * ((double)below + (double)above);
}

/* Whether one of the g, u values of x (H) through gate/up ([inter, H]) is near the midpoint. */
static int near_clamp_flip(const double *x, const double *gate, const double *up, int64_t inter, int64_t H,
                           double midpoint) {
    const double window = 0x1.0p-16;
    for (int64_t i = 0; i < inter; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t h = 0; h < H; ++h) {
            g += x[h] * gate[i * H + h];
            u += x[h] * up[i * H + h];
        }
        if (fabs(g - midpoint) < window || fabs(fabs(u) - midpoint) < window) return 1;
    }
    return 0;
}

/* The operand values an FP8 layer's GEMMs see (mok.h, FP8 section), for steering inputs only:
 * n values of bf16 v as one block (stride apart in rows of width), dequantized into out. */
static void fp8_block_values(const uint16_t *v, int64_t rows, int64_t width, int64_t stride, double *out) {
    double amax = 0.0;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c) {
            const double a = fabs(mok_bf16_to_float(v[r * stride + c]));
            if (isfinite(a) && a > amax) amax = a;
        }
    int e = -124;
    while (amax > ldexp(448.0, e)) ++e;
    if (amax == 0.0) e = 0;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c) {
            const float scaled = (float)ldexp(mok_bf16_to_float(v[r * stride + c]), -e);
            out[r * stride + c] = ldexp(mok_e4m3_to_float(mok_e4m3_from_float(scaled)), e);
        }
}

/* A matrix [rows, cols] (count of them) as the GEMMs see it: bf16 widened, or for FP8 its 128 x 128
 * blocks (weights) or 1 x 128 row blocks (activations) quantized. */
static double *operand_values(const layer *L, const uint16_t *m, int64_t count, int64_t rows, int64_t cols,
                              int weights) {
    double *out = malloc((size_t)(count * rows * cols) * sizeof(double) + 8);
    if (!out) return NULL;
    for (int64_t i = 0; i < count * rows * cols; ++i) out[i] = mok_bf16_to_float(m[i]);
    if (L->shape.precision != MOK_PRECISION_FP8) return out;
    const int64_t block_rows = weights ? MOK_FP8_BLOCK : 1;
    for (int64_t e = 0; e < count; ++e)
        for (int64_t r = 0; r < rows; r += block_rows)
            for (int64_t c = 0; c < cols; c += MOK_FP8_BLOCK)
                fp8_block_values(m + e * rows * cols + r * cols + c, block_rows, MOK_FP8_BLOCK, cols,
                                 out + e * rows * cols + r * cols + c);
    return out;
}

int layer_avoid_clamp_flips(layer *L) {
    if (!(L->swiglu_limit > 0.0f)) return 0;
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t k = L->shape.topk, El = local_experts(L);
    const double midpoint = clamp_midpoint(L->swiglu_limit);
    double *gate[MOK_MAX_RANKS] = {0}, *up[MOK_MAX_RANKS] = {0}, *s_gate = NULL, *s_up = NULL;
    double *x = malloc((size_t)H * sizeof(double));
    int ok = x != NULL, redrawn = 0;
    for (int p = 0; ok && p < L->nranks; ++p) {
        gate[p] = operand_values(L, L->w[LAYER_GATE][p], El, I, H, 1);
        up[p] = operand_values(L, L->w[LAYER_UP][p], El, I, H, 1);
        ok = gate[p] && up[p];
    }
    if (ok && L->s[LAYER_GATE]) {
        s_gate = operand_values(L, L->s[LAYER_GATE], 1, Is, H, 1);
        s_up = operand_values(L, L->s[LAYER_UP], 1, Is, H, 1);
        ok = s_gate && s_up;
    }
    for (int p = 0; ok && p < L->nranks; ++p)
        for (int64_t t = 0; t < L->num_tokens[p]; ++t) {
            uint16_t *row = L->x[p] + t * H;
            for (int attempt = 0; attempt < 64; ++attempt) {
                double *values = operand_values(L, row, 1, 1, H, 0);
                if (!values) break;
                memcpy(x, values, (size_t)H * sizeof(double));
                free(values);
                int near = s_gate && near_clamp_flip(x, s_gate, s_up, Is, H, midpoint);
                for (int64_t j = 0; j < k && !near; ++j) {
                    const int32_t e = L->topk_ids[p][t * k + j];
                    if (e < 0) continue;
                    near = near_clamp_flip(x, gate[e / El] + (e % El) * I * H, up[e / El] + (e % El) * I * H, I, H,
                                           midpoint);
                }
                if (!near) break;
                rng r = rng_make(L->seed ^ 0x636c616d70ull, (uint64_t)(p * 64 + attempt), (uint64_t)t);
                fill_bf16(row, H, 1.0, &r);
                ++redrawn;
            }
        }
    for (int p = 0; p < L->nranks; ++p) {
        free(gate[p]);
        free(up[p]);
    }
    free(s_gate);
    free(s_up);
    free(x);
    return redrawn;
}

void layer_free(layer *L) {
    for (int p = 0; p < MOK_MAX_RANKS; ++p) {
        free(L->x[p]);
        free(L->dy[p]);
        free(L->topk_ids[p]);
        free(L->router_w[p]);
        for (int m = 0; m < 3; ++m) free(L->w[m][p]);
    }
    for (int m = 0; m < 3; ++m) free(L->s[m]);
    memset(L, 0, sizeof *L);
}

void layer_result_free(layer_result *r) {
    for (int p = 0; p < MOK_MAX_RANKS; ++p) {
        free(r->y[p]);
        free(r->dx[p]);
        free(r->d_router_w[p]);
        free(r->schedule[p]);
        free(r->context[p]);
        free(r->fp8_weights[p]);
        for (int m = 0; m < 3; ++m) {
            free(r->dw[m][p]);
            free(r->ds[m][p]);
            free(r->dw_init[m][p]);
            free(r->ds_init[m][p]);
        }
    }
    memset(r, 0, sizeof *r);
}

/* ---- the backend -------------------------------------------------------------------------- */

static mok_status note(char *message, size_t size, mok_status status, const char *call) {
    if (status != MOK_OK) snprintf(message, size, "%s: %s (%s)", call, mok_last_error(), mok_status_string(status));
    return status;
}

mok_status layer_backend_open(layer_backend *B, const layer *L, const mok_config *config) {
    memset(B, 0, sizeof *B);
    B->config = config ? *config : mok_config_default();
    B->config.swiglu_limit = L->swiglu_limit;
    B->nranks = L->nranks;
    B->shape = L->shape;
    mok_status st = mok_group_create_local(&B->group, MOK_BACKEND_CPU, L->nranks, NULL, &B->config);
    if (note(B->message, sizeof B->message, st, "mok_group_create_local") != MOK_OK) return st;
    st = mok_workspace_create(&B->workspace, B->group, &L->shape, &B->config);
    if (note(B->message, sizeof B->message, st, "mok_workspace_create") != MOK_OK) return st;
    st = mok_workspace_sizes(B->workspace, &B->sizes);
    return note(B->message, sizeof B->message, st, "mok_workspace_sizes");
}

void layer_backend_close(layer_backend *B) {
    if (B->workspace) mok_workspace_destroy(B->workspace);
    if (B->group) mok_group_destroy(B->group);
    B->workspace = NULL;
    B->group = NULL;
}

void layer_forward_args(const layer *L, const layer_result *r, mok_forward_args *args) {
    for (int p = 0; p < L->nranks; ++p) {
        mok_forward_args *a = &args[p];
        memset(a, 0, sizeof *a);
        a->num_tokens = L->num_tokens[p];
        a->schedule = r->schedule[p];
        a->x = L->x[p];
        a->router_w = L->router_w[p];
        a->w_gate = L->w[LAYER_GATE][p];
        a->w_up = L->w[LAYER_UP][p];
        a->w_down = L->w[LAYER_DOWN][p];
        a->s_gate = L->s[LAYER_GATE];
        a->s_up = L->s[LAYER_UP];
        a->s_down = L->s[LAYER_DOWN];
        a->y = r->y[p];
        a->context = r->context[p];
        a->fp8_weights = r->fp8_weights[p];
    }
}

void layer_backward_args(const layer *L, const layer_result *r, int accumulate, mok_backward_args *args) {
    for (int p = 0; p < L->nranks; ++p) {
        mok_backward_args *a = &args[p];
        memset(a, 0, sizeof *a);
        a->num_tokens = L->num_tokens[p];
        a->schedule = r->schedule[p];
        a->context = r->context[p];
        a->dy = L->dy[p];
        a->x = L->x[p];
        a->router_w = L->router_w[p];
        a->w_gate = L->w[LAYER_GATE][p];
        a->w_up = L->w[LAYER_UP][p];
        a->w_down = L->w[LAYER_DOWN][p];
        a->s_gate = L->s[LAYER_GATE];
        a->s_up = L->s[LAYER_UP];
        a->s_down = L->s[LAYER_DOWN];
        a->dx = r->dx[p];
        a->d_router_w = r->d_router_w[p];
        a->accumulate = accumulate;
        a->dw_gate = r->dw[LAYER_GATE][p];
        a->dw_up = r->dw[LAYER_UP][p];
        a->dw_down = r->dw[LAYER_DOWN][p];
        a->ds_gate = r->ds[LAYER_GATE][p];
        a->ds_up = r->ds[LAYER_UP][p];
        a->ds_down = r->ds[LAYER_DOWN][p];
        a->fp8_weights = r->fp8_weights[p];
    }
}

static int same_shape(const mok_shape *a, const mok_shape *b) {
    return a->hidden == b->hidden && a->intermediate == b->intermediate && a->num_experts == b->num_experts &&
           a->topk == b->topk && a->shared_intermediate == b->shared_intermediate &&
           a->max_tokens == b->max_tokens && a->precision == b->precision;
}

mok_status layer_backend_forward(layer_backend *B, const layer *L, layer_result *out) {
    const int P = L->nranks;
    const int64_t H = L->shape.hidden;
    if (P != B->nranks || !same_shape(&L->shape, &B->shape)) {
        snprintf(out->message, sizeof out->message, "layer_backend_forward: layer and session differ in shape");
        return MOK_ERR_INVALID_ARGUMENT;
    }
    out->nranks = P;
    out->schedule_bytes = B->sizes.schedule_bytes;
    out->context_bytes = B->sizes.context_bytes;
    for (int p = 0; p < P; ++p) {
        const int64_t T = L->num_tokens[p];
        if (T > 0 && !out->y[p]) out->y[p] = alloc_aligned((size_t)(T * H) * 2);
        if (!out->schedule[p]) out->schedule[p] = alloc_aligned(out->schedule_bytes);
        if (!out->context[p]) out->context[p] = alloc_aligned(out->context_bytes);
        if ((T > 0 && !out->y[p]) || !out->schedule[p] || !out->context[p]) {
            snprintf(out->message, sizeof out->message, "layer_backend_forward: out of memory");
            return MOK_ERR_OUT_OF_MEMORY;
        }
        if (T > 0) fill_u16(out->y[p], (size_t)(T * H), LAYER_POISON_BF16);
        memset(out->schedule[p], 0xa5, out->schedule_bytes);
        fill_u16(out->context[p], out->context_bytes / 2, LAYER_POISON_BF16);
    }
    mok_status st;
    if (L->shape.precision == MOK_PRECISION_FP8) { /* the weights, quantized into poisoned buffers */
        mok_fp8_layout layout;
        st = mok_workspace_fp8_layout(B->workspace, &layout);
        if (note(out->message, sizeof out->message, st, "mok_workspace_fp8_layout") != MOK_OK) return st;
        mok_quantize_args qargs[MOK_MAX_RANKS];
        out->fp8_bytes = layout.bytes;
        for (int p = 0; p < P; ++p) {
            if (!out->fp8_weights[p] && !(out->fp8_weights[p] = alloc_aligned(layout.bytes))) {
                snprintf(out->message, sizeof out->message, "layer_backend_forward: out of memory");
                return MOK_ERR_OUT_OF_MEMORY;
            }
            memset(out->fp8_weights[p], 0xa5, layout.bytes);
            qargs[p] = (mok_quantize_args){L->w[LAYER_GATE][p], L->w[LAYER_UP][p], L->w[LAYER_DOWN][p],
                                           L->s[LAYER_GATE],     L->s[LAYER_UP],     L->s[LAYER_DOWN],
                                           out->fp8_weights[p],  NULL};
        }
        st = mok_quantize_weights(B->workspace, qargs);
        if (note(out->message, sizeof out->message, st, "mok_quantize_weights") != MOK_OK) return st;
    }
    mok_schedule_args sargs[MOK_MAX_RANKS] = {{0}};
    for (int p = 0; p < P; ++p) sargs[p] = (mok_schedule_args){L->num_tokens[p], L->topk_ids[p], out->schedule[p], NULL};
    st = mok_schedule_build(B->workspace, sargs);
    if (note(out->message, sizeof out->message, st, "mok_schedule_build") != MOK_OK) return st;
    for (int p = 0; p < P; ++p) {
        st = mok_schedule_read(B->workspace, out->schedule[p], p, &out->info[p]);
        if (note(out->message, sizeof out->message, st, "mok_schedule_read") != MOK_OK) return st;
    }
    mok_forward_args fargs[MOK_MAX_RANKS];
    layer_forward_args(L, out, fargs);
    st = mok_forward(B->workspace, fargs);
    return note(out->message, sizeof out->message, st, "mok_forward");
}

mok_status layer_backend_backward(layer_backend *B, const layer *L, int accumulate, layer_result *out) {
    const int P = L->nranks;
    const int64_t H = L->shape.hidden, k = L->shape.topk;
    const int has_shared = L->shape.shared_intermediate > 0;
    const size_t elem = accumulate ? 4 : 2;
    out->grads_f32 = accumulate;
    for (int p = 0; p < P; ++p) {
        const int64_t T = L->num_tokens[p];
        free(out->dx[p]);
        free(out->d_router_w[p]);
        out->dx[p] = T > 0 ? alloc_aligned((size_t)(T * H) * 2) : NULL;
        out->d_router_w[p] = T > 0 ? alloc_aligned((size_t)(T * k) * 4) : NULL;
        if (T > 0 && (!out->dx[p] || !out->d_router_w[p])) goto oom;
        if (T > 0) {
            fill_u16(out->dx[p], (size_t)(T * H), LAYER_POISON_BF16);
            fill_f32_bits(out->d_router_w[p], (size_t)(T * k), LAYER_POISON_F32_BITS);
        }
        for (int m = 0; m < 3; ++m) {
            for (int shared = 0; shared < 2; ++shared) {
                if (shared && !has_shared) continue;
                const int64_t n = shared ? shared_elems(L) : expert_elems(L);
                void **buf = shared ? &out->ds[m][p] : &out->dw[m][p];
                float **init = shared ? &out->ds_init[m][p] : &out->dw_init[m][p];
                free(*buf);
                free(*init);
                *init = NULL;
                *buf = alloc_aligned((size_t)n * elem);
                if (!*buf) goto oom;
                if (!accumulate) {
                    fill_u16(*buf, (size_t)n, LAYER_POISON_BF16);
                    continue;
                }
                *init = alloc_aligned((size_t)n * 4);
                if (!*init) goto oom;
                rng r = rng_make(L->seed, S_INIT, (uint64_t)(p * 8 + m * 2 + shared));
                for (int64_t i = 0; i < n; ++i) (*init)[i] = (float)rng_uniform(&r);
                memcpy(*buf, *init, (size_t)n * 4);
            }
        }
    }
    mok_backward_args bargs[MOK_MAX_RANKS];
    layer_backward_args(L, out, accumulate, bargs);
    mok_status st = mok_backward(B->workspace, bargs);
    return note(out->message, sizeof out->message, st, "mok_backward");
oom:
    snprintf(out->message, sizeof out->message, "layer_backend_backward: out of memory");
    return MOK_ERR_OUT_OF_MEMORY;
}

mok_status layer_backend_run(layer_backend *B, const layer *L, int accumulate, layer_result *out) {
    mok_status st = layer_backend_forward(B, L, out);
    return st != MOK_OK ? st : layer_backend_backward(B, L, accumulate, out);
}

mok_status layer_run_backend(const layer *L, const mok_config *config, int accumulate, layer_result *out) {
    layer_backend B;
    mok_status st = layer_backend_open(&B, L, config);
    if (st != MOK_OK) snprintf(out->message, sizeof out->message, "%s", B.message);
    else st = layer_backend_run(&B, L, accumulate, out);
    layer_backend_close(&B);
    return st;
}

/* ---- the reference ------------------------------------------------------------------------ */

static mok_status run_reference(const layer *L, layer_result *ref, int backward) {
    const int P = L->nranks;
    const int64_t H = L->shape.hidden, k = L->shape.topk;
    const int has_shared = L->shape.shared_intermediate > 0;
    ref->nranks = P;
    ref->grads_f32 = 1;
    for (int p = 0; p < P; ++p) {
        const int64_t T = L->num_tokens[p];
        if (T > 0) {
            ref->y[p] = alloc_aligned((size_t)(T * H) * 2);
            if (!ref->y[p]) goto oom;
            if (!backward) continue;
            ref->dx[p] = alloc_aligned((size_t)(T * H) * 2);
            ref->d_router_w[p] = alloc_aligned((size_t)(T * k) * 4);
            if (!ref->dx[p] || !ref->d_router_w[p]) goto oom;
        }
        for (int m = 0; m < 3 && backward; ++m) {
            ref->dw[m][p] = alloc_aligned((size_t)expert_elems(L) * 4);
            if (!ref->dw[m][p]) goto oom;
            if (has_shared && !(ref->ds[m][p] = alloc_aligned((size_t)shared_elems(L) * 4))) goto oom;
        }
    }
    mok_ref_layer rl = {0};
    rl.shape = &L->shape;
    rl.nranks = P;
    rl.swiglu_limit = L->swiglu_limit;
    rl.num_tokens = L->num_tokens;
    rl.x = (const void *const *)L->x;
    rl.topk_ids = (const int32_t *const *)L->topk_ids;
    rl.router_w = (const float *const *)L->router_w;
    rl.w_gate = (const void *const *)L->w[LAYER_GATE];
    rl.w_up = (const void *const *)L->w[LAYER_UP];
    rl.w_down = (const void *const *)L->w[LAYER_DOWN];
    rl.s_gate = L->s[LAYER_GATE];
    rl.s_up = L->s[LAYER_UP];
    rl.s_down = L->s[LAYER_DOWN];
    mok_status st = mok_ref_forward(&rl, (void *const *)ref->y);
    if (note(ref->message, sizeof ref->message, st, "mok_ref_forward") != MOK_OK || !backward) return st;
    st = mok_ref_backward(&rl, (const void *const *)L->dy, (void *const *)ref->dx, ref->d_router_w,
                          (float *const *)ref->dw[LAYER_GATE], (float *const *)ref->dw[LAYER_UP],
                          (float *const *)ref->dw[LAYER_DOWN], has_shared ? (float *const *)ref->ds[LAYER_GATE] : NULL,
                          has_shared ? (float *const *)ref->ds[LAYER_UP] : NULL,
                          has_shared ? (float *const *)ref->ds[LAYER_DOWN] : NULL);
    return note(ref->message, sizeof ref->message, st, "mok_ref_backward");
oom:
    snprintf(ref->message, sizeof ref->message, "layer_run_reference: out of memory");
    return MOK_ERR_OUT_OF_MEMORY;
}

mok_status layer_run_reference(const layer *L, layer_result *ref) { return run_reference(L, ref, 1); }

mok_status layer_run_reference_forward(const layer *L, layer_result *ref) { return run_reference(L, ref, 0); }

/* ---- comparison --------------------------------------------------------------------------- */

static double bf16_at(const void *p, int64_t i) { return (double)mok_bf16_to_float(((const uint16_t *)p)[i]); }
static double f32_at(const void *p, int64_t i) { return (double)((const float *)p)[i]; }

static int is_poison(const void *p, int64_t i, int f32) {
    if (!f32) return ((const uint16_t *)p)[i] == LAYER_POISON_BF16;
    uint32_t bits;
    memcpy(&bits, (const float *)p + i, 4);
    return bits == LAYER_POISON_F32_BITS;
}

/* The running state of one tensor's comparison. */
typedef struct tensor_cmp {
    double worst;           /* normalized error of the worst block */
    double worst_abs, worst_scale, got_value, ref_value;
    int worst_rank;
    int64_t worst_index;    /* element inside the worst block's rank array */
    int64_t unwritten;      /* poison left where the reference is finite */
    int64_t nonfinite;      /* non-finite on one side only (not poison) */
    int64_t empty_slot;     /* d_router_w of a -1 slot that is not exactly 0 */
} tensor_cmp;

/* One block of rank `rank`'s arrays: elements first + r * stride + c for r < rows, c < width (a
 * contiguous run of width elements when rows = 1). got holds bf16 (got_f32 = 0) or fp32 values,
 * init (may be NULL) the fp32 starting values to subtract; ref holds bf16 or fp32. scale >= 0
 * replaces the block's own max |ref| as the scale of the tolerance. */
static void compare_block(const tolerance *tolerances, tensor_cmp *c, int tensor, int rank, int64_t first,
                          int64_t rows, int64_t width, int64_t stride, const void *got, int got_f32, const float *init,
                          const void *ref, int ref_f32, double scale_ref) {
    double max_ref = 0.0, max_err = 0.0, got_v = 0.0, ref_v = 0.0;
    int64_t worst = -1;
    for (int64_t n = 0; n < rows * width; ++n) {
        const int64_t i = first + n / width * stride + n % width;
        double g = got_f32 ? f32_at(got, i) : bf16_at(got, i);
        double r = ref_f32 ? f32_at(ref, i) : bf16_at(ref, i);
        if (init && isfinite(g)) g -= (double)init[i];
        double err;
        if (!isfinite(r)) {
            err = isfinite(g) ? INFINITY : 0.0;
            if (isfinite(g)) ++c->nonfinite;
        } else {
            if (fabs(r) > max_ref) max_ref = fabs(r);
            if (!isfinite(g)) {
                err = INFINITY;
                if (is_poison(got, i, got_f32)) ++c->unwritten;
                else ++c->nonfinite;
            } else {
                err = fabs(g - r);
            }
        }
        if (worst < 0 || err > max_err) {
            max_err = err;
            worst = i;
            got_v = g;
            ref_v = r;
        }
    }
    if (worst < 0) return;
    if (scale_ref >= 0.0) max_ref = scale_ref;
    const double scale = tolerances[tensor].atol + tolerances[tensor].rtol * max_ref;
    const double normalized = max_err / scale;
    if (normalized > c->worst || c->worst_index < 0) {
        c->worst = normalized;
        c->worst_abs = max_err;
        c->worst_scale = max_ref;
        c->worst_rank = rank;
        c->worst_index = worst;
        c->got_value = got_v;
        c->ref_value = ref_v;
    }
}

/* The (rank, token) whose reference y row is nearest (max-abs) to got's row t of rank p. */
static void nearest_row(const layer *L, const layer_result *got, const layer_result *ref, int p, int64_t t,
                        int *best_p, int64_t *best_t, double *best_err) {
    const int64_t H = L->shape.hidden;
    *best_p = -1;
    *best_t = -1;
    *best_err = INFINITY;
    for (int q = 0; q < L->nranks; ++q)
        for (int64_t u = 0; u < L->num_tokens[q]; ++u) {
            double err = 0.0;
            for (int64_t h = 0; h < H && err < *best_err; ++h) {
                double d = fabs(bf16_at(got->y[p], t * H + h) - bf16_at(ref->y[q], u * H + h));
                if (!(d <= err)) err = d; /* NaN counts as worst */
            }
            if (err < *best_err) {
                *best_err = err;
                *best_p = q;
                *best_t = u;
            }
        }
}

static void describe(const layer *L, int tensor, const tensor_cmp *c, char *out, size_t size) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t k = L->shape.topk, i = c->worst_index;
    switch (tensor) {
    case T_Y:
    case T_DX:
        snprintf(out, size, "rank %d token %lld col %lld", c->worst_rank, (long long)(i / H), (long long)(i % H));
        break;
    case T_DRW:
        snprintf(out, size, "rank %d token %lld slot %lld (expert %d)", c->worst_rank, (long long)(i / k),
                 (long long)(i % k), L->topk_ids[c->worst_rank][i]);
        break;
    case T_DW_GATE:
    case T_DW_UP:
    case T_DW_DOWN: {
        const int64_t per = I * H, cols = tensor == T_DW_DOWN ? I : H;
        snprintf(out, size, "expert %lld (rank %d) row %lld col %lld",
                 (long long)(c->worst_rank * local_experts(L) + i / per), c->worst_rank,
                 (long long)(i % per / cols), (long long)(i % per % cols));
        break;
    }
    default: {
        const int64_t cols = tensor == T_DS_DOWN ? Is : H;
        snprintf(out, size, "rank %d row %lld col %lld", c->worst_rank, (long long)(i / cols), (long long)(i % cols));
    }
    }
}

/* Single-term flips in a weight gradient. A gradient block (routed expert el's matrix m on rank
 * p, or the rank's shared-expert matrix) is a sum over its rows of outer products: the down
 * matrix [H, I] of (w dy_t) x h^_t, gate and up [I, H] of dg_t or du_t x x_t (w = 1 for the
 * shared expert's rows, every token of the rank). A flip of one row's factor element (h^_t at
 * column c, dg_t or du_t at row r) moves a whole column c of the down matrix along that row's dy_t,
 * or a whole row r of gate / up along its x_t, and nothing else. (x_t stands for the x^_t the
 * gradient sums: they differ by less than an E4M3 step, which leaves under 2^-4 of a move behind.) */
#define FLIPS_MAX 8
#define FLIP_STEP_DOWN 0.125     /* one E4M3 step of h^: at most 2^-3 of it */
#define FLIP_STEP_GATE_UP 0.03125 /* dg, du: dh's block sums, g and u one bf16 ulp each, 3 x 2^-7 < 2^-5 */
#define FLIP_STEP_GATE_UP_EXACT 0.0078125 /* exact block sums (the cpu): dg or du one bf16 ulp, at most 2^-7 */

/* Judges block el of tensor T_DW_* or T_DS_* on rank p (got and ref finite there) with the worst
 * element found one row at a time: the error's column (down) or row (gate, up) through it is
 * projected on every row's dy_t or x_t, and the closest row (|cos|) explains it with coefficient
 * delta; own is the reference's column or row projected on the same vector, for a term that
 * dominates its column an estimate of the factor element itself. accept: a move of at most one
 * step of that element (FLIP_STEP_*: |delta| <= step |own|) is a flip the tolerances allow; its
 * rank-one part is taken out and the next worst element judged, up to FLIPS_MAX of them. Returns
 * the block's normalized error after them (*flips: how many), and prints why the worst element
 * was not explained when it stays above 1. */
static double judge_flips(const layer *L, const tolerance *tol, int tensor, int p, int64_t el,
                          const layer_result *got, const layer_result *ref, int accept, const char *tag, int *flips) {
    const int64_t H = L->shape.hidden, k = L->shape.topk;
    const int shared = tensor >= T_DS_GATE, m = tensor - (shared ? T_DS_GATE : T_DW_GATE), down = m == LAYER_DOWN;
    const int64_t inner = shared ? L->shape.shared_intermediate : L->shape.intermediate;
    const int64_t R = down ? H : inner, C = down ? inner : H, base = shared ? 0 : el * inner * H;
    const int64_t e = p * local_experts(L) + el;
    const void *gp = shared ? got->ds[m][p] : got->dw[m][p], *rp = shared ? ref->ds[m][p] : ref->dw[m][p];
    const float *init = shared ? got->ds_init[m][p] : got->dw_init[m][p];
    *flips = 0;
    double *D = malloc((size_t)(R * C + 2 * H) * sizeof *D);
    if (!D) return INFINITY;
    double *d = D + R * C, *rv = d + H, max_ref = 0.0;
    for (int64_t i = 0; i < R * C; ++i) {
        const double r = ref->grads_f32 ? f32_at(rp, base + i) : bf16_at(rp, base + i);
        double g = got->grads_f32 ? f32_at(gp, base + i) : bf16_at(gp, base + i);
        if (init) g -= (double)init[base + i];
        D[i] = g - r;
        if (fabs(r) > max_ref) max_ref = fabs(r);
    }
    const double scale = tol[tensor].atol + tol[tensor].rtol * max_ref;
    double error = 0.0;
    for (;;) {
        int64_t worst = 0;
        for (int64_t i = 1; i < R * C; ++i)
            if (fabs(D[i]) > fabs(D[worst])) worst = i;
        error = fabs(D[worst]) / scale;
        if (error <= 1.0) break;
        const int64_t r0 = worst / C, c0 = worst % C;
        double dd = 0.0;
        for (int64_t h = 0; h < H; ++h) { /* the error's vector along H, and the reference's */
            const int64_t at = down ? h * C + c0 : r0 * C + h;
            d[h] = D[at];
            rv[h] = ref->grads_f32 ? f32_at(rp, base + at) : bf16_at(rp, base + at);
            dd += d[h] * d[h];
        }
        double best = 0.0, next = 0.0, delta = 0.0, own = 0.0, w_best = 1.0;
        int best_q = -1;
        int64_t best_t = -1, best_j = -1, rows = 0;
        for (int q = 0; q < L->nranks; ++q) {
            if (shared && q != p) continue;
            for (int64_t t = 0; t < L->num_tokens[q]; ++t)
                for (int64_t j = 0; j < (shared ? 1 : k); ++j) {
                    if (!shared && L->topk_ids[q][t * k + j] != e) continue;
                    ++rows;
                    const uint16_t *v = (down ? L->dy[q] : L->x[q]) + t * H;
                    double dv = 0.0, vv = 0.0, rx = 0.0;
                    for (int64_t h = 0; h < H; ++h) {
                        const double x = (double)mok_bf16_to_float(v[h]);
                        dv += d[h] * x;
                        rx += rv[h] * x;
                        vv += x * x;
                    }
                    const double cs = dd > 0.0 && vv > 0.0 ? fabs(dv) / sqrt(dd * vv) : 0.0;
                    if (cs > best) {
                        next = best;
                        best = cs;
                        best_q = q;
                        best_t = t;
                        best_j = j;
                        w_best = down && !shared ? (double)L->router_w[q][t * k + j] : 1.0;
                        delta = dv / vv;
                        own = rx / vv;
                    } else if (cs > next) {
                        next = cs;
                    }
                }
        }
        const double step = down ? FLIP_STEP_DOWN : L->tensor_core_sums ? FLIP_STEP_GATE_UP : FLIP_STEP_GATE_UP_EXACT;
        if (accept && best_t >= 0 && *flips < FLIPS_MAX && fabs(delta) <= step * fabs(own)) {
            const uint16_t *v = (down ? L->dy[best_q] : L->x[best_q]) + best_t * H;
            for (int64_t h = 0; h < H; ++h)
                D[down ? h * C + c0 : r0 * C + h] -= delta * (double)mok_bf16_to_float(v[h]);
            ++*flips;
            continue;
        }
        if (best_t >= 0)
            fprintf(stderr,
                    "    [%s] %s: the error's %s %lld of %s %lld (%lld rows) lies along rank %d token %lld slot %lld's "
                    "%s (|cos| %.3f, next row %.3f): as if that row's %s at %lld moved by %.6g, %.3g of its value "
                    "(%.6g, the reference's projection on the same row; one step is %g of it)\n",
                    tag, tol[tensor].name, down ? "column" : "row", (long long)(down ? c0 : r0),
                    shared ? "the shared expert of rank" : "expert", (long long)(shared ? p : e), (long long)rows,
                    best_q, (long long)best_t, (long long)best_j, down ? "dy" : "x", best, next,
                    down ? "h^" : m == LAYER_UP ? "du" : "dg", (long long)(down ? c0 : r0), delta / w_best,
                    own != 0.0 ? delta / own : INFINITY, own / w_best, step);
        break;
    }
    free(D);
    return error;
}

/* A matrix [rows, cols] at `first` of rank p's arrays: one block, or (column_block > 0) one block
 * per column_block columns. */
static void compare_matrix(const tolerance *tolerances, tensor_cmp *c, int tensor, int p, int64_t first, int64_t rows,
                           int64_t cols, int64_t column_block, const void *got, int got_f32, const float *init,
                           const void *ref) {
    if (column_block <= 0) {
        compare_block(tolerances, c, tensor, p, first, 1, rows * cols, 0, got, got_f32, init, ref,
                      1 - (tensor <= T_DX), -1.0);
        return;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += column_block)
        compare_block(tolerances, c, tensor, p, first + c0, rows, column_block, cols, got, got_f32, init, ref,
                      1 - (tensor <= T_DX), -1.0);
}

/* layer_compare over the ranks [first, end) of got; ref holds every rank (the d_router_w scale is
 * taken over all of them, so a rank is judged as it is in a comparison of the whole layer). */
static double compare_ranks(const layer *L, const layer_result *got, const layer_result *ref, int first, int end,
                            int64_t column_block, const char *tag) {
    const int P = L->nranks;
    const int64_t H = L->shape.hidden, k = L->shape.topk, El = local_experts(L), per = L->shape.intermediate * H;
    const int64_t I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int has_shared = L->shape.shared_intermediate > 0;
    int has_backward = 0;
    for (int p = first; p < end; ++p) has_backward |= got->dw[0][p] != NULL;
    tolerance tolerances[T_NUM];
    tolerances_of(L, tolerances);
    double worst = 0.0, drw_scale = 0.0; /* d_router_w: max |ref| over every rank */
    double errors[T_NUM];
    int compared = 0; /* tensors compared: errors[0 .. compared) */
    for (int p = 0; has_backward && p < P; ++p)
        for (int64_t s = 0; s < L->num_tokens[p] * k; ++s)
            if (isfinite(ref->d_router_w[p][s]) && fabsf(ref->d_router_w[p][s]) > drw_scale)
                drw_scale = fabsf(ref->d_router_w[p][s]);
    for (int tensor = 0; tensor < T_NUM; ++tensor) {
        if (tensor != T_Y && !has_backward) break;
        if (tensor >= T_DS_GATE && !has_shared) break;
        tensor_cmp c = {0};
        c.worst_index = -1;
        for (int p = first; p < end; ++p) {
            const int64_t T = L->num_tokens[p];
            if (tensor == T_Y && T > 0)
                compare_matrix(tolerances, &c, tensor, p, 0, T, H, column_block, got->y[p], 0, NULL, ref->y[p]);
            if (tensor == T_DX && T > 0)
                compare_matrix(tolerances, &c, tensor, p, 0, T, H, column_block, got->dx[p], 0, NULL, ref->dx[p]);
            if (tensor == T_DRW && T > 0) {
                compare_block(tolerances, &c, tensor, p, 0, 1, T * k, 0, got->d_router_w[p], 1, NULL,
                              ref->d_router_w[p], 1, drw_scale);
                for (int64_t s = 0; s < T * k; ++s)
                    if (L->topk_ids[p][s] < 0 && got->d_router_w[p][s] != 0.0f) ++c.empty_slot;
            }
            if (tensor >= T_DW_GATE && tensor <= T_DW_DOWN) {
                const int m = tensor - T_DW_GATE;
                for (int64_t e = 0; e < El; ++e)
                    compare_matrix(tolerances, &c, tensor, p, e * per, m == LAYER_DOWN ? H : I, m == LAYER_DOWN ? I : H,
                                   column_block, got->dw[m][p], got->grads_f32, got->dw_init[m][p], ref->dw[m][p]);
            }
            if (tensor >= T_DS_GATE) {
                const int m = tensor - T_DS_GATE;
                compare_matrix(tolerances, &c, tensor, p, 0, m == LAYER_DOWN ? H : Is, m == LAYER_DOWN ? Is : H,
                               column_block, got->ds[m][p], got->grads_f32, got->ds_init[m][p], ref->ds[m][p]);
            }
        }
        /* FP8 layers: a weight gradient's single-term flips (judge_flips) are the flips the rows
           above derive, one step of a term that may hold most of the block's largest element (h
           and the gradients are heavy-tailed); with exact block sums (the cpu) only dg's and du's,
           one bf16 ulp each */
        const int grad = tensor >= T_DW_GATE && (tensor <= T_DW_DOWN || tensor >= T_DS_GATE);
        const int judged_tensor = L->tensor_core_sums || (tensor != T_DW_DOWN && tensor != T_DS_DOWN);
        int flips = 0, judged_all = 0;
        if (grad && judged_tensor && c.worst > 1.0 && !c.unwritten && !c.nonfinite &&
            L->shape.precision == MOK_PRECISION_FP8 && column_block <= 0) {
            double judged = 0.0;
            for (int p = first; p < end; ++p)
                for (int64_t el = 0; el < (tensor >= T_DS_GATE ? 1 : El); ++el) {
                    int f = 0;
                    const double e = judge_flips(L, tolerances, tensor, p, el, got, ref, 1, tag, &f);
                    flips += f;
                    if (e > judged) judged = e;
                }
            if (judged <= 1.0)
                fprintf(stderr, "    [%s] %s: error %.3g before %d single-term flips, %.3g after\n", tag,
                        tolerances[tensor].name, c.worst, flips, judged);
            c.worst = judged;
            judged_all = 1;
        }
        double error = c.worst;
        if (c.unwritten || c.nonfinite || c.empty_slot) error = INFINITY;
        if (error > worst) worst = error;
        errors[compared++] = error;
        if (!(error <= 1.0)) {
            char where[160] = "";
            if (c.worst_index >= 0) describe(L, tensor, &c, where, sizeof where);
            fprintf(stderr,
                    "    [%s] %s: error %.3g (max|err| %.3g vs max|ref| %.3g of its block, rtol %g) at %s: got %.8g ref "
                    "%.8g; %lld unwritten, %lld non-finite on one side, %lld empty slots not 0 (layer seed %llu)\n",
                    tag, tolerances[tensor].name, error, c.worst_abs, c.worst_scale, tolerances[tensor].rtol, where,
                    c.got_value, c.ref_value, (long long)c.unwritten, (long long)c.nonfinite, (long long)c.empty_slot,
                    (unsigned long long)L->seed);
            if (tensor == T_Y && c.worst_index >= 0 && isfinite(c.worst_abs)) { /* a wrong row, not a missing one */
                int q;
                int64_t u;
                double e;
                const int64_t t = c.worst_index / H;
                double own = 0.0;
                for (int64_t h = 0; h < H; ++h) {
                    double d = fabs(bf16_at(got->y[c.worst_rank], t * H + h) - bf16_at(ref->y[c.worst_rank], t * H + h));
                    if (!(d <= own)) own = d;
                }
                nearest_row(L, got, ref, c.worst_rank, t, &q, &u, &e);
                fprintf(stderr, "    [%s] y: row of rank %d token %lld: max|diff| %.3g to its own reference row, %.3g to "
                                "the nearest one (rank %d token %lld); equal means a whole row went to the wrong token, "
                                "neither small means some of its slots are wrong (see d_router_w)\n",
                        tag, c.worst_rank, (long long)t, own, e, q, (long long)u);
            }
            if (grad && !judged_all && c.worst_index >= 0 && isfinite(c.worst_abs) && column_block <= 0) {
                int f;
                const int64_t el = tensor >= T_DS_GATE ? 0 : c.worst_index / (L->shape.intermediate * H);
                judge_flips(L, tolerances, tensor, c.worst_rank, el, got, ref, 0, tag, &f);
            }
        }
    }
    if (getenv("MOK_TEST_ERRORS")) { /* every tensor's error, for the tolerances' statistics */
        fprintf(stderr, "    errors [%s]:", tag);
        for (int tensor = 0; tensor < compared; ++tensor)
            fprintf(stderr, " %s %.3f", tolerances[tensor].name, errors[tensor]);
        fprintf(stderr, "\n");
    }
    return worst;
}

double layer_compare(const layer *L, const layer_result *got, const layer_result *ref, const char *tag) {
    return compare_ranks(L, got, ref, 0, L->nranks, 0, tag);
}

double layer_compare_rank(const layer *L, const layer_result *got, const layer_result *ref, int rank,
                          const char *tag) {
    return compare_ranks(L, got, ref, rank, rank + 1, 0, tag);
}

double layer_compare_columns(const layer *L, const layer_result *got, const layer_result *ref, int64_t column_block,
                             const char *tag) {
    return compare_ranks(L, got, ref, 0, L->nranks, column_block, tag);
}

static int bytes_equal(const void *a, const void *b, size_t bytes, int64_t elem, int64_t *index) {
    if (!a || !b) return a == b;
    if (memcmp(a, b, bytes) == 0) return 1;
    const char *x = a, *y = b;
    for (size_t i = 0; i < bytes; ++i)
        if (x[i] != y[i]) {
            *index = (int64_t)i / elem;
            break;
        }
    return 0;
}

int layer_equal(const layer *L, const layer_result *a, const layer_result *b, char *what, size_t what_size) {
    const int64_t H = L->shape.hidden, k = L->shape.topk;
    const size_t ge = a->grads_f32 ? 4 : 2;
    static const char *names[3] = {"gate", "up", "down"};
    int64_t i = -1;
    if (a->grads_f32 != b->grads_f32) {
        snprintf(what, what_size, "gradient types differ");
        return 0;
    }
    for (int p = 0; p < L->nranks; ++p) {
        const int64_t T = L->num_tokens[p];
        if (!bytes_equal(a->y[p], b->y[p], (size_t)(T * H) * 2, 2, &i)) {
            snprintf(what, what_size, "y of rank %d differs at token %lld col %lld", p, (long long)(i / H),
                     (long long)(i % H));
            return 0;
        }
        if (!bytes_equal(a->dx[p], b->dx[p], (size_t)(T * H) * 2, 2, &i)) {
            snprintf(what, what_size, "dx of rank %d differs at token %lld col %lld", p, (long long)(i / H),
                     (long long)(i % H));
            return 0;
        }
        if (!bytes_equal(a->d_router_w[p], b->d_router_w[p], (size_t)(T * k) * 4, 4, &i)) {
            snprintf(what, what_size, "d_router_w of rank %d differs at token %lld slot %lld", p, (long long)(i / k),
                     (long long)(i % k));
            return 0;
        }
        for (int m = 0; m < 3; ++m) {
            if (!bytes_equal(a->dw[m][p], b->dw[m][p], (size_t)expert_elems(L) * ge, (int64_t)ge, &i)) {
                snprintf(what, what_size, "dw_%s of rank %d differs at element %lld (local expert %lld)", names[m], p,
                         (long long)i, (long long)(i / (L->shape.intermediate * H)));
                return 0;
            }
            if (!bytes_equal(a->ds[m][p], b->ds[m][p], (size_t)shared_elems(L) * ge, (int64_t)ge, &i)) {
                snprintf(what, what_size, "ds_%s of rank %d differs at element %lld", names[m], p, (long long)i);
                return 0;
            }
        }
    }
    return 1;
}
