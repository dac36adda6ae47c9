/* test_cuda_fp8.c — the cuda backend's FP8 forward (include/mok.h, FP8 section) against the cpu
 * backend's FP8 forward and the FP8 reference: mok_quantize_weights on the device writes the cpu's
 * bytes; y on the adversarial routings (one expert, empty experts, -1 slots, router weights <= 0,
 * uneven and zero tokens, several macrobatches, the clamp, no shared expert); layers whose
 * gate|up sums the tensor cores add exactly, where the context's g and u must equal the cpu's bit
 * for bit (so the quantized x, its dispatch, the weights' scales and the per-128-K promotion are
 * checked exactly); blocks spanning many binades; bitwise determinism across runs, comm CTAs,
 * minibatch and ring sizes, turned transfers and the cp.async path; the memory rule; and the
 * refusals (fp8_weights missing, or not written for the workspace). The backward:
 * test_cuda_fp8_backward.c.
 *
 * Tolerances: layer.c's rows for tensor-core block sums (layer.tensor_core_sums). The contract
 * leaves the sum of a 128-K block's exact products to the backend (mok.h: the tensor cores'
 * accumulator keeps fewer bits than fp32, whence the blocks): dev/fp8_tile_probe.cu measured the
 * H200's block sums within 0.18 of 4 · 34 / 8192 of sum |terms| (a few units of 2^-13). That moves
 * g, u by about a bf16 ulp, and through h's bf16 rounding flips a few percent of h^'s elements by
 * one E4M3 step (2^-3 of it), more than the cpu's fp32 sums ever do; layer.c derives the y row
 * from that. The exact layers take the tensor cores' rounding out: there g and u are compared bit
 * for bit. Every case prints its y errors (1 = the tolerance), passing or not.
 *
 * Every test skips without a GPU. Seeds derive from MOK_TEST_SEED and the case's name. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_layer.h"
#include "layer.h"
#include "matrix.h"
#include "test.h"

static int skip(const char *name) {
    if (mok_backend_available(MOK_BACKEND_CUDA) >= 1) return 0;
    mok_test_skip("%s needs a GPU (and a build with the cuda backend)", name);
    return 1;
}

static uint64_t case_seed(const char *name) { return matrix_case_seed(name, 0xc0da8f8ull); }

static mok_shape fp8_shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is) {
    mok_shape s = {H, I, E, k, Is, 1, MOK_PRECISION_FP8};
    return s;
}

/* The parts of a context that a forward writes past its tag: the routed rows up to the schedule's
 * padded rows (at most the context rows) and the shared rows of the T tokens (include/mok.h's
 * mok_forward_args.context). Returns 0 when a and b hold the same bytes there, else the byte
 * offset + 1 of the first difference. */
static size_t context_diff(const layer *L, const mok_sizes *sizes, int64_t padded_rows, int p, const uint8_t *a,
                           const uint8_t *b) {
    const size_t I = (size_t)L->shape.intermediate, Is = (size_t)L->shape.shared_intermediate;
    const size_t ctx_rows = (size_t)sizes->max_routed_rows; /* config.context_rows = 0: all of them */
    const size_t rows = (size_t)padded_rows < ctx_rows ? (size_t)padded_rows : ctx_rows;
    const size_t routed = MOK_CONTEXT_TAG_BYTES, shared = (routed + ctx_rows * 4 * I + 255) / 256 * 256;
    const size_t parts[2][2] = {{routed, rows * 4 * I}, {shared, (size_t)L->num_tokens[p] * 4 * Is}};
    for (int i = 0; i < 2; ++i)
        for (size_t j = 0; j < parts[i][1]; ++j)
            if (a[parts[i][0] + j] != b[parts[i][0] + j]) return parts[i][0] + j + 1;
    return 0;
}

/* ---- the cases ----------------------------------------------------------------------------- */

enum { CASE_PLAIN = 0, CASE_EXACT = GPU_FP8_EXACT, CASE_SPREAD = GPU_FP8_SPREAD, CASE_NONFINITE };

/* Non-finite layers: in every seventh token one x value is +Inf, -Inf or NaN (in turn). mok.h: it
 * becomes the E4M3 NaN and leaves its block's scale as it would be without it, so the token's y
 * is NaN on every side (layer_compare: non-finite on both sides is fine, on one side an error)
 * and every other token's y is untouched. */
static void poison_tokens(layer *L) {
    const uint16_t bad[3] = {0x7f80, 0xff80, 0x7fc0};
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t t = 3; t < L->num_tokens[p]; t += 7)
            L->x[p][t * L->shape.hidden + (t * 37) % L->shape.hidden] = bad[(t / 7) % 3];
}

