/* gpu_layer.c — a layer's buffers on the GPUs for the cuda tests (gpu_layer.h). */
#include "gpu_layer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "matrix.h"

mok_config gpu_layer_config(const layer *L, const mok_config *config) {
    mok_config cfg = config ? *config : mok_config_default();
    cfg.swiglu_limit = L->swiglu_limit;
    const char *timeout = getenv("MOK_TEST_PEER_TIMEOUT_MS");
    if (timeout) cfg.peer_timeout_ms = atoi(timeout);
    return cfg;
}

mok_status gpu_layer_create(gpu_layer *G, const layer *L, const mok_config *config) {
    memset(G, 0, sizeof *G);
    G->nranks = L->nranks;
    const mok_config cfg = gpu_layer_config(L, config);
    int devices[MOK_MAX_RANKS];
    for (int p = 0; p < L->nranks; ++p) devices[p] = p;
    mok_status st =
        gpu_layer_note(G, mok_group_create_local(&G->group, MOK_BACKEND_CUDA, L->nranks, devices, &cfg), "group");
    if (st == MOK_OK) st = gpu_layer_note(G, mok_workspace_create(&G->ws, G->group, &L->shape, &cfg), "workspace");
    if (st == MOK_OK) st = gpu_layer_note(G, mok_workspace_sizes(G->ws, &G->sizes), "sizes");
    return st;
}

void gpu_layer_upload_rank(gpu_layer *G, const layer *L, int p, size_t pad, mok_status *st) {
    const size_t H = (size_t)L->shape.hidden, I = (size_t)L->shape.intermediate, k = (size_t)L->shape.topk;
    const size_t Is = (size_t)L->shape.shared_intermediate, El = (size_t)(L->shape.num_experts / L->nranks);
    const size_t T = (size_t)L->shape.max_tokens, t = (size_t)L->num_tokens[p];
    G->x[p] = gpu_layer_upload(G, p, L->x[p], t * H * 2 + pad, st);
    G->ids[p] = gpu_layer_upload(G, p, L->topk_ids[p], t * k * 4 + pad, st);
    G->rw[p] = gpu_layer_upload(G, p, L->router_w[p], t * k * 4 + pad, st);
    for (int m = 0; m < 3; ++m) G->w[m][p] = gpu_layer_upload(G, p, L->w[m][p], El * I * H * 2, st);
    for (int m = 0; m < 3 && Is; ++m) G->s[m][p] = gpu_layer_upload(G, p, L->s[m], Is * H * 2, st);
    G->y[p] = gpu_layer_upload(G, p, NULL, T * H * 2, st);
    G->schedule[p] = gpu_layer_upload(G, p, NULL, G->sizes.schedule_bytes, st);
    G->context[p] = gpu_layer_upload(G, p, NULL, G->sizes.context_bytes, st);
}

void gpu_layer_close(gpu_layer *G) {
    for (int p = 0; p < G->nranks && G->group; ++p) {
        void **all[] = {&G->x[p], &G->ids[p], &G->rw[p], &G->w[0][p], &G->w[1][p], &G->w[2][p], &G->s[0][p],
                        &G->s[1][p], &G->s[2][p], &G->y[p], &G->schedule[p], &G->context[p]};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) mok_memory_free(G->group, p, *all[i]);
    }
    mok_workspace_destroy(G->ws);
    mok_group_destroy(G->group);
    memset(G, 0, sizeof *G);
}

mok_status gpu_layer_note(gpu_layer *G, mok_status st, const char *what) {
    if (st != MOK_OK && !G->message[0]) snprintf(G->message, sizeof G->message, "%s: %s", what, mok_last_error());
    return st;
}

void *gpu_layer_upload(gpu_layer *G, int p, const void *host, size_t bytes, mok_status *st) {
    void *d = NULL;
    if (*st != MOK_OK) return NULL;
    *st = mok_memory_alloc(G->group, p, bytes ? bytes : 16, &d);
    if (*st == MOK_OK && host && bytes) *st = mok_memory_copy(G->group, p, d, host, bytes, MOK_COPY_HOST_TO_RANK);
    return d;
}

mok_status gpu_layer_fill(gpu_layer *G, int p, void *dev, size_t bytes, int value) {
    void *host = malloc(bytes ? bytes : 1);
    if (!host) return MOK_ERR_OUT_OF_MEMORY;
    memset(host, value, bytes);
    mok_status st = mok_memory_copy(G->group, p, dev, host, bytes, MOK_COPY_HOST_TO_RANK);
    free(host);
    return st;
}

