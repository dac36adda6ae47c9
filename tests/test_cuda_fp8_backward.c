/* test_cuda_fp8_backward.c — the cuda backend's FP8 backward (include/mok.h, FP8 section) against
 * the FP8 reference and the cpu backend's FP8 backward: dx, d_router_w and every weight gradient
 * (bf16 and accumulate mode) on the adversarial routings of the bf16 tests (one expert, empty
 * experts, -1 slots, router weights <= 0, the clamp, no shared expert, several macrobatches with
 * the replay of g|u past the context); the replay and mok_recompute_context giving the bits of a
 * backward from the forward's context; and bitwise determinism across runs, comm CTAs, minibatch
 * and ring sizes, turned transfers, the cp.async path and the dh tiles' width (128 or 256 columns,
 * MOK_CUDA_COLS_DH); NaN and Inf in x and in a weight, at both dh widths.
 *
 * Tolerances: layer.c's FP8 rows for tensor-core block sums (layer.tensor_core_sums, with its
 * judgement of single-term flips in the weight gradients) on random layers, and the cpu's FP8 rows
 * on exact ones (gpu_layer.h: x, dy and the weights such that every
 * GEMM's block sums are exact on the tensor cores, where those rows see a missing quantization
 * point). Every case prints its errors (1 = the tolerance), passing or not. Every test skips without a GPU; the EP2
 * cases without two. Seeds derive from MOK_TEST_SEED and the case's name. */
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

static mok_shape fp8_shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is) {
    mok_shape s = {H, I, E, k, Is, 1, MOK_PRECISION_FP8};
    return s;
}

static int make_layer(layer *L, const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                      float limit) {
    if (layer_make(L, shape, P, tokens, matrix_case_seed(name, 0xbac8f8ull), routing) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(L);
        return -1;
    }
    L->swiglu_limit = limit;
    L->tensor_core_sums = 1;
    if (limit > 0.0f) layer_avoid_clamp_flips(L);
    return 0;
}

/* Forward (or forward then recompute) and backward of L on the GPUs with config into *out. */
static mok_status gpu_run(const layer *L, const mok_config *config, int accumulate, int recompute, layer_result *out,
                          char *message, size_t message_size) {
    gpu_fp8 G;
    mok_status st = gpu_fp8_open(&G, L, config);
    if (st == MOK_OK) st = gpu_fp8_forward(&G, L, 0);
    if (st == MOK_OK) gpu_layer_download_y(&G.gpu, L, out);
    if (st == MOK_OK && recompute) {
        /* a poisoned context, rebuilt by the recompute pass */
        for (int p = 0; p < L->nranks && st == MOK_OK; ++p)
            st = gpu_layer_fill(&G.gpu, p, G.gpu.context[p], G.gpu.sizes.context_bytes, 0xff);
        if (st == MOK_OK) st = gpu_fp8_forward(&G, L, 1);
    }
    if (st == MOK_OK) st = gpu_layer_backward(&G.gpu, L, accumulate, G.fp8, out);
    if (st != MOK_OK) snprintf(message, message_size, "%s", G.gpu.message[0] ? G.gpu.message : mok_last_error());
    gpu_fp8_close(&G);
    return st;
}

/* got against the FP8 reference: its error (1 = the tolerance), printed passing or not. */
static void against_reference(const layer *L, const layer_result *got, const layer_result *ref, const char *tag,
                              const char *name) {
    const double e = layer_compare(L, got, ref, tag);
    CHECK(e <= 1.0, "%s: cuda FP8 backward vs the FP8 reference: error %.3g > 1", tag, e);
    printf("    %s: error %.3f vs the reference\n", name, e);
}

/* One layer (exact: gpu_fp8_reshape's exact values): the FP8 reference, then the GPU's
 * backward, compared. */
