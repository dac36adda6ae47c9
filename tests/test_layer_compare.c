/* test_layer_compare.c — layer_compare's judgement of single-term flips (layer.c, judge_flips) on
 * FP8 layers with tensor-core block sums: one routed row's factor element moved by at most one
 * quantization step (h^ by one E4M3 step in dw_down, du by a few bf16 ulps in dw_up) passes even
 * where it exceeds the block's row, and a larger move of the same element, or the row's whole
 * term missing, does not. With exact block sums (the cpu's) only a one-ulp move of du passes.
 *
 * The layer has terms that dominate their column and row: token 0's first expert gets an up row
 * equal to its gate row at C0 and x_0 the signs of that row, so g = u = sum |gate| and h there is
 * far above the rest, and a down column C0 with the signs of dy_0, so dh and du there are too. The cpu backend's backward (fp32 gradients) against the FP8 reference is the
 * starting point; the moves are added to its dw_down column C0 (along w dy_0) and dw_up row C0
 * (along x_0), sized from the reference's projection on that row, as judge_flips sizes them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"
#include "matrix.h"
#include "test.h"

#define C0 37

/* The reference's column C0 of dw_down[e] (down) or row C0 of dw_up[e] projected on v [H]. */
static double projection(const layer *L, const layer_result *ref, int down, int64_t e, const uint16_t *v) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate;
    const float *dw = (const float *)ref->dw[down ? LAYER_DOWN : LAYER_UP][0] + e * I * H;
    double rv = 0.0, vv = 0.0;
    for (int64_t h = 0; h < H; ++h) {
        const double x = mok_bf16_to_float(v[h]);
        rv += (double)dw[down ? h * I + C0 : C0 * H + h] * x;
        vv += x * x;
    }
    return rv / vv;
}

/* Adds amount * v to got's dw_down[e] column C0 (down) or dw_up[e] row C0 (fp32 gradients). */
static void move(const layer *L, layer_result *got, int down, int64_t e, const uint16_t *v, double amount) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate;
    float *dw = (float *)got->dw[down ? LAYER_DOWN : LAYER_UP][0] + e * I * H;
    for (int64_t h = 0; h < H; ++h) dw[down ? h * I + C0 : C0 * H + h] += (float)(amount * mok_bf16_to_float(v[h]));
}

/* A move of one factor element: share of the element (h^_{0,C0} or du_{0,C0}), and whether
 * layer_compare must pass it. */
typedef struct move_case {
    const char *what;
    double share;
    int pass;
} move_case;

/* max |ref| of dw_down[e] or dw_up[e] */
static double block_max(const layer *L, const layer_result *ref, int down, int64_t e) {
    const int64_t n = L->shape.intermediate * L->shape.hidden;
    const float *dw = (const float *)ref->dw[down ? LAYER_DOWN : LAYER_UP][0] + e * n;
    double m = 0.0;
    for (int64_t i = 0; i < n; ++i) m = fmax(m, fabs((double)dw[i]));
    return m;
}

static double vec_max(const uint16_t *v, int64_t H) {
    double m = 0.0;
    for (int64_t h = 0; h < H; ++h) m = fmax(m, fabs((double)mok_bf16_to_float(v[h])));
    return m;
}