void *gpu_layer_download(gpu_layer *G, int p, const void *dev, size_t bytes) {
    void *host = malloc(bytes ? bytes : 16);
    if (host && bytes) mok_memory_copy(G->group, p, host, dev, bytes, MOK_COPY_RANK_TO_HOST);
    return host;
}

void gpu_layer_download_y(gpu_layer *G, const layer *L, layer_result *out) {
    out->nranks = L->nranks;
    for (int p = 0; p < L->nranks; ++p)
        out->y[p] = gpu_layer_download(G, p, G->y[p], (size_t)L->num_tokens[p] * (size_t)L->shape.hidden * 2);
}

mok_status gpu_layer_build(gpu_layer *G, const layer *L, void *stream) {
    mok_schedule_args sa[MOK_MAX_RANKS];
    for (int p = 0; p < L->nranks; ++p)
        sa[p] = (mok_schedule_args){L->num_tokens[p], G->ids[p], G->schedule[p], stream};
    return mok_schedule_build(G->ws, sa);
}

void gpu_layer_forward_args(const gpu_layer *G, const layer *L, void *stream, void *const *fp8_weights,
                            mok_forward_args *fa) {
    for (int p = 0; p < L->nranks; ++p)
        fa[p] = (mok_forward_args){L->num_tokens[p], G->schedule[p], G->x[p], G->rw[p], G->w[0][p], G->w[1][p],
                                   G->w[2][p], G->s[0][p], G->s[1][p], G->s[2][p], G->y[p], G->context[p], stream,
                                   fp8_weights ? fp8_weights[p] : NULL};
}

mok_status gpu_layer_backward(gpu_layer *G, const layer *L, int accumulate, void *const *fp8_weights,
                              layer_result *out) {
    const size_t H = (size_t)L->shape.hidden, I = (size_t)L->shape.intermediate, k = (size_t)L->shape.topk;
    const size_t Is = (size_t)L->shape.shared_intermediate, El = (size_t)(L->shape.num_experts / L->nranks);
    const size_t ge = accumulate ? 4 : 2;
    const size_t wn[3] = {El * I * H, El * I * H, El * H * I}, sn = Is * H;
    mok_backward_args ba[MOK_MAX_RANKS];
    void *dev[MOK_MAX_RANKS][9];
    mok_status st = MOK_OK;
    out->nranks = L->nranks;
    out->grads_f32 = accumulate;
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)accumulate;
    for (int p = 0; p < L->nranks; ++p) {
        const size_t T = (size_t)L->num_tokens[p];
        memset(dev[p], 0, sizeof dev[p]);
        dev[p][0] = gpu_layer_upload(G, p, L->dy[p], T * H * 2 + 16, &st); /* dy */
        dev[p][1] = gpu_layer_upload(G, p, NULL, T * H * 2 + 16, &st);     /* dx */
        dev[p][2] = gpu_layer_upload(G, p, NULL, T * k * 4 + 16, &st);     /* d_router_w */
        for (int m = 0; m < 3; ++m) {
            void *init = NULL;
            if (accumulate) {
                float *f = malloc(wn[m] * 4);
                for (size_t i = 0; i < wn[m]; ++i) {
                    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                    f[i] = (float)((double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0);
                }
                out->dw_init[m][p] = f;
                init = f;
            }
            dev[p][3 + m] = gpu_layer_upload(G, p, init, wn[m] * ge, &st);
            if (Is) {
                void *sinit = NULL;
                if (accumulate) {
                    float *f = malloc(sn * 4);
                    for (size_t i = 0; i < sn; ++i) f[i] = 0.25f * (float)((i * 2654435761u) % 1000) / 1000.0f;
                    out->ds_init[m][p] = f;
                    sinit = f;
                }
                dev[p][6 + m] = gpu_layer_upload(G, p, sinit, sn * ge, &st);
            }
        }
        ba[p] = (mok_backward_args){(int64_t)T, G->schedule[p], G->context[p], dev[p][0], G->x[p], G->rw[p],
                                    G->w[0][p], G->w[1][p], G->w[2][p], G->s[0][p], G->s[1][p], G->s[2][p],
                                    dev[p][1], dev[p][2], accumulate, dev[p][3], dev[p][4], dev[p][5],
                                    dev[p][6], dev[p][7], dev[p][8], NULL, fp8_weights ? fp8_weights[p] : NULL};
    }
    if (st == MOK_OK) st = mok_backward(G->ws, ba);
    if (st == MOK_OK) st = mok_synchronize(G->ws);
    if (st != MOK_OK) snprintf(G->message, sizeof G->message, "%s", mok_last_error());
    for (int p = 0; p < L->nranks; ++p) {
        const size_t T = (size_t)L->num_tokens[p];
        if (st == MOK_OK) {
            out->dx[p] = malloc(T * H * 2 + 16);
            out->d_router_w[p] = malloc(T * k * 4 + 16);
            mok_memory_copy(G->group, p, out->dx[p], dev[p][1], T * H * 2, MOK_COPY_RANK_TO_HOST);
            mok_memory_copy(G->group, p, out->d_router_w[p], dev[p][2], T * k * 4, MOK_COPY_RANK_TO_HOST);
            for (int m = 0; m < 3; ++m) {
                out->dw[m][p] = malloc(wn[m] * ge);
                mok_memory_copy(G->group, p, out->dw[m][p], dev[p][3 + m], wn[m] * ge, MOK_COPY_RANK_TO_HOST);
                if (Is) {
                    out->ds[m][p] = malloc(sn * ge);
                    mok_memory_copy(G->group, p, out->ds[m][p], dev[p][6 + m], sn * ge, MOK_COPY_RANK_TO_HOST);
                }
            }
        }
        for (int i = 0; i < 9; ++i) mok_memory_free(G->group, p, dev[p][i]);
    }
    return st;
}