/* One layer: the cpu's FP8 forward and the reference, then the GPU's: its FP8 weights against the
 * cpu's (bitwise), y against both (layer.c's FP8 table; spread layers per 128-column block at its
 * own scale), and for exact layers the contexts' g and u bitwise. */
static void check_case(const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                       float limit, const mok_config *gpu_cfg, int mode) {
    if (mok_backend_available(MOK_BACKEND_CUDA) < P) {
        printf("    (%s: skipped, needs %d GPUs)\n", name, P);
        return;
    }
    layer L;
    const int made = gpu_fp8_layer(&L, shape, P, tokens, case_seed(name), routing, limit,
                                   mode == CASE_EXACT || mode == CASE_SPREAD ? mode : 0);
    CHECK(made == 0, "%s: %s", name, made < 0 ? "layer_make failed" : "exact rows left at a tie");
    if (made < 0) return;
    L.tensor_core_sums = 1;
    if (mode == CASE_NONFINITE) poison_tokens(&L);
    if (limit > 0.0f) layer_avoid_clamp_flips(&L);
    char tag[256];
    snprintf(tag, sizeof tag, "%s (MOK_TEST_SEED=%llu)", name, mok_test_seed());

    layer_backend B;
    layer_result cpu = {0}, ref = {0}, got = {0};
    const mok_config cc = matrix_config();
    mok_status st = layer_backend_open(&B, &L, &cc);
    CHECK(st == MOK_OK, "%s: cpu open: %s", tag, B.message);
    if (st == MOK_OK) {
        st = layer_backend_forward(&B, &L, &cpu);
        CHECK(st == MOK_OK, "%s: cpu forward: %s", tag, cpu.message);
    }
    if (st == MOK_OK) {
        st = layer_run_reference_forward(&L, &ref);
        CHECK(st == MOK_OK, "%s: reference: %s", tag, ref.message);
    }
    gpu_fp8 G;
    memset(&G, 0, sizeof G);
    gpu_layer *g = &G.gpu;
    if (st == MOK_OK) {
        st = gpu_fp8_open(&G, &L, gpu_cfg);
        CHECK(st == MOK_OK, "%s: gpu open: %s", tag, g->message);
    }
    if (st == MOK_OK) {
        CHECK(G.layout.bytes == cpu.fp8_bytes, "%s: FP8 layouts differ: %zu vs %zu bytes", tag, G.layout.bytes,
              cpu.fp8_bytes);
        for (int p = 0; p < P && G.layout.bytes == cpu.fp8_bytes; ++p) {
            uint8_t *w = gpu_layer_download(g, p, G.fp8[p], G.layout.bytes);
            size_t first = 0;
            while (first < G.layout.bytes && w[first] == ((const uint8_t *)cpu.fp8_weights[p])[first]) ++first;
            CHECK(first == G.layout.bytes, "%s: rank %d: mok_quantize_weights on the GPU differs from the cpu's at byte %zu",
                  tag, p, first);
            free(w);
        }
        st = gpu_fp8_forward(&G, &L, 0);
        CHECK(st == MOK_OK, "%s: gpu forward: %s", tag, g->message);
    }
    if (st == MOK_OK) {
        gpu_layer_download_y(g, &L, &got);
        layer_result cpu_y = {0};
        cpu_y.nranks = P;
        for (int p = 0; p < P; ++p) cpu_y.y[p] = cpu.y[p];
        char sub[300];
        snprintf(sub, sizeof sub, "%s vs reference", tag);
        const double e1 = mode == CASE_SPREAD ? layer_compare_columns(&L, &got, &ref, MOK_FP8_BLOCK, sub)
                                              : layer_compare(&L, &got, &ref, sub);
        CHECK(e1 <= 1.0, "%s: cuda FP8 y vs the FP8 reference: error %.3g > 1", tag, e1);
        snprintf(sub, sizeof sub, "%s vs cpu", tag);
        const double e2 = mode == CASE_SPREAD ? layer_compare_columns(&L, &got, &cpu_y, MOK_FP8_BLOCK, sub)
                                              : layer_compare(&L, &got, &cpu_y, sub);
        CHECK(e2 <= 1.0, "%s: cuda FP8 y vs the cpu's: error %.3g > 1", tag, e2);
        printf("    %s: y error %.3f vs the reference, %.3f vs the cpu\n", name, e1, e2);
        for (int p = 0; p < P; ++p) cpu_y.y[p] = NULL;
        if (mode == CASE_EXACT)
            for (int p = 0; p < P; ++p) {
                uint8_t *ctx = gpu_layer_download(g, p, g->context[p], g->sizes.context_bytes);
                const size_t at =
                    context_diff(&L, &g->sizes, cpu.info[p].padded_rows, p, ctx, (const uint8_t *)cpu.context[p]);
                CHECK(at == 0, "%s: rank %d: the context's g|u differ from the cpu's at byte %zu", tag, p, at - 1);
                free(ctx);
            }
    }
    gpu_fp8_close(&G);
    layer_result_free(&got);
    layer_result_free(&ref);
    layer_result_free(&cpu);
    layer_backend_close(&B);
    layer_free(&L);
}

