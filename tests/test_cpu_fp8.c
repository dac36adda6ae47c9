/* test_cpu_fp8.c — the cpu backend's FP8 passes (include/mok.h, FP8 section) against the FP8
 * reference: the adversarial layers of the bf16 matrix (one expert, empty experts, -1 slots,
 * router weights <= 0, uneven and zero tokens, several macrobatches, replay, the clamp, encoded
 * rows, 1 to 4 ranks, turned transfers), bitwise determinism across runs, threads, comm workers,
 * minibatch and ring sizes; inputs whose 128-blocks span a wide range; NaN and Inf; the recomputed
 * context; the memory rule; every new argument rule; the GPU tests' exact layers; and that the
 * function computed is the FP8 one, not the bf16 one (the backend is far closer to the FP8 reference than to the bf16 one).
 *
 * Layer seeds derive from MOK_TEST_SEED and the case's name (`MOK_TEST_SEED=N ./build/mok_tests
 * cpu_fp8` replays a run); MOK_TEST_QUICK=1 shrinks the matrix. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "determinism.h"
#include "gpu_layer.h"
#include "layer.h"
#include "matrix.h"
#include "test.h"

static mok_shape fp8_shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is) {
    mok_shape s = {H, I, E, k, Is, 0, MOK_PRECISION_FP8};
    return s;
}

static void *alloc_aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static uint64_t case_seed(const char *name) { return matrix_case_seed(name, 0xf8f8f8f8ull); }

static void check_layer(const char *tag, const layer *L, const mok_config *config, int modes) {
    matrix_check_layer(tag, L, config, modes, NULL);
}

static void run_case(const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing, float limit,
                     const mok_config *config, int modes) {
    matrix_run_case(name, case_seed(name), shape, P, tokens, routing, limit, config, modes, NULL);
}

/* ---- against the FP8 reference ------------------------------------------------------------- */