/* ---- FP8 ---------------------------------------------------------------------------------- */

mok_status gpu_fp8_open(gpu_fp8 *G, const layer *L, const mok_config *config) {
    memset(G, 0, sizeof *G);
    gpu_layer *g = &G->gpu;
    mok_status st = gpu_layer_create(g, L, config);
    if (st == MOK_OK) st = gpu_layer_note(g, mok_workspace_fp8_layout(g->ws, &G->layout), "fp8 layout");
    mok_quantize_args q[MOK_MAX_RANKS];
    for (int p = 0; p < L->nranks && st == MOK_OK; ++p) {
        gpu_layer_upload_rank(g, L, p, 0, &st);
        G->fp8[p] = gpu_layer_upload(g, p, NULL, G->layout.bytes, &st);
        if (st == MOK_OK) st = gpu_layer_fill(g, p, G->fp8[p], G->layout.bytes, 0xa5);
        if (st == MOK_OK) st = gpu_layer_fill(g, p, g->context[p], g->sizes.context_bytes, 0xff);
        q[p] = (mok_quantize_args){g->w[0][p], g->w[1][p], g->w[2][p], g->s[0][p],
                                   g->s[1][p], g->s[2][p], G->fp8[p], NULL};
    }
    gpu_layer_note(g, st, "device buffers");
    if (st == MOK_OK) st = gpu_layer_note(g, mok_quantize_weights(g->ws, q), "mok_quantize_weights");
    if (st == MOK_OK) st = gpu_layer_note(g, mok_synchronize(g->ws), "mok_synchronize after mok_quantize_weights");
    return st;
}

void gpu_fp8_close(gpu_fp8 *G) {
    for (int p = 0; p < G->gpu.nranks && G->gpu.group; ++p) mok_memory_free(G->gpu.group, p, G->fp8[p]);
    gpu_layer_close(&G->gpu);
    memset(G, 0, sizeof *G);
}

mok_status gpu_fp8_forward(gpu_fp8 *G, const layer *L, int recompute) {
    gpu_layer *g = &G->gpu;
    mok_status st = MOK_OK;
    for (int p = 0; p < L->nranks && st == MOK_OK; ++p)
        st = gpu_layer_fill(g, p, g->y[p], (size_t)L->shape.max_tokens * (size_t)L->shape.hidden * 2, 0xff);
    if (st == MOK_OK) st = gpu_layer_note(g, gpu_layer_build(g, L, NULL), "mok_schedule_build");
    mok_forward_args fa[MOK_MAX_RANKS];
    gpu_layer_forward_args(g, L, NULL, G->fp8, fa);
    if (st == MOK_OK)
        st = gpu_layer_note(g, recompute ? mok_recompute_context(g->ws, fa) : mok_forward(g->ws, fa),
                            recompute ? "mok_recompute_context" : "mok_forward");
    if (st == MOK_OK) st = gpu_layer_note(g, mok_synchronize(g->ws), "mok_synchronize");
    return st;
}