MOK_TEST(cuda_fp8_forward_routings) {
    if (skip("cuda_fp8_forward_routings")) return;
    const int64_t t1[1] = {300}, one[1] = {1}, zero[1] = {0};
    const mok_shape a = fp8_shape(256, 128, 8, 2, 128);
    check_case("fp8 ep1 uniform", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 skewed", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 one expert", &a, 1, t1, LAYER_ROUTE_ONE_EXPERT, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 empty experts", &a, 1, t1, LAYER_ROUTE_EVEN, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 -1 slots, weights <= 0", &a, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, NULL,
               CASE_PLAIN);
    check_case("fp8 ep1 encoded rows", &a, 1, t1, LAYER_ROUTE_UNIFORM | LAYER_ENCODED, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 clamp", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.5f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 one token", &a, 1, one, LAYER_ROUTE_UNIFORM, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep1 T = 0", &a, 1, zero, LAYER_ROUTE_UNIFORM, 0.0f, NULL, CASE_PLAIN);
    const mok_shape wide = fp8_shape(384, 384, 4, 3, 0); /* no shared expert; 256 + 128 column down tiles */
    check_case("fp8 ep1 no shared, k = 3", &wide, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, CASE_PLAIN);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.fwd_comm_sms = 3;
    const int64_t t777[1] = {777};
    check_case("fp8 ep1 several macrobatches", &a, 1, t777, LAYER_ROUTE_SKEWED, 0.0f, &ring, CASE_PLAIN);
    const int64_t t2[2] = {300, 0}, t2b[2] = {17, 411};
    const mok_shape b = fp8_shape(256, 128, 8, 4, 128);
    check_case("fp8 ep2 uneven", &b, 2, t2, LAYER_ROUTE_SKEWED, 0.0f, NULL, CASE_PLAIN);
    check_case("fp8 ep2 holes, encoded", &b, 2, t2b, LAYER_ROUTE_HOLES | LAYER_ENCODED, 0.0f, &ring, CASE_PLAIN);
}

MOK_TEST(cuda_fp8_forward_exact_gateup) {
    if (skip("cuda_fp8_forward_exact_gateup")) return;
    const int64_t t1[1] = {300}, t2[2] = {200, 77};
    const mok_shape a = fp8_shape(384, 256, 8, 2, 256);
    check_case("fp8 exact ep1 uniform", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, CASE_EXACT);
    check_case("fp8 exact ep1 holes", &a, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, NULL, CASE_EXACT);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    check_case("fp8 exact ep1 macrobatches", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, &ring, CASE_EXACT);
    check_case("fp8 exact ep2", &a, 2, t2, LAYER_ROUTE_SKEWED, 0.0f, NULL, CASE_EXACT);
}

MOK_TEST(cuda_fp8_forward_outliers) {
    if (skip("cuda_fp8_forward_outliers")) return;
    const int64_t t1[1] = {200};
    const mok_shape a = fp8_shape(384, 256, 8, 2, 256);
    check_case("fp8 blocks spanning 2^-20 .. 2^4", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, CASE_SPREAD);
    check_case("fp8 Inf and NaN in x", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, CASE_NONFINITE);
}

/* y and the context (past its tag, which names the workspace) bitwise equal across three runs on one
 * workspace and across workspaces with other comm CTA counts, minibatch and ring sizes, turned
 * transfers, the cp.async path (MOK_CUDA_TMA=0) and the down and dx rows through the staging tile
 * (MOK_CUDA_DIRECT_ROWS=0) in place of the default's straight from the accumulators. */
MOK_TEST(cuda_fp8_determinism) {
    if (skip("cuda_fp8_determinism")) return;
    const int64_t t1[1] = {700};
    const mok_shape s = fp8_shape(256, 256, 8, 4, 128);
    layer L;
    if (layer_make(&L, &s, 1, t1, case_seed("fp8 determinism"), LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS) != 0) {
        CHECK(0, "layer_make failed");
        layer_free(&L);
        return;
    }
    const gpu_variant variants[] = GPU_VARIANTS;
    const size_t yb = (size_t)t1[0] * (size_t)s.hidden * 2;
    uint8_t *y0 = NULL, *ctx0 = NULL;
    int64_t padded = 0;
    mok_sizes sizes0;
    memset(&sizes0, 0, sizeof sizes0);
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; ++v) {
        mok_config c = gpu_variant_config(&variants[v], 0);
        gpu_variant_env(&variants[v], 1);
        gpu_fp8 G;
        gpu_layer *g = &G.gpu;
        mok_status st = gpu_fp8_open(&G, &L, &c);
        gpu_variant_env(&variants[v], 0);
        CHECK(st == MOK_OK, "variant %zu: open: %s", v, g->message);
        for (int run = 0; st == MOK_OK && run < (v == 0 ? 3 : 1); ++run) {
            st = gpu_fp8_forward(&G, &L, 0);
            CHECK(st == MOK_OK, "variant %zu run %d: forward: %s", v, run, g->message);
            if (st != MOK_OK) break;
            uint8_t *y = gpu_layer_download(g, 0, g->y[0], yb);
            uint8_t *ctx = gpu_layer_download(g, 0, g->context[0], g->sizes.context_bytes);
            if (!y0) {
                mok_schedule_info info;
                CHECK(mok_schedule_read(g->ws, g->schedule[0], 0, &info) == MOK_OK, "schedule_read: %s",
                      mok_last_error());
                padded = info.padded_rows;
                sizes0 = g->sizes;
                y0 = y;
                ctx0 = ctx;
                /* the run must have written y: no poison (0xffff, a NaN) left */
                int64_t nan = 0;
                for (size_t i = 0; i < yb / 2; ++i) nan += ((const uint16_t *)y)[i] == 0xffff;
                CHECK(nan == 0, "variant 0: %lld elements of y unwritten", (long long)nan);
                continue;
            }
            CHECK(memcmp(y, y0, yb) == 0, "variant %zu run %d: y differs bitwise from the first run's", v, run);
            const size_t at = context_diff(&L, &sizes0, padded, 0, ctx, ctx0);
            CHECK(at == 0, "variant %zu run %d: the context differs from the first run's at byte %zu", v, run, at - 1);
            free(y);
            free(ctx);
        }
        gpu_fp8_close(&G);
    }
    free(y0);
    free(ctx0);
    layer_free(&L);
}