static void check_case(const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                       float limit, const mok_config *gpu_cfg, int accumulate, int exact, int cols_dh) {
    if (mok_backend_available(MOK_BACKEND_CUDA) < P) {
        printf("    (%s: skipped, needs %d GPUs)\n", name, P);
        return;
    }
    if (!mok_test_case_selected(name)) return;
    layer L;
    if (make_layer(&L, name, shape, P, tokens, routing, limit) != 0) return;
    if (exact) { /* every GEMM the reference's up to fp32 sums: the cpu's rows apply (layer.c) */
        CHECK(gpu_fp8_reshape(&L, GPU_FP8_EXACT, L.seed ^ 0x5eedull) == 0, "%s: exact rows left at a tie", name);
        L.tensor_core_sums = 0;
    }
    char tag[256], message[1024] = "";
    snprintf(tag, sizeof tag, "%s (MOK_TEST_SEED=%llu)", name, mok_test_seed());
    layer_result ref = {0}, got = {0};
    mok_status st = layer_run_reference(&L, &ref);
    CHECK(st == MOK_OK, "%s: reference: %s", tag, ref.message);
    if (st == MOK_OK) {
        const gpu_variant width = {0, 0, 0, 0, 0, cols_dh, 0};
        gpu_variant_env(&width, 1);
        st = gpu_run(&L, gpu_cfg, accumulate, 0, &got, message, sizeof message);
        gpu_variant_env(&width, 0);
        CHECK(st == MOK_OK, "%s: gpu: %s", tag, message);
    }
    if (st == MOK_OK) against_reference(&L, &got, &ref, tag, name);
    layer_result_free(&got);
    layer_result_free(&ref);
    layer_free(&L);
}

/* Random layers (tensor-core rows) and exact ones (the cpu's rows, which would see a missing
 * quantization point) on the adversarial routings. */
MOK_TEST(cuda_fp8_backward_routings) {
    if (skip("cuda_fp8_backward_routings")) return;
    const int64_t t1[1] = {300}, one[1] = {1};
    const mok_shape a = fp8_shape(256, 256, 8, 2, 128);
    check_case("fp8 bwd ep1 uniform", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0, 0, 0);
    check_case("fp8 bwd ep1 skewed accumulate", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1, 0, 0);
    check_case("fp8 bwd ep1 exact skewed", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 0, 1, 0);
    check_case("fp8 bwd ep1 exact one expert", &a, 1, t1, LAYER_ROUTE_ONE_EXPERT, 0.0f, NULL, 0, 1, 0);
    check_case("fp8 bwd ep1 exact empty experts", &a, 1, t1, LAYER_ROUTE_EVEN, 0.0f, NULL, 1, 1, 0);
    check_case("fp8 bwd ep1 exact -1 slots, weights <= 0", &a, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f,
               NULL, 0, 1, 0);
    /* the clamp on exact layers only: g and u are the reference's bits there, so no element's clamp
       mask can differ (layer_avoid_clamp_flips steers by the reference's g and u; the tensor cores'
       block sums move them by more than its window) */
    check_case("fp8 bwd ep1 exact clamp", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.5f, NULL, 0, 1, 0);
    check_case("fp8 bwd ep1 exact one token", &a, 1, one, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0, 1, 0);
    const mok_shape wide = fp8_shape(384, 384, 4, 3, 0); /* no shared expert; 256 + 128 column dx tiles */
    check_case("fp8 bwd ep1 no shared, k = 3", &wide, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 0, 0, 0);
    check_case("fp8 bwd ep1 exact no shared, k = 3", &wide, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 0, 1, 0);
    const mok_shape big_shared = fp8_shape(128, 128, 4, 1, 384); /* k = 1: the shared dg^|du^ rows of their own */
    check_case("fp8 bwd ep1 k = 1, wide shared expert", &big_shared, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0, 0, 0);
    check_case("fp8 bwd ep1 exact k = 1, wide shared expert", &big_shared, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0,
               1, 0);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.context_rows = 128;
    ring.bwd_comm_sms = 3;
    const int64_t t777[1] = {777};
    check_case("fp8 bwd ep1 macrobatches, replay", &a, 1, t777, LAYER_ROUTE_SKEWED, 0.0f, &ring, 0, 0, 0);
    check_case("fp8 bwd ep1 exact macrobatches, replay, accumulate", &a, 1, t777, LAYER_ROUTE_ONE_EXPERT, 0.0f, &ring,
               1, 1, 0);
    const int64_t t2[2] = {300, 0}, t2b[2] = {17, 411};
    const mok_shape b = fp8_shape(256, 128, 8, 4, 128);
    check_case("fp8 bwd ep2 uneven", &b, 2, t2, LAYER_ROUTE_SKEWED, 0.0f, NULL, 0, 0, 0);
    check_case("fp8 bwd ep2 exact holes, macrobatches, replay", &b, 2, t2b, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS,
               0.0f, &ring, 0, 1, 0);
    /* dh tiles of two 128-blocks (the rule gives them to I >= 2048): a replay runs the forward's
       gate|up tile once per block, the SwiGLU backward quantizes block by block */
    const mok_shape w2 = fp8_shape(256, 512, 8, 2, 256);
    check_case("fp8 bwd ep1 256-col dh uniform", &w2, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0, 0, 256);
    check_case("fp8 bwd ep1 256-col dh exact skewed, accumulate", &w2, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1, 1,
               256);
    check_case("fp8 bwd ep1 256-col dh exact clamp, -1 slots", &w2, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS,
               0.5f, NULL, 0, 1, 256);
    check_case("fp8 bwd ep1 256-col dh exact macrobatches, replay", &w2, 1, t777, LAYER_ROUTE_SKEWED, 0.0f, &ring, 0,
               1, 256);
    const mok_shape b2 = fp8_shape(256, 256, 8, 4, 256);
    check_case("fp8 bwd ep2 256-col dh exact holes, replay", &b2, 2, t2b, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS,
               0.0f, &ring, 0, 1, 256);
}