static uint16_t scaled(uint16_t v, int e) { return mok_bf16_from_float((float)ldexp(mok_bf16_to_float(v), e)); }

/* ---- exact layers: no element at a tie of its bf16 rounding that E4M3 would see ----------------
 * An exact layer's g, u and dh = w · (dy^ · W^_down) are the same bits on every backend, but h, dg
 * and du come through the sigmoid, which the backends evaluate in fp32 and the reference in fp64.
 * Exact values make ties of their bf16 rounding common: where the sigmoid saturates in fp32
 * (g > 16.6), h = g · u exactly there, a product of short mantissas, and a bf16 midpoint often;
 * the fp64 value sits just inside it and rounds the other way. When the two bf16 neighbours then
 * quantize to different E4M3 values (or the block's scale changes), the element moves by an E4M3
 * step, 2^-3 of it, which the cpu's rows rightly call an error where it dominates a sum. So token
 * rows whose h, dg or du has such an element are redrawn. */

#define TIE_WINDOW 0x1.0p-18 /* relative distance to a bf16 midpoint an fp32 evaluation may cross */

/* The bf16 value nearest to v (one step from fp64, ties to even) in *near, and in *other the
 * neighbour on the midpoint's other side when v lies within TIE_WINDOW of a midpoint (else *near). */
static void bf16_candidates(double v, double *near, double *other) {
    *near = *other = v;
    if (v == 0.0 || !isfinite(v)) return;
    int exponent;
    frexp(fabs(v), &exponent);
    const int spacing = exponent - 8 < -133 ? -133 : exponent - 8;
    const double m = ldexp(fabs(v), -spacing), below = floor(m);
    *near = *other = copysign(ldexp(rint(m), spacing), v);
    const double off = fabs(m - below - 0.5);
    if (off > 0.0 && off < m * TIE_WINDOW)
        *other = copysign(ldexp(rint(m) == below ? below + 1.0 : below, spacing), v);
}

static int fp8_exponent(double amax) {
    if (amax == 0.0) return 0;
    int e = -124;
    while (amax > ldexp(448.0, e)) ++e;
    return e;
}

static double e4m3_at(double v, int e) { return mok_e4m3_to_float(mok_e4m3_from_float((float)ldexp(v, -e))); }

/* Whether one 1 x 128 block of values before their bf16 rounding can quantize two ways. */
static int block_can_flip(const double *v) {
    double near[MOK_FP8_BLOCK], other[MOK_FP8_BLOCK], amax = 0.0, amax_lo = 0.0, amax_hi = 0.0;
    for (int i = 0; i < MOK_FP8_BLOCK; ++i) {
        bf16_candidates(v[i], &near[i], &other[i]);
        const double a = fabs(near[i]), b = fabs(other[i]);
        amax = fmax(amax, a);
        amax_lo = fmax(amax_lo, fmin(a, b));
        amax_hi = fmax(amax_hi, fmax(a, b));
    }
    const int e = fp8_exponent(amax);
    if (fp8_exponent(amax_lo) != e || fp8_exponent(amax_hi) != e) return 1;
    for (int i = 0; i < MOK_FP8_BLOCK; ++i)
        if (near[i] != other[i] && e4m3_at(near[i], e) != e4m3_at(other[i], e)) return 1;
    return 0;
}

static double bf16_value(uint16_t v) { return mok_bf16_to_float(v); }

/* Whether token row x [H] through one expert (gate, up [inter, H], down [H, inter], router weight w;
 * dy [H] or NULL) has an h, dg or du block that can quantize two ways. Exact layers: every operand
 * is its own quantization, and the sums below are exact in fp64. scratch: 3 inter doubles. */