/* The FP8 workspace holds no more memory than the bf16 one of the same shape and config. */
MOK_TEST(cuda_fp8_memory) {
    if (skip("cuda_fp8_memory")) return;
    const int device = 0;
    mok_config config = mok_config_default();
    mok_group *g = NULL;
    CHECK(mok_group_create_local(&g, MOK_BACKEND_CUDA, 1, &device, &config) == MOK_OK, "group: %s", mok_last_error());
    if (!g) return;
    mok_shape shapes[2] = {fp8_shape(7168, 2048, 16, 8, 2048), fp8_shape(384, 256, 8, 2, 0)};
    shapes[0].max_tokens = 4096;
    shapes[1].max_tokens = 1000;
    for (int i = 0; i < 2; ++i) {
        mok_sizes sz[2];
        for (int prec = 0; prec < 2; ++prec) {
            mok_shape s = shapes[i];
            s.precision = prec ? MOK_PRECISION_FP8 : MOK_PRECISION_BF16;
            mok_workspace *ws = NULL;
            mok_status st = mok_workspace_create(&ws, g, &s, &config);
            CHECK(st == MOK_OK, "shape %d precision %d: %s", i, prec, mok_last_error());
            if (st == MOK_OK) mok_workspace_sizes(ws, &sz[prec]);
            else memset(&sz[prec], 0, sizeof sz[prec]);
            mok_workspace_destroy(ws);
        }
        CHECK(sz[1].workspace_bytes > 0 && sz[1].workspace_bytes <= sz[0].workspace_bytes &&
                  sz[1].symmetric_bytes <= sz[0].symmetric_bytes && sz[1].context_bytes <= sz[0].context_bytes,
              "shape %d: the FP8 workspace holds %zu bytes (symmetric %zu, context %zu), the bf16 one %zu (%zu, %zu)",
              i, sz[1].workspace_bytes, sz[1].symmetric_bytes, sz[1].context_bytes, sz[0].workspace_bytes,
              sz[0].symmetric_bytes, sz[0].context_bytes);
    }
    mok_group_destroy(g);
}