/* The replay of g|u past the context (config.context_rows) and mok_recompute_context give the
 * bits of a backward from the forward's whole context: the replay's x^ and weights are the
 * forward's, so are its g and u. The whole context's run has 128-column dh tiles (the rule's for
 * I < 2048), the replay's 256 (two replayed blocks per tile): the same bits at either width. */
MOK_TEST(cuda_fp8_backward_replay) {
    if (skip("cuda_fp8_backward_replay")) return;
    const int64_t t1[1] = {700};
    const mok_shape s = fp8_shape(384, 256, 8, 4, 256);
    layer L;
    if (make_layer(&L, "fp8 bwd replay", &s, 1, t1, LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS, 0.0f) != 0) return;
    char message[1024] = "", what[256] = "";
    layer_result whole = {0}, replayed = {0}, recomputed = {0};
    mok_config c = mok_config_default();
    mok_status st = gpu_run(&L, &c, 0, 0, &whole, message, sizeof message);
    CHECK(st == MOK_OK, "whole context: %s", message);
    c.context_rows = 128;
    const gpu_variant wide = {0, 0, 0, 0, 0, 256, 0};
    if (st == MOK_OK) {
        gpu_variant_env(&wide, 1);
        st = gpu_run(&L, &c, 0, 0, &replayed, message, sizeof message);
        gpu_variant_env(&wide, 0);
        CHECK(st == MOK_OK, "context of 128 rows, 256-column dh tiles: %s", message);
    }
    if (st == MOK_OK)
        CHECK(layer_equal(&L, &whole, &replayed, what, sizeof what),
              "the replay past 128 context rows (256-column dh tiles) differs: %s", what);
    c = mok_config_default();
    if (st == MOK_OK) {
        st = gpu_run(&L, &c, 0, 1, &recomputed, message, sizeof message);
        CHECK(st == MOK_OK, "recompute: %s", message);
    }
    if (st == MOK_OK)
        CHECK(layer_equal(&L, &whole, &recomputed, what, sizeof what),
              "the backward after mok_recompute_context differs: %s", what);
    layer_result_free(&whole);
    layer_result_free(&replayed);
    layer_result_free(&recomputed);
    layer_free(&L);
}