static int expert_can_flip(const double *x, const double *dy, double w, const uint16_t *gate, const uint16_t *up,
                           const uint16_t *down, int64_t inter, int64_t H, double limit, double *scratch) {
    double *h = scratch, *dg = scratch + inter, *du = scratch + 2 * inter, other;
    for (int64_t i = 0; i < inter; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < H; ++c) {
            g += bf16_value(gate[i * H + c]) * x[c];
            u += bf16_value(up[i * H + c]) * x[c];
        }
        bf16_candidates(g, &g, &other);
        bf16_candidates(u, &u, &other);
        const double gc = limit > 0.0 && g > limit ? limit : g;
        const double uc = limit > 0.0 ? fmin(fmax(u, -limit), limit) : u;
        const double s = 1.0 / (1.0 + exp(-gc));
        h[i] = gc * s * uc;
        if (!dy) continue;
        double dh = 0.0;
        for (int64_t o = 0; o < H; ++o) dh += bf16_value(down[o * inter + i]) * dy[o];
        dh *= w;
        dg[i] = limit > 0.0 && g > limit ? 0.0 : dh * uc * s * (1.0 + gc * (1.0 - s));
        du[i] = limit > 0.0 && fabs(u) > limit ? 0.0 : dh * gc * s;
    }
    for (int64_t b = 0; b < inter; b += MOK_FP8_BLOCK)
        if (block_can_flip(h + b) || (dy && (block_can_flip(dg + b) || block_can_flip(du + b)))) return 1;
    return 0;
}

/* Redraws (with exact values, exponents from xlo on) every token row of an exact layer that has an
 * element expert_can_flip finds, up to 64 times a row. Returns how many rows were left so. */
static int64_t avoid_fp8_flips(layer *L, int xlo, int xspan, uint64_t seed) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / L->nranks, k = L->shape.topk, B = MOK_FP8_BLOCK;
    const int64_t wide = Is > I ? Is : I;
    double *x = malloc((size_t)(2 * H + 3 * wide) * sizeof(double));
    if (!x) return -1;
    double *dy = x + H, *scratch = dy + H;
    int64_t left = 0;
    uint64_t rng = seed ^ 0x7469657300000000ull;
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t t = 0; t < L->num_tokens[p]; ++t) {
            uint16_t *row = L->x[p] + t * H;
            int flips = 1;
            for (int attempt = 0; attempt < 64 && flips; ++attempt) {
                if (attempt > 0)
                    for (int64_t b = 0; b < H / B; ++b) {
                        const int e = xlo + (int)(matrix_pick(&rng) % (uint64_t)xspan);
                        for (int64_t c = b * B; c < b * B + B; ++c)
                            row[c] = mok_bf16_from_float((float)ldexp(
                                (matrix_pick(&rng) & 1 ? -1.0 : 1.0) * (matrix_pick(&rng) & 1 ? 1.0 : 0.5), e));
                    }
                for (int64_t c = 0; c < H; ++c) {
                    x[c] = bf16_value(row[c]);
                    if (L->dy[p]) dy[c] = bf16_value(L->dy[p][t * H + c]);
                }
                const double *dyt = L->dy[p] ? dy : NULL;
                flips = Is && expert_can_flip(x, dyt, 1.0, L->s[LAYER_GATE], L->s[LAYER_UP], L->s[LAYER_DOWN], Is, H,
                                              L->swiglu_limit, scratch);
                for (int64_t j = 0; j < k && !flips; ++j) {
                    const int32_t e = L->topk_ids[p][t * k + j];
                    if (e < 0) continue;
                    const int64_t off = (e % El) * I * H;
                    flips = expert_can_flip(x, dyt, L->router_w[p][t * k + j], L->w[LAYER_GATE][e / El] + off,
                                            L->w[LAYER_UP][e / El] + off, L->w[LAYER_DOWN][e / El] + off, I, H,
                                            L->swiglu_limit, scratch);
                }
            }
            left += flips;
        }
    free(x);
    return left;
}

int64_t gpu_fp8_reshape(layer *L, int mode, uint64_t seed) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / L->nranks, B = MOK_FP8_BLOCK;
    uint64_t rng = seed;
    const int xlo = mode == GPU_FP8_EXACT ? -6 : -20, xspan = mode == GPU_FP8_EXACT ? 13 : 25;
    const int wlo = mode == GPU_FP8_EXACT ? -6 : -12, wspan = mode == GPU_FP8_EXACT ? 13 : 17;