MOK_TEST(layer_compare_single_term_flips) {
    const mok_shape s = {256, 256, 4, 1, 0, 0, MOK_PRECISION_FP8};
    const int64_t tokens[1] = {64}, H = s.hidden, I = s.intermediate;
    layer L;
    if (layer_make(&L, &s, 1, tokens, matrix_case_seed("single-term flips", 0x5f11), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "layer_make failed");
        return;
    }
    const int64_t e = L.topk_ids[0][0];
    const uint16_t *gate = L.w[LAYER_GATE][0] + (e * I + C0) * H;
    uint16_t *up = L.w[LAYER_UP][0] + (e * I + C0) * H;
    uint16_t *down = L.w[LAYER_DOWN][0] + e * H * I;
    for (int64_t h = 0; h < H; ++h) {
        up[h] = gate[h];
        L.x[0][h] = mok_bf16_from_float(mok_bf16_to_float(gate[h]) > 0.0f ? 1.0f : -1.0f);
        /* dh there too: the down column's signs those of dy_0 */
        const float d = fabsf(mok_bf16_to_float(down[h * I + C0])), y = mok_bf16_to_float(L.dy[0][h]);
        down[h * I + C0] = mok_bf16_from_float(y > 0.0f ? d : -d);
    }
    const mok_config config = mok_config_default();
    layer_result got = {0}, ref = {0};
    mok_status st = layer_run_backend(&L, &config, 1, &got);
    CHECK(st == MOK_OK, "cpu backend: %s", got.message);
    if (st == MOK_OK) st = layer_run_reference(&L, &ref);
    CHECK(st == MOK_OK, "reference: %s", ref.message);
    if (st != MOK_OK) goto done;
    L.tensor_core_sums = 1;
    CHECK(layer_compare(&L, &got, &ref, "flips: as computed") <= 1.0, "the cpu backend's own result fails");

    const size_t n = (size_t)(s.num_experts * I * H);
    float *saved_down = malloc(n * sizeof(float)), *saved_up = malloc(n * sizeof(float));
    if (!saved_down || !saved_up) {
        CHECK(0, "out of memory");
        free(saved_down);
        free(saved_up);
        goto done;
    }
    memcpy(saved_down, got.dw[LAYER_DOWN][0], n * sizeof(float));
    memcpy(saved_up, got.dw[LAYER_UP][0], n * sizeof(float));
    const double w = L.router_w[0][0];

    /* dw_down: h^_{0,C0} moved along w dy_0 */
    const double h = projection(&L, &ref, 1, e, L.dy[0]) / w, down_max = block_max(&L, &ref, 1, e);
    const double down_reach = fabs(h) * fabs(w) * vec_max(L.dy[0], H); /* what a move of all of h^ reaches */
    const move_case down_moves[] = {{"dw_down: h^ one E4M3 step (0.1 of it)", 0.1, 1},
                      {"dw_down: h^ moved by 0.3 of it", 0.3, 0},
                      {"dw_down: the row's term missing", -1.0, 0}};
    for (size_t i = 0; i < sizeof down_moves / sizeof down_moves[0]; ++i) {
        /* the move exceeds the tensor-core row (5e-2 of the block's max) on its own */
        CHECK(fabs(down_moves[i].share) * down_reach > 5e-2 * down_max, "%s: %.3g does not exceed %.3g",
              down_moves[i].what, fabs(down_moves[i].share) * down_reach, 5e-2 * down_max);
        move(&L, &got, 1, e, L.dy[0], down_moves[i].share * h * w);
        const double err = layer_compare(&L, &got, &ref, down_moves[i].what);
        CHECK(down_moves[i].pass ? err <= 1.0 : err > 1.0, "%s: error %.3g", down_moves[i].what, err);
        printf("    %s: error %.3f (%s)\n", down_moves[i].what, err, down_moves[i].pass ? "a flip" : "an error");
        memcpy(got.dw[LAYER_DOWN][0], saved_down, n * sizeof(float));
    }

    /* dw_up: du_{0,C0} moved along x_0 */
    const double du = projection(&L, &ref, 0, e, L.x[0]), up_max = block_max(&L, &ref, 0, e);
    const double up_reach = fabs(du) * vec_max(L.x[0], H);
    const move_case up_moves[] = {{"dw_up: du moved by 0.02 of it (under three bf16 ulps)", 0.02, 1},
                    {"dw_up: du moved by 0.1 of it", 0.1, 0}};
    for (size_t i = 0; i < sizeof up_moves / sizeof up_moves[0]; ++i) {
        CHECK(fabs(up_moves[i].share) * up_reach > 1e-2 * up_max, "%s: %.3g does not exceed %.3g", up_moves[i].what,
              fabs(up_moves[i].share) * up_reach, 1e-2 * up_max);
        move(&L, &got, 0, e, L.x[0], up_moves[i].share * du);
        const double err = layer_compare(&L, &got, &ref, up_moves[i].what);
        CHECK(up_moves[i].pass ? err <= 1.0 : err > 1.0, "%s: error %.3g", up_moves[i].what, err);
        printf("    %s: error %.3f (%s)\n", up_moves[i].what, err, up_moves[i].pass ? "a flip" : "an error");
        memcpy(got.dw[LAYER_UP][0], saved_up, n * sizeof(float));
    }

    /* the same flip on a layer without tensor-core sums is an error: the cpu's rows stand */
    L.tensor_core_sums = 0;
    move(&L, &got, 1, e, L.dy[0], 0.1 * h * w);
    CHECK(layer_compare(&L, &got, &ref, "dw_down flip, cpu rows") > 1.0, "a flip passed the cpu's rows");
    memcpy(got.dw[LAYER_DOWN][0], saved_down, n * sizeof(float));

    /* exact sums: du one bf16 ulp off (0.007 of it) with an error no row explains beside it (0.6% of
       the block's max at one element, as the result's own rounding would leave) passes once the
       flip is taken out; three ulps (0.02 of it) stay an error */
    float *up_block = (float *)got.dw[LAYER_UP][0] + e * I * H;
    int64_t at = 0;
    for (int64_t i = 1; i < I * H; ++i)
        if (fabsf(up_block[i]) > fabsf(up_block[at])) at = i;
    const move_case exact_moves[] = {{"dw_up, cpu rows: du one ulp off and the result's rounding", 0.007, 1},
                       {"dw_up, cpu rows: du three ulps off and the result's rounding", 0.02, 0}};
    for (size_t i = 0; i < sizeof exact_moves / sizeof exact_moves[0]; ++i) {
        move(&L, &got, 0, e, L.x[0], exact_moves[i].share * du);
        up_block[at] += (float)(6e-3 * up_max);
        const double err = layer_compare(&L, &got, &ref, exact_moves[i].what);
        CHECK(exact_moves[i].pass ? err <= 1.0 : err > 1.0, "%s: error %.3g", exact_moves[i].what, err);
        printf("    %s: error %.3f (%s)\n", exact_moves[i].what, err, exact_moves[i].pass ? "a flip" : "an error");
        memcpy(got.dw[LAYER_UP][0], saved_up, n * sizeof(float));
    }
    free(saved_down);
    free(saved_up);
done:
    layer_result_free(&got);
    layer_result_free(&ref);
    layer_free(&L);
}