/* dx, d_router_w and the gradients bitwise equal across two runs and across workspaces with other
 * comm CTA counts, minibatch and ring sizes, turned transfers, the cp.async path
 * (MOK_CUDA_TMA=0) and 256-column dh tiles. */
MOK_TEST(cuda_fp8_backward_determinism) {
    if (skip("cuda_fp8_backward_determinism")) return;
    const int64_t t1[1] = {700};
    const mok_shape s = fp8_shape(256, 256, 8, 4, 256);
    layer L;
    if (make_layer(&L, "fp8 bwd determinism", &s, 1, t1, LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS, 0.0f) != 0) return;
    const gpu_variant variants[] = GPU_VARIANTS;
    char message[1024] = "", what[256] = "";
    layer_result first = {0};
    /* the first variant twice: two runs of one configuration, then the others */
    for (size_t n = 0; n <= sizeof variants / sizeof variants[0]; ++n) {
        const size_t v = n ? n - 1 : 0;
        mok_config c = gpu_variant_config(&variants[v], 1);
        gpu_variant_env(&variants[v], 1);
        layer_result got = {0};
        mok_status st = gpu_run(&L, &c, 0, 0, n == 0 ? &first : &got, message, sizeof message);
        gpu_variant_env(&variants[v], 0);
        CHECK(st == MOK_OK, "variant %zu: %s", v, message);
        if (st == MOK_OK && n > 0)
            CHECK(layer_equal(&L, &first, &got, what, sizeof what), "variant %zu differs from the first run: %s", v,
                  what);
        layer_result_free(&got);
        if (st != MOK_OK) break;
    }
    layer_result_free(&first);
    layer_free(&L);
}

/* ---- NaN and Inf ------------------------------------------------------------------------------ */

static int rows_equal(const void *a, const void *b, int64_t row, size_t bytes) {
    return memcmp((const char *)a + row * bytes, (const char *)b + row * bytes, bytes) == 0;
}

/* One non-finite value (bf16 bits `bad`) in x or in one expert's gate weight, as test_cpu_fp8.c's
 * cpu cases: the passes return MOK_OK; the tokens it cannot reach keep y, dx and d_router_w bit
 * for bit, the experts it cannot reach their gradients; a reached token's y is NaN; everything
 * agrees with the FP8 reference. The SwiGLU backward's blocks that hold the value's NaN take the
 * quantization's non-finite path (fp8_rows.cuh), the others its finite one. */