#define VALUE(v, e) (mode == GPU_FP8_EXACT ? mok_bf16_from_float((float)ldexp((matrix_pick(&rng) & 1 ? -1.0 : 1.0) * \
                                                                           (matrix_pick(&rng) & 1 ? 1.0 : 0.5), (e))) \
                                        : scaled((v), (e)))
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t t = 0; t < L->num_tokens[p]; ++t)
            for (int64_t b = 0; b < H / B; ++b) {
                const int e = xlo + (int)(matrix_pick(&rng) % (uint64_t)xspan);
                for (int64_t c = b * B; c < b * B + B; ++c) L->x[p][t * H + c] = VALUE(L->x[p][t * H + c], e);
            }
    for (int p = 0; p < L->nranks && L->dy[p]; ++p) /* dy likewise (the backward's dy^) */
        for (int64_t t = 0; t < L->num_tokens[p]; ++t)
            for (int64_t b = 0; b < H / B; ++b) {
                const int e = xlo + (int)(matrix_pick(&rng) % (uint64_t)xspan);
                for (int64_t c = b * B; c < b * B + B; ++c) L->dy[p][t * H + c] = VALUE(L->dy[p][t * H + c], e);
            }
    /* every weight matrix [rows, cols] (count of them), block by block */
    uint16_t *mats[3 * MOK_MAX_RANKS + 3];
    int64_t rows[3 * MOK_MAX_RANKS + 3], cols[3 * MOK_MAX_RANKS + 3], count[3 * MOK_MAX_RANKS + 3];
    int n = 0;
    for (int p = 0; p < L->nranks; ++p)
        for (int m = 0; m < 3; ++m, ++n) {
            mats[n] = L->w[m][p];
            rows[n] = m == LAYER_DOWN ? H : I;
            cols[n] = m == LAYER_DOWN ? I : H;
            count[n] = El;
        }
    for (int m = 0; m < 3 && Is; ++m, ++n) {
        mats[n] = L->s[m];
        rows[n] = m == LAYER_DOWN ? H : Is;
        cols[n] = m == LAYER_DOWN ? Is : H;
        count[n] = 1;
    }
    for (int i = 0; i < n; ++i)
        for (int64_t e = 0; e < count[i]; ++e)
            for (int64_t br = 0; br < rows[i] / B; ++br)
                for (int64_t bc = 0; bc < cols[i] / B; ++bc) {
                    const int x = wlo + (int)(matrix_pick(&rng) % (uint64_t)wspan);
                    for (int64_t r = br * B; r < br * B + B; ++r)
                        for (int64_t c = bc * B; c < bc * B + B; ++c) {
                            uint16_t *v = mats[i] + (e * rows[i] + r) * cols[i] + c;
                            *v = VALUE(*v, x);
                        }
                }
#undef VALUE
    return mode == GPU_FP8_EXACT ? avoid_fp8_flips(L, xlo, xspan, seed) : 0;
}

int gpu_fp8_layer(layer *L, const mok_shape *shape, int P, const int64_t *tokens, uint64_t seed, int routing,
                  float limit, int mode) {
    if (layer_make(L, shape, P, tokens, seed, routing) != 0) {
        layer_free(L);
        return -1;
    }
    L->swiglu_limit = limit;
    return mode && gpu_fp8_reshape(L, mode, L->seed ^ 0x5eedull) != 0 ? 1 : 0;
}

mok_config gpu_variant_config(const gpu_variant *v, int backward) {
    mok_config c = mok_config_default();
    if (v->comm) *(backward ? &c.bwd_comm_sms : &c.fwd_comm_sms) = v->comm;
    if (v->minibatch) c.minibatch_rows = v->minibatch;
    if (v->ring) c.ring_rows = v->ring;
    if (v->turned && backward) {
        c.bwd_combine = MOK_PUSH;
        c.bwd_dispatch = MOK_PULL;
    } else if (v->turned) {
        c.fwd_dispatch = MOK_PUSH;
        c.fwd_combine = MOK_PULL;
    }
    return c;
}

/* Sets name to value (non-NULL), or puts back what slot's last set found (NULL). */
static void env_swap(int slot, const char *name, const char *value) {
    static char saved[3][64];
    static int had[3];
    if (value) {
        const char *now = getenv(name);
        had[slot] = now != NULL;
        if (had[slot]) snprintf(saved[slot], sizeof saved[slot], "%s", now);
        setenv(name, value, 1);
    } else if (had[slot]) {
        setenv(name, saved[slot], 1);
    } else {
        unsetenv(name);
    }
}

void gpu_variant_env(const gpu_variant *v, int on) {
    char cols[16];
    snprintf(cols, sizeof cols, "%d", v->cols_dh);
    if (v->no_tma) env_swap(0, "MOK_CUDA_TMA", on ? "0" : NULL);
    if (v->cols_dh) env_swap(1, "MOK_CUDA_COLS_DH", on ? cols : NULL);
    if (v->staged_rows) env_swap(2, "MOK_CUDA_DIRECT_ROWS", on ? "0" : NULL);
}