MOK_TEST(cpu_fp8_routings) {
    const int quick = mok_test_quick();
    const mok_config config = matrix_config();
    const int64_t T = quick ? 20 : 40;
    const int64_t t4[] = {T, T - 5, T + 3, T - 11};
    const mok_shape s = fp8_shape(256, 128, 8, 3, 128);
    run_case("fp8 uniform", &s, 4, t4, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    run_case("fp8 every slot to one expert", &s, 4, t4, LAYER_ROUTE_ONE_EXPERT, 0.0f, &config, MATRIX_BOTH_MODES);
    run_case("fp8 -1 slots", &s, 4, t4, LAYER_ROUTE_HOLES, 0.0f, &config, MATRIX_BOTH_MODES);
    run_case("fp8 router weights <= 0 and -1 slots", &s, 4, t4, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, &config,
             MATRIX_BF16_GRADS);
    run_case("fp8 router weights <= 0, one expert", &s, 4, t4, LAYER_ROUTE_ONE_EXPERT | LAYER_SIGNED_WEIGHTS, 0.0f,
             &config, MATRIX_BF16_GRADS);
    run_case("fp8 encoded", &s, 4, t4, LAYER_ROUTE_UNIFORM | LAYER_ENCODED, 0.0f, &config, MATRIX_BF16_GRADS);
    run_case("fp8 encoded, -1 slots", &s, 4, t4, LAYER_ROUTE_HOLES | LAYER_ENCODED, 0.0f, &config, MATRIX_BF16_GRADS);
    const mok_shape even = fp8_shape(128, 128, 12, 3, 0);
    run_case("fp8 even experts only (odd ones empty), no shared expert", &even, 4, t4, LAYER_ROUTE_EVEN, 0.0f, &config,
             MATRIX_BOTH_MODES);
    const mok_shape one_local = fp8_shape(128, 128, 4, 2, 128);
    run_case("fp8 one local expert (E = P = 4)", &one_local, 4, t4, LAYER_ROUTE_SKEWED, 0.0f, &config, MATRIX_BF16_GRADS);
    const mok_shape k1 = fp8_shape(128, 256, 8, 1, 0);
    run_case("fp8 k = 1, I = 256", &k1, 4, t4, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BF16_GRADS);
}

MOK_TEST(cpu_fp8_tokens_and_ranks) {
    const int quick = mok_test_quick();
    const mok_config config = matrix_config();
    const mok_shape s = fp8_shape(128, 128, 8, 2, 128);
    {
        const int64_t t[] = {0, 40, 0, 17};
        run_case("fp8 T = 0 on ranks 0 and 2", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        const int64_t t[] = {0, 0, 0, 0};
        run_case("fp8 T = 0 on every rank", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        const int64_t t[] = {1, 130, 7, 64}; /* 130: two token tiles of the shared expert */
        run_case("fp8 uneven T 1/130/7/64", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        mok_shape big = s;
        big.max_tokens = 200;
        const int64_t t[] = {33, 21, 45, 9};
        run_case("fp8 T < T_max", &big, 4, t, LAYER_ROUTE_SKEWED, 0.0f, &config, MATRIX_BF16_GRADS);
    }
    const int sizes[] = {1, 2, 3};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        const int P = sizes[i];
        char name[64];
        snprintf(name, sizeof name, "fp8 P = %d", P);
        const mok_shape sp = fp8_shape(128, 128, P == 1 ? 4 : 2 * P, 2, i % 2 ? 128 : 0);
        int64_t tokens[MOK_MAX_RANKS];
        uint64_t state = case_seed(name);
        for (int p = 0; p < P; ++p) tokens[p] = (quick ? 8 : 20) + (int64_t)(matrix_pick(&state) % 30);
        run_case(name, &sp, P, tokens, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
}

/* Several macrobatches (ring of one minibatch), replay (a context of 128 rows), both, and the
 * SwiGLU clamp; each case must really exercise what it is named for. */
MOK_TEST(cpu_fp8_ring_replay_clamp) {
    const int quick = mok_test_quick();
    const mok_shape s = fp8_shape(128, 128, 8, 6, 128);
    const int64_t T = quick ? 48 : 64;
    const int64_t t4[] = {T, T + 9, T - 13, T + 20};
    mok_config small_ring = matrix_config();
    small_ring.ring_rows = 128;
    mok_config replay = matrix_config();
    replay.context_rows = 128;
    replay.ring_rows = 16384;
    mok_config both = small_ring;
    both.context_rows = 128;
    const struct {
        const char *name;
        const mok_config *config;
        int routing;
    } cases[] = {
        {"fp8 ring = minibatch = 128", &small_ring, LAYER_ROUTE_UNIFORM},
        {"fp8 ring 128, one expert", &small_ring, LAYER_ROUTE_ONE_EXPERT},
        {"fp8 context_rows 128", &replay, LAYER_ROUTE_UNIFORM},
        {"fp8 ring 128 and context_rows 128, one expert", &both, LAYER_ROUTE_ONE_EXPERT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        layer L;
        if (layer_make(&L, &s, 4, t4, case_seed(cases[i].name), cases[i].routing) != 0) {
            CHECK(0, "%s: layer_make failed", cases[i].name);
            layer_free(&L);
            continue;
        }
        check_layer(cases[i].name, &L, cases[i].config, i == 3 ? MATRIX_BOTH_MODES : MATRIX_BF16_GRADS);
        layer_result r = {0};
        mok_status st = layer_run_backend(&L, cases[i].config, 0, &r);
        CHECK(st == MOK_OK, "%s: %s", cases[i].name, r.message);
        int64_t most_macro = 0, most_rows = 0;
        for (int p = 0; st == MOK_OK && p < 4; ++p) {
            if (r.info[p].num_macrobatches > most_macro) most_macro = r.info[p].num_macrobatches;
            if (r.info[p].padded_rows > most_rows) most_rows = r.info[p].padded_rows;
        }
        if (cases[i].config->ring_rows == 128)
            CHECK(most_macro > 1, "%s: no rank has more than one macrobatch", cases[i].name);
        if (cases[i].config->context_rows == 128)
            CHECK(most_rows >= 3 * 128, "%s: only %lld padded rows, most rows are not replayed", cases[i].name,
                  (long long)most_rows);
        layer_result_free(&r);
        layer_free(&L);
    }
    const mok_config config = matrix_config();
    const int64_t t_clamp[] = {37, 52, 29, 44};
    const mok_shape sc = fp8_shape(128, 128, 8, 2, 128);
    run_case("fp8 SwiGLU limit 0.5", &sc, 4, t_clamp, LAYER_ROUTE_UNIFORM, 0.5f, &config, MATRIX_BOTH_MODES);
}

/* ---- determinism ----------------------------------------------------------------------------- */

MOK_TEST(cpu_fp8_determinism) {
    const int quick = mok_test_quick();
    const mok_shape s = fp8_shape(128, 128, 8, 3, 128);
    const int64_t t4[] = {70, 33, 90, 51};
    layer L;
    if (layer_make(&L, &s, 4, t4, case_seed("fp8 determinism"), LAYER_ROUTE_SKEWED) != 0) {
        CHECK(0, "layer_make failed");
        layer_free(&L);
        return;
    }
    const layer_variant all[] = {
        {128, 512, 2, 1, 0, 0}, /* the base; runs three times on one workspace */
        {256, 512, 2, 1, 0, 0}, {512, 512, 2, 1, 0, 0},   {128, 128, 2, 1, 0, 0},   {128, 16384, 2, 1, 0, 0},
        {128, 512, 3, 1, 0, 0}, {128, 512, 4, 2, 0, 0},   {128, 512, 2, 1, 128, 0}, {256, 256, 3, 2, 128, 0},
        {128, 128, 2, 1, 0, 1}, {256, 512, 3, 2, 128, 1},
    };
    const layer_variant few[] = {{128, 512, 2, 1, 0, 0}, {256, 512, 3, 2, 0, 0}, {128, 128, 2, 1, 128, 1}};
    if (quick) check_determinism("fp8 determinism", &L, matrix_config(), few, sizeof few / sizeof few[0]);
    else check_determinism("fp8 determinism", &L, matrix_config(), all, sizeof all / sizeof all[0]);
    layer_free(&L);
}

/* ---- inputs whose 128-blocks span a wide range ------------------------------------------------ */

static uint16_t scaled_bf16(uint16_t v, int e) { return mok_bf16_from_float((float)ldexp(mok_bf16_to_float(v), e)); }

/* Every 128-block along a GEMM's K gets its own power of two, compensated in the other operand so
 * that every block still counts in the sums: x's column block b by 2^c_b and the gate/up weights'
 * columns by 2^-c_b (each 128 x 128 weight block then has a scale of its own, in both
 * orientations); up's rows of I-block b by 2^d_b and down's columns by 2^-d_b (h's blocks differ);
 * dy's column block b by 2^a_b and down's rows by 2^-a_b (dy's blocks, and y's and dx's column
 * blocks, differ). Then in every other token each 128-block of x and dy keeps one element and
 * shrinks the others by 2^-(4..18), so most of them land on E4M3 subnormals or zero next to it. */
static void spread_blocks(layer *L, uint64_t seed) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / L->nranks, B = MOK_FP8_BLOCK;
    uint64_t state = seed;
    int c[64], a[64], d[64], ds[64];
    for (int b = 0; b < 64; ++b) {
        c[b] = (int)(matrix_pick(&state) % 17) - 8;
        a[b] = (int)(matrix_pick(&state) % 17) - 8;
        d[b] = (int)(matrix_pick(&state) % 17) - 8;
        ds[b] = (int)(matrix_pick(&state) % 17) - 8;
    }
    for (int p = 0; p < L->nranks; ++p) {
        for (int64_t t = 0; t < L->num_tokens[p]; ++t)
            for (int64_t h = 0; h < H; ++h) {
                L->x[p][t * H + h] = scaled_bf16(L->x[p][t * H + h], c[h / B]);
                L->dy[p][t * H + h] = scaled_bf16(L->dy[p][t * H + h], a[h / B]);
            }
        for (int64_t e = 0; e < El; ++e)
            for (int64_t i = 0; i < I; ++i)
                for (int64_t h = 0; h < H; ++h) {
                    const int64_t gu = e * I * H + i * H + h, dn = e * H * I + h * I + i;
                    L->w[LAYER_GATE][p][gu] = scaled_bf16(L->w[LAYER_GATE][p][gu], -c[h / B]);
                    L->w[LAYER_UP][p][gu] = scaled_bf16(L->w[LAYER_UP][p][gu], d[i / B] - c[h / B]);
                    L->w[LAYER_DOWN][p][dn] = scaled_bf16(L->w[LAYER_DOWN][p][dn], -d[i / B] - a[h / B]);
                }
        for (int64_t t = 1; t < L->num_tokens[p]; t += 2)
            for (int64_t b = 0; b < H / B; ++b) {
                const int64_t keep = (int64_t)(matrix_pick(&state) % B);
                const int shrink_x = 4 + (int)(matrix_pick(&state) % 15), shrink_dy = 4 + (int)(matrix_pick(&state) % 15);
                for (int64_t h = b * B; h < (b + 1) * B; ++h)
                    if (h != b * B + keep) {
                        L->x[p][t * H + h] = scaled_bf16(L->x[p][t * H + h], -shrink_x);
                        L->dy[p][t * H + h] = scaled_bf16(L->dy[p][t * H + h], -shrink_dy);
                    }
            }
    }
    for (int64_t i = 0; i < Is; ++i)
        for (int64_t h = 0; h < H; ++h) {
            L->s[LAYER_GATE][i * H + h] = scaled_bf16(L->s[LAYER_GATE][i * H + h], -c[h / B]);
            L->s[LAYER_UP][i * H + h] = scaled_bf16(L->s[LAYER_UP][i * H + h], ds[i / B] - c[h / B]);
            L->s[LAYER_DOWN][h * Is + i] = scaled_bf16(L->s[LAYER_DOWN][h * Is + i], -ds[i / B] - a[h / B]);
        }
}

/* The layers the cuda tests call exact (gpu_layer.h: every GEMM's block sums exact in fp32, token
 * rows steered off the bf16 ties of h, dg, du that E4M3 would see) hold the cpu's rows on the cpu
 * backend too: the steering is checked where CI runs, and a row it missed shows as an error here. */
static void exact_case(const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                       float limit) {
    layer L;
    const int made = gpu_fp8_layer(&L, shape, P, tokens, case_seed(name), routing, limit, GPU_FP8_EXACT);
    CHECK(made == 0, "%s: %s", name, made < 0 ? "layer_make failed" : "exact rows left at a tie");
    if (made < 0) return;
    const mok_config config = matrix_config();
    check_layer(name, &L, &config, MATRIX_BF16_GRADS);
    layer_free(&L);
}

MOK_TEST(cpu_fp8_exact_layers) {
    const int quick = mok_test_quick();
    const int64_t t1[1] = {quick ? 96 : 300}, t2[2] = {quick ? 40 : 120, quick ? 17 : 61};
    const mok_shape wide_shared = fp8_shape(128, 128, 4, 1, 384);
    exact_case("fp8 exact k = 1, wide shared expert", &wide_shared, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f);
    const mok_shape s = fp8_shape(256, 256, 8, 2, 128);
    exact_case("fp8 exact skewed, 2 ranks", &s, 2, t2, LAYER_ROUTE_SKEWED, 0.0f);
    exact_case("fp8 exact clamp, -1 slots, weights <= 0", &s, 2, t2, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.5f);
}

MOK_TEST(cpu_fp8_outliers) {
    const mok_config config = matrix_config();
    const int64_t t4[] = {41, 36, 29, 47};
    const mok_shape s = fp8_shape(384, 256, 8, 2, 256);
    const char *name = "fp8 blocks spanning 2^-26 .. 2^8";
    layer L;
    if (layer_make(&L, &s, 4, t4, case_seed(name), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    spread_blocks(&L, L.seed ^ 0x6f75746cull);
    /* the case must hold what it is named for: many of x's E4M3 values are subnormal or zero */
    int64_t tiny = 0, total = 0;
    for (int64_t t = 1; t < t4[0]; t += 2)
        for (int64_t b = 0; b < s.hidden / MOK_FP8_BLOCK; ++b) {
            float amax = 0.0f;
            for (int64_t h = 0; h < MOK_FP8_BLOCK; ++h)
                amax = fmaxf(amax, fabsf(mok_bf16_to_float(L.x[0][t * s.hidden + b * MOK_FP8_BLOCK + h])));
            for (int64_t h = 0; h < MOK_FP8_BLOCK; ++h, ++total)
                tiny += fabsf(mok_bf16_to_float(L.x[0][t * s.hidden + b * MOK_FP8_BLOCK + h])) < amax * 0x1p-6f;
        }
    CHECK(tiny * 4 > total, "%s: only %lld of %lld values sit below 2^-6 of their block's amax", name, (long long)tiny,
          (long long)total);
    layer_result ref = {0};
    mok_status st = layer_run_reference(&L, &ref);
    CHECK(st == MOK_OK, "%s: reference failed: %s", name, ref.message);
    for (int accumulate = 0; st == MOK_OK && accumulate < 2; ++accumulate) {
        char tag[192];
        snprintf(tag, sizeof tag, "%s accumulate=%d MOK_TEST_SEED=%llu", name, accumulate, mok_test_seed());
        layer_result got = {0};
        mok_status bst = layer_run_backend(&L, &config, accumulate, &got);
        CHECK(bst == MOK_OK, "%s: %s", tag, got.message);
        if (bst == MOK_OK) {
            double err = layer_compare_columns(&L, &got, &ref, MOK_FP8_BLOCK, tag);
            CHECK(err <= 1.0, "%s: worst normalized error %.3g > 1 (each 128-column block at its own scale)", tag, err);
        }
        layer_result_free(&got);
    }
    layer_result_free(&ref);
    layer_free(&L);
}

/* ---- NaN and Inf ------------------------------------------------------------------------------ */

static int row_equal(const uint16_t *a, const uint16_t *b, int64_t t, int64_t H) {
    return memcmp(a + t * H, b + t * H, (size_t)H * 2) == 0;
}

/* One non-finite value, in x (rank bad_rank) or in one expert's weight: the pass returns MOK_OK;
 * the tokens it cannot reach keep their outputs bit for bit, and so do the experts it cannot reach
 * their gradients; where it lands the outputs are NaN (an Inf becomes NaN in E4M3: nothing turns it
 * into a finite value, nor keeps it an infinity) and agree with the reference. */
static void nonfinite_case(const char *name, uint16_t bad_bits, int bad_rank, int in_weight) {
    const mok_config config = matrix_config();
    const int P = 4;
    const int64_t t4[] = {40, 33, 47, 25};
    const mok_shape s = fp8_shape(128, 128, 8, 2, 128);
    layer L;
    if (layer_make(&L, &s, P, t4, case_seed(name), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    const int64_t H = s.hidden, I = s.intermediate, k = s.topk, El = s.num_experts / P, per = I * H;
    uint64_t state = L.seed;
    const int64_t bad_token = (int64_t)(matrix_pick(&state) % (uint64_t)t4[bad_rank]);
    const int64_t bad_col = (int64_t)(matrix_pick(&state) % (uint64_t)H), bad_i = (int64_t)(matrix_pick(&state) % (uint64_t)I);
    const int bad_expert = (int)(bad_rank * El + (int64_t)(matrix_pick(&state) % (uint64_t)El)); /* global id */
    layer_result clean = {0}, dirty = {0}, ref = {0};
    mok_status st = layer_run_backend(&L, &config, 0, &clean);
    CHECK(st == MOK_OK, "%s: clean run failed: %s", name, clean.message);
    if (in_weight)
        L.w[LAYER_GATE][bad_rank][(bad_expert % El) * per + bad_i * H + bad_col] = bad_bits;
    else
        L.x[bad_rank][bad_token * H + bad_col] = bad_bits;
    mok_status dst = layer_run_backend(&L, &config, 0, &dirty);
    CHECK(dst == MOK_OK, "%s: the run with a non-finite value returned %s: %s", name, mok_status_string(dst),
          dirty.message);
    if (st == MOK_OK && dst == MOK_OK) {
        char tag[192];
        snprintf(tag, sizeof tag, "%s (rank %d token %lld expert %d col %lld) MOK_TEST_SEED=%llu", name, bad_rank,
                 (long long)bad_token, bad_expert, (long long)bad_col, mok_test_seed());
        int64_t reached_tokens = 0;
        for (int p = 0; p < P; ++p) {
            for (int64_t t = 0; t < L.num_tokens[p]; ++t) {
                int reached = !in_weight && p == bad_rank && t == bad_token;
                for (int64_t j = 0; in_weight && j < k; ++j) reached |= L.topk_ids[p][t * k + j] == bad_expert;
                if (reached) {
                    ++reached_tokens;
                    int64_t not_nan = 0;
                    for (int64_t h = 0; h < H; ++h) not_nan += !isnan(mok_bf16_to_float(dirty.y[p][t * H + h]));
                    CHECK(not_nan == 0, "%s: %lld elements of reached token (%d, %lld)'s y are not NaN", tag,
                          (long long)not_nan, p, (long long)t);
                    continue;
                }
                CHECK(row_equal(clean.y[p], dirty.y[p], t, H), "%s: y of rank %d token %lld changed", tag, p,
                      (long long)t);
                if (!in_weight) { /* a bad weight reaches every token through its expert's dx part */
                    CHECK(row_equal(clean.dx[p], dirty.dx[p], t, H), "%s: dx of rank %d token %lld changed", tag, p,
                          (long long)t);
                    CHECK(memcmp(clean.d_router_w[p] + t * k, dirty.d_router_w[p] + t * k, (size_t)k * 4) == 0,
                          "%s: d_router_w of rank %d token %lld changed", tag, p, (long long)t);
                }
            }
            for (int64_t e = 0; e < El; ++e) {
                int reached = in_weight ? p * El + e == bad_expert : 0;
                for (int64_t j = 0; !in_weight && j < k; ++j)
                    reached |= L.topk_ids[bad_rank][bad_token * k + j] == p * El + e;
                if (reached) continue;
                for (int m = 0; m < 3; ++m)
                    CHECK(memcmp((uint16_t *)clean.dw[m][p] + e * per, (uint16_t *)dirty.dw[m][p] + e * per,
                                 (size_t)per * 2) == 0,
                          "%s: gradient %d of expert %lld, which the bad value does not reach, changed", tag, m,
                          (long long)(p * El + e));
            }
        }
        CHECK(reached_tokens > 0, "%s: the bad value reaches no token; the case tests nothing", tag);
        st = layer_run_reference(&L, &ref);
        CHECK(st == MOK_OK, "%s: reference failed: %s", tag, ref.message);
        if (st == MOK_OK) {
            double err = layer_compare(&L, &dirty, &ref, tag);
            CHECK(err <= 1.0, "%s: worst normalized error %.3g > 1 (layer seed %llu)", tag, err,
                  (unsigned long long)L.seed);
        }
    }
    layer_result_free(&clean);
    layer_result_free(&dirty);
    layer_result_free(&ref);
    layer_free(&L);
}

MOK_TEST(cpu_fp8_nonfinite) {
    nonfinite_case("fp8 NaN in x", 0x7fc0, 0, 0);
    nonfinite_case("fp8 +Inf in x", 0x7f80, 2, 0);
    nonfinite_case("fp8 -Inf in x", 0xff80, 1, 0);
    nonfinite_case("fp8 NaN in a gate weight", 0x7fc0, 3, 1);
    nonfinite_case("fp8 +Inf in a gate weight", 0x7f80, 1, 1);
}

/* ---- the recomputed context --------------------------------------------------------------------- */

MOK_TEST(cpu_fp8_recompute_context) {
    const mok_shape s = fp8_shape(128, 128, 6, 2, 128);
    const int64_t t3[] = {60, 45, 80};
    for (int variant = 0; variant < 2; ++variant) {
        mok_config config = matrix_config();
        config.ring_rows = variant ? 128 : 512;
        config.context_rows = variant ? 128 : 0;
        char name[96];
        snprintf(name, sizeof name, "fp8 recompute, ring %d context_rows %lld", config.ring_rows,
                 (long long)config.context_rows);
        layer L;
        if (layer_make(&L, &s, 3, t3, case_seed(name), LAYER_ROUTE_SKEWED) != 0) {
            CHECK(0, "%s: layer_make failed", name);
            layer_free(&L);
            continue;
        }
        layer_backend B;
        layer_result r = {0}, ref = {0};
        mok_status st = layer_backend_open(&B, &L, &config);
        CHECK(st == MOK_OK, "%s: %s", name, B.message);
        if (st == MOK_OK) st = layer_backend_forward(&B, &L, &r);
        CHECK(st == MOK_OK, "%s: forward: %s", name, r.message);
        void *ctx[3] = {0};
        if (st == MOK_OK) {
            mok_forward_args args[3];
            layer_forward_args(&L, &r, args);
            for (int p = 0; p < 3; ++p) {
                ctx[p] = alloc_aligned(r.context_bytes);
                for (size_t i = 0; i < r.context_bytes / 2; ++i) ((uint16_t *)ctx[p])[i] = LAYER_POISON_BF16;
                args[p].context = ctx[p];
                args[p].y = NULL;
            }
            st = mok_recompute_context(B.workspace, args);
            CHECK(st == MOK_OK, "%s: mok_recompute_context: %s", name, mok_last_error());
            for (int p = 0; st == MOK_OK && p < 3; ++p)
                CHECK(memcmp(ctx[p], r.context[p], r.context_bytes) == 0,
                      "%s: rank %d's recomputed context differs from the forward's", name, p);
            for (int p = 0; p < 3; ++p) { /* the backward from the recomputed context */
                void *t = r.context[p];
                r.context[p] = ctx[p];
                ctx[p] = t;
            }
            if (st == MOK_OK) st = layer_backend_backward(&B, &L, 0, &r);
            CHECK(st == MOK_OK, "%s: backward: %s", name, r.message);
            if (st == MOK_OK && layer_run_reference(&L, &ref) == MOK_OK) {
                char tag[160];
                snprintf(tag, sizeof tag, "%s MOK_TEST_SEED=%llu", name, mok_test_seed());
                double err = layer_compare(&L, &r, &ref, tag);
                CHECK(err <= 1.0, "%s: worst normalized error %.3g > 1", tag, err);
            }
        }
        layer_backend_close(&B);
        for (int p = 0; p < 3; ++p) free(ctx[p]);
        layer_result_free(&r);
        layer_result_free(&ref);
        layer_free(&L);
    }
}

/* ---- memory ------------------------------------------------------------------------------------- */

/* An FP8 workspace holds no more than the bf16 one of the same shape and config: the same schedule
 * and context, less symmetric memory and less in all (x and its ring travel as E4M3). */
MOK_TEST(cpu_fp8_memory) {
    const struct {
        int64_t H, I, E, k, Is, T;
        int ring, threads;
    } cases[] = {
        {128, 128, 4, 2, 0, 1, 128, 2},
        {128, 2048, 8, 2, 2048, 3, 128, 16},
        {2048, 768, 128, 8, 0, 4096, 32768, 0},
        {1024, 512, 16, 4, 512, 700, 2048, 5},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        mok_config config = matrix_config();
        config.ring_rows = cases[c].ring;
        config.minibatch_rows = 128;
        config.cpu_threads = cases[c].threads;
        mok_sizes sizes[2];
        for (int precision = 0; precision < 2; ++precision) {
            mok_shape s = {cases[c].H, cases[c].I, cases[c].E, cases[c].k, cases[c].Is, cases[c].T, precision};
            mok_group *g = NULL;
            mok_workspace *ws = NULL;
            mok_status st = mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &config);
            if (st == MOK_OK) st = mok_workspace_create(&ws, g, &s, &config);
            if (st == MOK_OK) st = mok_workspace_sizes(ws, &sizes[precision]);
            CHECK(st == MOK_OK, "case %zu precision %d: %s", c, precision, mok_last_error());
            mok_workspace_destroy(ws);
            mok_group_destroy(g);
            if (st != MOK_OK) return;
        }
        const mok_sizes *b = &sizes[MOK_PRECISION_BF16], *f = &sizes[MOK_PRECISION_FP8];
        CHECK(f->schedule_bytes == b->schedule_bytes && f->context_bytes == b->context_bytes &&
                  f->max_routed_rows == b->max_routed_rows,
              "case %zu: FP8 schedule %zu / context %zu bytes, bf16 %zu / %zu", c, f->schedule_bytes, f->context_bytes,
              b->schedule_bytes, b->context_bytes);
        CHECK(f->symmetric_bytes < b->symmetric_bytes && f->workspace_bytes < b->workspace_bytes,
              "case %zu: FP8 symmetric %zu, all %zu bytes; bf16 %zu, %zu", c, f->symmetric_bytes, f->workspace_bytes,
              b->symmetric_bytes, b->workspace_bytes);
    }
}

/* ---- the FP8 function, not the bf16 one ------------------------------------------------------- */

/* Sum of |got - ref| and of |ref| over the finite reference values of one tensor (got bf16 or fp32,
 * init subtracted when given; ref bf16 or fp32). */
static void l1(const void *got, int got_f32, const float *init, const void *ref, int ref_f32, int64_t n, double *err,
               double *mass) {
    for (int64_t i = 0; i < n; ++i) {
        double g = got_f32 ? ((const float *)got)[i] : mok_bf16_to_float(((const uint16_t *)got)[i]);
        const double r = ref_f32 ? ((const float *)ref)[i] : mok_bf16_to_float(((const uint16_t *)ref)[i]);
        if (init) g -= init[i];
        if (!isfinite(r)) continue;
        *err += fabs(g - r);
        *mass += fabs(r);
    }
}

/* Relative L1 distance of got from ref per tensor: y, dx, d_router_w, dw_gate, dw_up, dw_down. */
static void distances(const layer *L, const layer_result *got, const layer_result *ref, double *out) {
    const int64_t H = L->shape.hidden, k = L->shape.topk,
                  n = L->shape.num_experts / L->nranks * L->shape.intermediate * H;
    double err[6] = {0}, mass[6] = {0};
    for (int p = 0; p < L->nranks; ++p) {
        const int64_t T = L->num_tokens[p];
        l1(got->y[p], 0, NULL, ref->y[p], 0, T * H, &err[0], &mass[0]);
        l1(got->dx[p], 0, NULL, ref->dx[p], 0, T * H, &err[1], &mass[1]);
        l1(got->d_router_w[p], 1, NULL, ref->d_router_w[p], 1, T * k, &err[2], &mass[2]);
        for (int m = 0; m < 3; ++m)
            l1(got->dw[m][p], 1, got->dw_init[m][p], ref->dw[m][p], 1, n, &err[3 + m], &mass[3 + m]);
    }
    for (int t = 0; t < 6; ++t) out[t] = err[t] / mass[t];
}

/* Every quantization point moves the function by E4M3 noise (2^-4 of a value, relative, at worst),
 * the reference computes it at the same points, and the backend's own noise against it is fp32
 * rounding and the rare flip: so the backend must sit far closer to the FP8 reference than to the
 * bf16 function, tensor by tensor (about 1e-7 against 6e-2). One quantization point left out (h,
 * dg and du, or dy unquantized in a GEMM, or h instead of h^ in dW_down) measured 1.4e-2 to 2.8e-2
 * from the FP8 reference, within a factor of two to five of the bf16 distance. The
 * distances are printed: they are the FP8 function's distance from the bf16 one, as the backend
 * sees it. */
MOK_TEST(cpu_fp8_is_the_fp8_function) {
    const mok_config config = matrix_config();
    const int64_t t4[] = {40, 35, 44, 29};
    const mok_shape s = fp8_shape(256, 256, 8, 3, 128);
    const char *name = "fp8 against both references";
    layer L;
    if (layer_make(&L, &s, 4, t4, case_seed(name), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    layer Lb = L; /* the same arrays as a bf16 layer: the reference of the unquantized function */
    Lb.shape.precision = MOK_PRECISION_BF16;
    layer_result got = {0}, ref8 = {0}, ref16 = {0};
    mok_status st = layer_run_backend(&L, &config, 1, &got);
    CHECK(st == MOK_OK, "%s: %s", name, got.message);
    if (st == MOK_OK) st = layer_run_reference(&L, &ref8);
    if (st == MOK_OK) st = layer_run_reference(&Lb, &ref16);
    CHECK(st == MOK_OK, "%s: references: %s %s", name, ref8.message, ref16.message);
    if (st == MOK_OK) {
        static const char *names[6] = {"y", "dx", "d_router_w", "dw_gate", "dw_up", "dw_down"};
        double d8[6], d16[6];
        distances(&L, &got, &ref8, d8);
        distances(&L, &got, &ref16, d16);
        printf("     relative L1 distance of the FP8 backend from the FP8 reference / from the bf16 function:\n");
        for (int t = 0; t < 6; ++t) {
            printf("       %-10s %.2e / %.2e\n", names[t], d8[t], d16[t]);
            CHECK(d8[t] * 8.0 < d16[t],
                  "%s: %s is %.3g from the FP8 reference and %.3g from the bf16 function: "
                  "not the FP8 function (MOK_TEST_SEED=%llu)",
                  name, names[t], d8[t], d16[t], mok_test_seed());
            CHECK(d16[t] > 4e-3, "%s: %s is only %.3g from the bf16 function: is anything quantized?", name, names[t],
                  d16[t]);
        }
    }
    layer_result_free(&got);
    layer_result_free(&ref8);
    layer_result_free(&ref16);
    layer_free(&L);
}

/* ---- argument rules ---------------------------------------------------------------------------- */

static void expect(mok_status got, mok_status want, const char *needle, const char *what) {
    const char *msg = mok_last_error();
    CHECK(got == want, "%s: status %s, want %s (message '%s')", what, mok_status_string(got), mok_status_string(want),
          msg);
    CHECK(msg && strstr(msg, needle), "%s: message '%s' does not name '%s'", what, msg, needle);
}

/* Every rule of the FP8 arguments broken once, on a workspace that then still runs a good pass:
 * fp8_weights required (and checked) iff the workspace is FP8, aligned, written by
 * mok_quantize_weights for this shape; mok_quantize_weights' own arguments; the layout call. */
MOK_TEST(cpu_fp8_argument_rules) {
    const mok_config config = matrix_config();
    const mok_shape s = fp8_shape(128, 128, 4, 2, 128);
    const int64_t t2[] = {24, 17};
    layer L;
    if (layer_make(&L, &s, 2, t2, case_seed("fp8 argument rules"), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "layer_make failed");
        layer_free(&L);
        return;
    }
    layer_backend B;
    layer_result r = {0};
    mok_status st = layer_backend_open(&B, &L, &config);
    CHECK(st == MOK_OK, "open: %s", B.message);
    if (st == MOK_OK) st = layer_backend_run(&B, &L, 0, &r); /* schedule, context, FP8 weights, outputs */
    CHECK(st == MOK_OK, "forward and backward: %s", r.message);
    if (st != MOK_OK) {
        layer_backend_close(&B);
        layer_result_free(&r);
        layer_free(&L);
        return;
    }
    mok_fp8_layout layout;
    expect(mok_workspace_fp8_layout(NULL, &layout), MOK_ERR_INVALID_ARGUMENT, "workspace", "layout of NULL");
    expect(mok_workspace_fp8_layout(B.workspace, NULL), MOK_ERR_INVALID_ARGUMENT, "layout", "NULL layout");
    CHECK(mok_workspace_fp8_layout(B.workspace, &layout) == MOK_OK && layout.bytes == r.fp8_bytes, "layout: %s",
          mok_last_error());

    /* mok_quantize_weights */
    void *spare = aligned_alloc(64, (layout.bytes + 63) / 64 * 64);
    uint16_t dummy[64] __attribute__((aligned(16))) = {0};
    mok_quantize_args q[2];
    for (int p = 0; p < 2; ++p)
        q[p] = (mok_quantize_args){L.w[LAYER_GATE][p],
                                   L.w[LAYER_UP][p],
                                   L.w[LAYER_DOWN][p],
                                   L.s[LAYER_GATE],
                                   L.s[LAYER_UP],
                                   L.s[LAYER_DOWN],
                                   spare,
                                   NULL};
    expect(mok_quantize_weights(B.workspace, NULL), MOK_ERR_INVALID_ARGUMENT, "args", "quantize: NULL args");
    expect(mok_quantize_weights(NULL, q), MOK_ERR_INVALID_ARGUMENT, "workspace", "quantize: NULL workspace");
    q[1].w_down = NULL;
    expect(mok_quantize_weights(B.workspace, q), MOK_ERR_INVALID_ARGUMENT, "args[1].w_down", "quantize: no w_down");
    q[1].w_down = L.w[LAYER_DOWN][1];
    q[0].s_up = NULL;
    expect(mok_quantize_weights(B.workspace, q), MOK_ERR_INVALID_ARGUMENT, "args[0].s_up", "quantize: no s_up");
    q[0].s_up = L.s[LAYER_UP];
    q[1].fp8_weights = NULL;
    expect(mok_quantize_weights(B.workspace, q), MOK_ERR_INVALID_ARGUMENT, "args[1].fp8_weights",
           "quantize: no output");
    q[1].fp8_weights = (char *)spare + 8;
    expect(mok_quantize_weights(B.workspace, q), MOK_ERR_INVALID_ARGUMENT, "aligned", "quantize: misaligned output");
    q[1].fp8_weights = spare;
    q[0].w_gate = (const char *)L.w[LAYER_GATE][0] + 2;
    expect(mok_quantize_weights(B.workspace, q), MOK_ERR_INVALID_ARGUMENT, "args[0].w_gate",
           "quantize: misaligned w_gate");
    q[0].w_gate = L.w[LAYER_GATE][0];

    /* the passes */
    mok_forward_args f[2];
    mok_backward_args b[2];
    layer_forward_args(&L, &r, f);
    f[1].fp8_weights = NULL;
    expect(mok_forward(B.workspace, f), MOK_ERR_INVALID_ARGUMENT, "args[1].fp8_weights", "forward without FP8 weights");
    layer_forward_args(&L, &r, f);
    f[0].fp8_weights = (const char *)r.fp8_weights[0] + 4;
    expect(mok_forward(B.workspace, f), MOK_ERR_INVALID_ARGUMENT, "args[0].fp8_weights", "forward, misaligned weights");
    memset(spare, 0, layout.bytes); /* the right size, never quantized */
    layer_forward_args(&L, &r, f);
    f[1].fp8_weights = spare;
    expect(mok_recompute_context(B.workspace, f), MOK_ERR_INVALID_ARGUMENT, "not written by mok_quantize_weights",
           "recompute with an unwritten buffer");
    layer_backward_args(&L, &r, 0, b);
    b[0].fp8_weights = NULL;
    expect(mok_backward(B.workspace, b), MOK_ERR_INVALID_ARGUMENT, "args[0].fp8_weights",
           "backward without FP8 weights");

    /* weights quantized for another shape (no shared expert) */
    {
        mok_shape other = s;
        other.shared_intermediate = 0;
        other.max_tokens = B.shape.max_tokens;
        mok_group *g = NULL;
        mok_workspace *ws = NULL;
        mok_status ost = mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &config);
        if (ost == MOK_OK) ost = mok_workspace_create(&ws, g, &other, &config);
        CHECK(ost == MOK_OK, "the other workspace: %s", mok_last_error());
        if (ost == MOK_OK) {
            mok_quantize_args oq[2];
            for (int p = 0; p < 2; ++p) oq[p] = q[p], oq[p].s_gate = oq[p].s_up = oq[p].s_down = NULL;
            oq[0].s_gate = dummy;
            expect(mok_quantize_weights(ws, oq), MOK_ERR_INVALID_ARGUMENT, "args[0].s_gate",
                   "quantize: shared weights for a layer without a shared expert");
            oq[0].s_gate = NULL;
            CHECK(mok_quantize_weights(ws, oq) == MOK_OK, "quantize for the other shape: %s", mok_last_error());
            layer_forward_args(&L, &r, f);
            f[1].fp8_weights = spare;
            expect(mok_forward(B.workspace, f), MOK_ERR_INVALID_ARGUMENT, "not written by mok_quantize_weights",
                   "forward with weights quantized for another shape");
        }
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
    }
    /* a bf16 workspace takes no FP8 weights */
    {
        mok_shape bf16 = B.shape;
        bf16.precision = MOK_PRECISION_BF16;
        mok_group *g = NULL;
        mok_workspace *ws = NULL;
        mok_status bst = mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &config);
        if (bst == MOK_OK) bst = mok_workspace_create(&ws, g, &bf16, &config);
        CHECK(bst == MOK_OK, "the bf16 workspace: %s", mok_last_error());
        if (bst == MOK_OK) {
            expect(mok_workspace_fp8_layout(ws, &layout), MOK_ERR_INVALID_ARGUMENT, "precision", "bf16 layout");
            expect(mok_quantize_weights(ws, q), MOK_ERR_INVALID_ARGUMENT, "precision", "bf16 quantize");
            layer_forward_args(&L, &r, f);
            expect(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].fp8_weights: must be NULL",
                   "bf16 forward given FP8 weights");
        }
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
    }
    free(spare);
    /* the FP8 workspace still runs a good pass, right */
    layer_result good = {0}, ref = {0};
    st = layer_backend_run(&B, &L, 0, &good);
    CHECK(st == MOK_OK, "the good run after the rules: %s", good.message);
    if (st == MOK_OK && layer_run_reference(&L, &ref) == MOK_OK)
        CHECK(layer_compare(&L, &good, &ref, "fp8 after the argument rules") <= 1.0, "the good run is wrong");
    layer_result_free(&good);
    layer_result_free(&ref);
    layer_result_free(&r);
    layer_backend_close(&B);
    layer_free(&L);
}