static void nonfinite_case(const char *name, const mok_shape *s, uint16_t bad, int in_weight, int cols_dh) {
    if (!mok_test_case_selected(name)) return;
    const int64_t t1[1] = {300};
    layer L;
    if (make_layer(&L, name, s, 1, t1, LAYER_ROUTE_SKEWED, 0.0f) != 0) return;
    const int64_t H = s->hidden, I = s->intermediate, k = s->topk, E = s->num_experts, per = I * H;
    uint64_t state = L.seed;
    const int64_t bad_token = (int64_t)(matrix_pick(&state) % (uint64_t)t1[0]);
    const int64_t bad_col = (int64_t)(matrix_pick(&state) % (uint64_t)H);
    const int64_t bad_i = (int64_t)(matrix_pick(&state) % (uint64_t)I);
    int64_t bad_expert = -1; /* in_weight: an expert of the bad token's, so that some token reaches it */
    for (int64_t j = 0; j < k && bad_expert < 0; ++j) bad_expert = L.topk_ids[0][bad_token * k + j];
    char tag[256], message[1024] = "";
    snprintf(tag, sizeof tag, "%s (token %lld expert %lld col %lld, MOK_TEST_SEED=%llu)", name, (long long)bad_token,
             (long long)bad_expert, (long long)bad_col, mok_test_seed());
    const gpu_variant width = {0, 0, 0, 0, 0, cols_dh, 0};
    layer_result clean = {0}, dirty = {0}, ref = {0};
    gpu_variant_env(&width, 1);
    mok_status st = gpu_run(&L, NULL, 0, 0, &clean, message, sizeof message);
    CHECK(st == MOK_OK, "%s: clean run: %s", tag, message);
    if (st == MOK_OK && bad_expert < 0) {
        CHECK(0, "%s: the bad token has no expert; the case tests nothing", tag);
        st = MOK_ERR_INVALID_ARGUMENT;
    }
    if (st == MOK_OK) {
        if (in_weight) L.w[LAYER_GATE][0][bad_expert * per + bad_i * H + bad_col] = bad;
        else L.x[0][bad_token * H + bad_col] = bad;
        st = gpu_run(&L, NULL, 0, 0, &dirty, message, sizeof message);
        CHECK(st == MOK_OK, "%s: the run with a non-finite value: %s", tag, message);
    }
    gpu_variant_env(&width, 0);
    if (st == MOK_OK) {
        int64_t reached_tokens = 0;
        for (int64_t t = 0; t < t1[0]; ++t) {
            int reached = !in_weight && t == bad_token;
            for (int64_t j = 0; in_weight && j < k; ++j) reached |= L.topk_ids[0][t * k + j] == bad_expert;
            if (reached) {
                ++reached_tokens;
                int64_t not_nan = 0;
                for (int64_t h = 0; h < H; ++h) not_nan += !isnan(mok_bf16_to_float(dirty.y[0][t * H + h]));
                CHECK(not_nan == 0, "%s: %lld elements of reached token %lld's y are not NaN", tag,
                      (long long)not_nan, (long long)t);
                continue;
            }
            CHECK(rows_equal(clean.y[0], dirty.y[0], t, (size_t)H * 2), "%s: y of token %lld changed", tag,
                  (long long)t);
            if (!in_weight) { /* a bad weight reaches every token through its expert's dx part */
                CHECK(rows_equal(clean.dx[0], dirty.dx[0], t, (size_t)H * 2), "%s: dx of token %lld changed", tag,
                      (long long)t);
                CHECK(rows_equal(clean.d_router_w[0], dirty.d_router_w[0], t, (size_t)k * 4),
                      "%s: d_router_w of token %lld changed", tag, (long long)t);
            }
        }
        for (int64_t e = 0; e < E; ++e) {
            int reached = in_weight ? e == bad_expert : 0;
            for (int64_t j = 0; !in_weight && j < k; ++j) reached |= L.topk_ids[0][bad_token * k + j] == e;
            if (reached) continue;
            for (int m = 0; m < 3; ++m)
                CHECK(memcmp((uint16_t *)clean.dw[m][0] + e * per, (uint16_t *)dirty.dw[m][0] + e * per,
                             (size_t)per * 2) == 0,
                      "%s: gradient %d of expert %lld, which the bad value does not reach, changed", tag, m,
                      (long long)e);
        }
        CHECK(reached_tokens > 0, "%s: the bad value reaches no token; the case tests nothing", tag);
        st = layer_run_reference(&L, &ref);
        CHECK(st == MOK_OK, "%s: reference: %s", tag, ref.message);
        if (st == MOK_OK) against_reference(&L, &dirty, &ref, tag, name);
    }
    layer_result_free(&clean);
    layer_result_free(&dirty);
    layer_result_free(&ref);
    layer_free(&L);
}

MOK_TEST(cuda_fp8_backward_nonfinite) {
    if (skip("cuda_fp8_backward_nonfinite")) return;
    const mok_shape a = fp8_shape(256, 256, 8, 2, 128), w2 = fp8_shape(256, 512, 8, 2, 256);
    nonfinite_case("fp8 bwd NaN in x", &a, 0x7fc0, 0, 0);
    nonfinite_case("fp8 bwd -Inf in x, 256-col dh", &w2, 0xff80, 0, 256);
    nonfinite_case("fp8 bwd +Inf in a gate weight", &a, 0x7f80, 1, 0);
    nonfinite_case("fp8 bwd NaN in a gate weight, 256-col dh", &w2, 0x7fc0, 1, 256);
}