static void expect(mok_status got, mok_status want, const char *needle, const char *what) {
    CHECK(got == want, "%s: status %d (%s), want %d; message: %s", what, (int)got, mok_status_string(got), (int)want,
          mok_last_error());
    if (got == want && needle)
        CHECK(strstr(mok_last_error(), needle) != NULL, "%s: message lacks \"%s\": %s", what, needle, mok_last_error());
}

/* What the cuda backend refuses on an FP8 workspace, by name: fp8_weights missing (forward and
 * backward), and fp8_weights not written for the workspace (found on the device: the pass does
 * nothing, the error comes at the next call); then a good forward still runs right. */
MOK_TEST(cuda_fp8_refusals) {
    if (skip("cuda_fp8_refusals")) return;
    const int64_t t1[1] = {100};
    const mok_shape s = fp8_shape(256, 128, 4, 2, 128);
    layer L;
    if (layer_make(&L, &s, 1, t1, case_seed("fp8 refusals"), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "layer_make failed");
        layer_free(&L);
        return;
    }
    gpu_fp8 G;
    gpu_layer *g = &G.gpu;
    mok_status st = gpu_fp8_open(&G, &L, NULL);
    CHECK(st == MOK_OK, "open: %s", g->message);
    if (st == MOK_OK) st = gpu_fp8_forward(&G, &L, 0);
    CHECK(st == MOK_OK, "forward: %s", g->message);
    if (st == MOK_OK) {
        const size_t yb = (size_t)t1[0] * (size_t)s.hidden * 2;
        uint8_t *y0 = gpu_layer_download(g, 0, g->y[0], yb);
        mok_forward_args fa[1];
        gpu_layer_forward_args(g, &L, NULL, G.fp8, fa);
        mok_backward_args ba = {t1[0],      g->schedule[0], g->context[0], g->x[0],    g->x[0],    g->rw[0],
                                g->w[0][0], g->w[1][0],     g->w[2][0],    g->s[0][0], g->s[1][0], g->s[2][0],
                                g->y[0],    NULL,           0,             g->w[0][0], g->w[1][0], g->w[2][0],
                                g->s[0][0], g->s[1][0],     g->s[2][0],    NULL,       NULL};
        void *drw = NULL;
        mok_memory_alloc(g->group, 0, (size_t)t1[0] * 2 * 4, &drw);
        ba.d_router_w = (float *)drw;
        expect(mok_backward(g->ws, &ba), MOK_ERR_INVALID_ARGUMENT, "fp8_weights", "backward without fp8_weights");
        mok_memory_free(g->group, 0, drw);
        void *none[1] = {NULL};
        gpu_layer_forward_args(g, &L, NULL, none, fa);
        expect(mok_forward(g->ws, fa), MOK_ERR_INVALID_ARGUMENT, "fp8_weights", "forward without fp8_weights");
        /* a buffer whose header was not written by mok_quantize_weights: y stays as it was */
        void *bad = NULL;
        CHECK(mok_memory_alloc(g->group, 0, G.layout.bytes, &bad) == MOK_OK, "alloc: %s", mok_last_error());
        if (bad) {
            gpu_layer_fill(g, 0, bad, G.layout.bytes, 0x3c);
            gpu_layer_fill(g, 0, g->y[0], yb, 0x11);
            void *bads[1] = {bad};
            gpu_layer_forward_args(g, &L, NULL, bads, fa);
            CHECK(mok_forward(g->ws, fa) == MOK_OK, "forward with a bad buffer: issued: %s", mok_last_error());
            expect(mok_synchronize(g->ws), MOK_ERR_INVALID_ARGUMENT, "fp8_weights", "a bad fp8_weights header");
            uint8_t *y = gpu_layer_download(g, 0, g->y[0], yb);
            size_t changed = 0;
            for (size_t i = 0; i < yb; ++i) changed += y[i] != 0x11;
            CHECK(changed == 0, "the refused pass wrote %zu bytes of y", changed);
            free(y);
            mok_memory_free(g->group, 0, bad);
        }
        st = gpu_fp8_forward(&G, &L, 0);
        CHECK(st == MOK_OK, "forward after the refusals: %s", g->message);
        if (st == MOK_OK) {
            uint8_t *y = gpu_layer_download(g, 0, g->y[0], yb);
            CHECK(memcmp(y, y0, yb) == 0, "y after the refusals differs from the first forward's");
            free(y);
        }
        free(y0);
    }
    gpu_fp8_close(&G);
    layer_free(&L);
}
