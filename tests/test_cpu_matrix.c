/* test_cpu_matrix.c — the cpu backend against the reference over a matrix of layers: every preset
 * scaled down, token counts (0, uneven), routings (one expert, empty experts, -1 slots, skewed,
 * encoded), ring and context sizes that force several macrobatches and replay, 1 to 8 ranks,
 * the shared expert and the SwiGLU clamp, signed router weights, NaN/Inf inputs, both gradient
 * modes; then determinism (bitwise, across runs and configs) and the recomputed context.
 *
 * Every case derives its layer seed from MOK_TEST_SEED and its name; a failing check prints the
 * case, MOK_TEST_SEED and the layer seed, so `MOK_TEST_SEED=N ./build/mok_tests cpu_` replays it.
 * MOK_TEST_QUICK=1 (sanitizer runs) shrinks the matrix. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/schedule.h"
#include "determinism.h"
#include "layer.h"
#include "matrix.h"
#include "test.h"

#define ROW_TILE MOK_ROW_TILE

static mok_shape make_shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is) {
    mok_shape s = {H, I, E, k, Is, 0, MOK_PRECISION_BF16};
    return s;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static uint64_t case_seed(const char *name) { return matrix_case_seed(name, 0); }

/* ---- checks shared by every case ---------------------------------------------------------- */

/* mok_schedule_read of every rank against the counts the ids imply. */
static void check_schedule_info(const char *tag, const layer *L, const mok_config *config, const layer_result *r) {
    const int64_t El = L->shape.num_experts / L->nranks;
    int64_t *rows = malloc((size_t)L->shape.num_experts * sizeof *rows);
    matrix_expert_rows(L, rows);
    for (int q = 0; q < L->nranks; ++q) {
        int64_t routed = 0, padded = 0, busiest = 0;
        for (int64_t e = q * El; e < (q + 1) * El; ++e) {
            routed += rows[e];
            padded += ceil_div(rows[e], ROW_TILE) * ROW_TILE;
            if (rows[e] > busiest) busiest = rows[e];
        }
        const mok_schedule_info *info = &r->info[q];
        for (int p = 0; p < L->nranks; ++p)
            CHECK(info->num_tokens[p] == L->num_tokens[p], "%s: rank %d's schedule says rank %d has %lld tokens, not %lld",
                  tag, q, p, (long long)info->num_tokens[p], (long long)L->num_tokens[p]);
        CHECK(info->routed_rows == routed && info->padded_rows == padded && info->max_expert_rows == busiest,
              "%s: rank %d schedule routed/padded/busiest %lld/%lld/%lld, want %lld/%lld/%lld", tag, q,
              (long long)info->routed_rows, (long long)info->padded_rows, (long long)info->max_expert_rows,
              (long long)routed, (long long)padded, (long long)busiest);
        CHECK(info->num_minibatches == ceil_div(padded, config->minibatch_rows) &&
                  info->num_macrobatches == ceil_div(padded, config->ring_rows),
              "%s: rank %d schedule has %lld minibatches and %lld macrobatches for %lld padded rows", tag, q,
              (long long)info->num_minibatches, (long long)info->num_macrobatches, (long long)padded);
    }
    free(rows);
}

/* The shared case run (matrix.h), each backend run's schedule info checked too. */
static void check_layer(const char *tag, const layer *L, const mok_config *config, int modes) {
    matrix_check_layer(tag, L, config, modes, check_schedule_info);
}

static void run_case(const char *name, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                     float limit, const mok_config *config, int modes) {
    matrix_run_case(name, case_seed(name), shape, P, tokens, routing, limit, config, modes, check_schedule_info);
}

/* Token counts lo + [0, span] per rank, from the case's seed. */
static void random_tokens(const char *name, int P, int64_t lo, int64_t span, int64_t *tokens) {
    uint64_t state = case_seed(name) ^ 0x746f6b656e73ull;
    for (int p = 0; p < P; ++p) tokens[p] = lo + (int64_t)(matrix_pick(&state) % (uint64_t)(span + 1));
}

/* ---- presets ------------------------------------------------------------------------------ */

/* The table of tools/presets.c (H, I, E, k, I_s), scaled the way `mok run --scale` does. */
static const struct {
    const char *name;
    int64_t H, I, E, k, Is;
} presets[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 0},      {"qwen3-235b-a22b", 4096, 1536, 128, 8, 0},
    {"deepseek-v3", 7168, 2048, 256, 8, 2048},    {"kimi-k2", 7168, 2048, 384, 8, 2048},
    {"glm-4.5", 5120, 1536, 160, 8, 1536},        {"mixtral-8x7b", 4096, 14336, 8, 2, 0},
    {"olmoe-1b-7b", 2048, 1024, 64, 8, 0},        {"kimi-k2.7", 7168, 2048, 384, 8, 2048},
    {"glm-5.2", 6144, 2048, 256, 8, 2048},        {"qwen3.5-397b-a17b", 4096, 1024, 512, 10, 1024},
    {"deepseek-v4-pro", 7168, 3072, 384, 6, 3072},
};

/* The nearest multiple of unit to value / scale, at least one unit. */
static int64_t scaled(int64_t value, double scale, int64_t unit) {
    double units = nearbyint((double)value / scale / (double)unit);
    return (units < 1.0 ? 1 : (int64_t)units) * unit;
}

MOK_TEST(cpu_presets) {
    const int quick = mok_test_quick();
    const int P = quick ? 2 : 4;
    const double scale = 16.0;
    mok_config config = matrix_config();
    config.ring_rows = 512;
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; ++i) {
        mok_shape s = make_shape(scaled(presets[i].H, scale, MOK_DIM_TILE), scaled(presets[i].I, scale, MOK_DIM_TILE),
                                 scaled(presets[i].E, scale, P), presets[i].k,
                                 presets[i].Is ? scaled(presets[i].Is, scale, MOK_DIM_TILE) : 0);
        if (s.topk > s.num_experts) s.topk = s.num_experts;
        char name[96];
        snprintf(name, sizeof name, "preset %s /16 P=%d", presets[i].name, P);
        int64_t tokens[MOK_MAX_RANKS];
        random_tokens(name, P, quick ? 16 : 32, quick ? 16 : 32, tokens);
        /* accumulate mode on every other preset keeps the file's time in bounds */
        run_case(name, &s, P, tokens, LAYER_ROUTE_UNIFORM, 0.0f, &config, i % 2 ? MATRIX_BOTH_MODES : MATRIX_BF16_GRADS);
    }
}

/* ---- edge cases --------------------------------------------------------------------------- */

MOK_TEST(cpu_edge_tokens) {
    const mok_config config = matrix_config();
    const mok_shape s = make_shape(128, 64, 8, 2, 64);
    {
        const int64_t t[] = {0, 40, 0, 17};
        run_case("T = 0 on ranks 0 and 2", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        const int64_t t[] = {0, 0, 0, 0};
        run_case("T = 0 on every rank", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        const int64_t t[] = {1, 130, 7, 64}; /* 130: two token tiles of the shared expert */
        run_case("uneven T 1/130/7/64", &s, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        const int64_t t[] = {50, 0, 0, 0};
        run_case("only rank 0 has tokens", &s, 4, t, LAYER_ROUTE_SKEWED, 0.0f, &config, MATRIX_BF16_GRADS);
    }
    {
        /* T below T_max: the workspace is sized for more tokens than any rank has */
        mok_shape big = s;
        big.max_tokens = 200;
        const int64_t t[] = {33, 21, 45, 9};
        run_case("T < T_max", &big, 4, t, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BF16_GRADS);
    }
}

MOK_TEST(cpu_edge_routing) {
    const int quick = mok_test_quick();
    const mok_config config = matrix_config();
    const int64_t T = quick ? 24 : 48;
    const int64_t t4[] = {T, T - 5, T + 3, T - 11};
    {
        mok_shape s = make_shape(128, 64, 8, 1, 0);
        run_case("k = 1", &s, 4, t4, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        mok_shape s = make_shape(128, 64, 4, 2, 64);
        run_case("one local expert (E = P = 4), k = 2", &s, 4, t4, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BOTH_MODES);
        s.topk = 4;
        run_case("one local expert, k = E = 4", &s, 4, t4, LAYER_ROUTE_UNIFORM, 0.0f, &config, MATRIX_BF16_GRADS);
    }
    {
        /* P*T*k rows, all to one expert: several macrobatches of one expert (ring 256) */
        mok_shape s = make_shape(128, 64, 8, 3, 0);
        run_case("every slot to one expert", &s, 4, t4, LAYER_ROUTE_ONE_EXPERT, 0.0f, &config, MATRIX_BOTH_MODES);
    }
    {
        mok_shape s = make_shape(128, 64, 12, 3, 64);
        run_case("even experts only (odd ones empty)", &s, 4, t4, LAYER_ROUTE_EVEN, 0.0f, &config, MATRIX_BOTH_MODES);
        run_case("-1 slots", &s, 4, t4, LAYER_ROUTE_HOLES, 0.0f, &config, MATRIX_BOTH_MODES);
        s.shared_intermediate = 0;
        run_case("-1 slots, no shared expert", &s, 4, t4, LAYER_ROUTE_HOLES, 0.0f, &config, MATRIX_BF16_GRADS);
        run_case("skewed", &s, 4, t4, LAYER_ROUTE_SKEWED, 0.0f, &config, MATRIX_BF16_GRADS);
        run_case("encoded", &s, 4, t4, LAYER_ROUTE_UNIFORM | LAYER_ENCODED, 0.0f, &config, MATRIX_BOTH_MODES);
        run_case("encoded, one expert", &s, 4, t4, LAYER_ROUTE_ONE_EXPERT | LAYER_ENCODED, 0.0f, &config, MATRIX_BF16_GRADS);
        run_case("encoded, -1 slots", &s, 4, t4, LAYER_ROUTE_HOLES | LAYER_ENCODED, 0.0f, &config, MATRIX_BF16_GRADS);
    }
}

/* A ring of one minibatch (several macrobatches per pass) and a context that keeps 128 rows
 * (the backward replays gate/up for the rest). */
MOK_TEST(cpu_edge_ring_and_replay) {
    const int quick = mok_test_quick();
    const mok_shape s = make_shape(128, 128, 8, 6, 64); /* ~170-190 rows per expert: 512 padded rows */
    const int64_t T = quick ? 56 : 64;
    const int64_t t4[] = {T, T + 9, T - 13, T + 20};
    mok_config small_ring = matrix_config();
    small_ring.minibatch_rows = 128;
    small_ring.ring_rows = 128;
    mok_config replay = matrix_config();
    replay.context_rows = 128;
    replay.ring_rows = 16384;
    mok_config both = small_ring;
    both.context_rows = 128;
    mok_config defaults = matrix_config();
    defaults.minibatch_rows = 1024;
    defaults.ring_rows = 16384;
    const struct {
        const char *name;
        const mok_config *config;
        int routing;
    } cases[] = {
        {"ring = minibatch = 128", &small_ring, LAYER_ROUTE_UNIFORM},
        {"ring 128, one expert", &small_ring, LAYER_ROUTE_ONE_EXPERT},
        {"context_rows 128", &replay, LAYER_ROUTE_UNIFORM},
        {"ring 128 and context_rows 128", &both, LAYER_ROUTE_SKEWED},
        {"ring 128 and context_rows 128, one expert", &both, LAYER_ROUTE_ONE_EXPERT},
        {"default minibatch and ring", &defaults, LAYER_ROUTE_UNIFORM},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        layer L;
        if (layer_make(&L, &s, 4, t4, case_seed(cases[i].name), cases[i].routing) != 0) {
            CHECK(0, "%s: layer_make failed", cases[i].name);
            layer_free(&L);
            continue;
        }
        check_layer(cases[i].name, &L, cases[i].config, MATRIX_BOTH_MODES);
        /* the case must really exercise what it is named for */
        layer_result r = {0};
        mok_status st = layer_run_backend(&L, cases[i].config, 0, &r);
        CHECK(st == MOK_OK, "%s: %s", cases[i].name, r.message);
        int64_t most_macro = 0, most_rows = 0;
        for (int p = 0; p < 4; ++p) {
            if (r.info[p].num_macrobatches > most_macro) most_macro = r.info[p].num_macrobatches;
            if (r.info[p].padded_rows > most_rows) most_rows = r.info[p].padded_rows;
        }
        if (cases[i].config->ring_rows == 128)
            CHECK(most_macro > 1, "%s: no rank has more than one macrobatch (most %lld)", cases[i].name,
                  (long long)most_macro);
        if (cases[i].config->context_rows == 128)
            CHECK(most_rows >= 3 * 128, "%s: only %lld padded rows, most rows are not replayed", cases[i].name,
                  (long long)most_rows);
        layer_result_free(&r);
        layer_free(&L);
    }
}

MOK_TEST(cpu_ranks) {
    const int quick = mok_test_quick();
    const mok_config config = matrix_config();
    const int sizes[] = {1, 2, 3, 5, 8};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        const int P = sizes[i];
        char name[64];
        snprintf(name, sizeof name, "P = %d", P);
        const int64_t E = P == 1 ? 4 : 2 * P;
        mok_shape s = make_shape(128, 64, E, E < 4 ? E : 4, i % 2 ? 64 : 0);
        int64_t tokens[MOK_MAX_RANKS];
        random_tokens(name, P, quick ? 8 : 20, quick ? 16 : 40, tokens);
        run_case(name, &s, P, tokens, LAYER_ROUTE_UNIFORM, 0.0f, &config, quick && P == 8 ? MATRIX_BF16_GRADS : MATRIX_BOTH_MODES);
    }
}

/* Fraction of the g and u values of rank 0's first tokens' experts that the clamp changes. */
static double clamp_fraction(const layer *L, int64_t tokens) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, k = L->shape.topk;
    const int64_t El = L->shape.num_experts / L->nranks;
    const double limit = L->swiglu_limit;
    int64_t clamped = 0, total = 0;
    for (int64_t t = 0; t < tokens && t < L->num_tokens[0]; ++t)
        for (int64_t j = 0; j < k; ++j) {
            int32_t e = L->topk_ids[0][t * k + j];
            if (e < 0) continue;
            const uint16_t *wg = L->w[LAYER_GATE][e / El] + (e % El) * I * H;
            const uint16_t *wu = L->w[LAYER_UP][e / El] + (e % El) * I * H;
            for (int64_t i = 0; i < I; ++i) {
                double g = 0.0, u = 0.0;
                for (int64_t h = 0; h < H; ++h) {
                    double x = mok_bf16_to_float(L->x[0][t * H + h]);
                    g += x * mok_bf16_to_float(wg[i * H + h]);
                    u += x * mok_bf16_to_float(wu[i * H + h]);
                }
                clamped += (g > limit) + (u > limit || u < -limit);
                total += 2;
            }
        }
    return total ? (double)clamped / (double)total : 0.0;
}

MOK_TEST(cpu_shared_and_clamp) {
    const mok_config config = matrix_config();
    const int64_t t4[] = {37, 52, 29, 44};
    for (int shared = 0; shared < 2; ++shared)
        for (int clamp = 0; clamp < 2; ++clamp) {
            char name[96];
            snprintf(name, sizeof name, "%s shared expert, %s", shared ? "with" : "without",
                     clamp ? "SwiGLU limit 0.5" : "no clamp");
            mok_shape s = make_shape(128, 128, 8, 2, shared ? 128 : 0);
            layer L;
            if (layer_make(&L, &s, 4, t4, case_seed(name), LAYER_ROUTE_UNIFORM) != 0) {
                CHECK(0, "%s: layer_make failed", name);
                layer_free(&L);
                continue;
            }
            L.swiglu_limit = clamp ? 0.5f : 0.0f;
            layer_avoid_clamp_flips(&L);
            if (clamp) {
                double f = clamp_fraction(&L, 8);
                CHECK(f > 0.15, "%s: only %.1f%% of g, u values are clamped; the case does not test the clamp", name,
                      100.0 * f);
            }
            check_layer(name, &L, &config, MATRIX_BOTH_MODES);
            layer_free(&L);
        }
}

MOK_TEST(cpu_router_weights) {
    const mok_config config = matrix_config();
    const int64_t t4[] = {45, 38, 51, 30};
    const mok_shape s = make_shape(128, 64, 8, 3, 64);
    const int routings[] = {LAYER_ROUTE_UNIFORM | LAYER_SIGNED_WEIGHTS, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS,
                            LAYER_ROUTE_ONE_EXPERT | LAYER_SIGNED_WEIGHTS};
    const char *names[] = {"router weights <= 0", "router weights <= 0 and -1 slots",
                           "router weights <= 0, one expert"};
    for (int c = 0; c < 3; ++c) {
        layer L;
        if (layer_make(&L, &s, 4, t4, case_seed(names[c]), routings[c]) != 0) {
            CHECK(0, "%s: layer_make failed", names[c]);
            layer_free(&L);
            continue;
        }
        int64_t zeros = 0, negative = 0;
        for (int p = 0; p < 4; ++p)
            for (int64_t i = 0; i < L.num_tokens[p] * s.topk; ++i)
                if (L.topk_ids[p][i] >= 0) {
                    zeros += L.router_w[p][i] == 0.0f;
                    negative += L.router_w[p][i] < 0.0f;
                }
        CHECK(zeros > 0 && negative > 0, "%s: %lld zero and %lld negative weights", names[c], (long long)zeros,
              (long long)negative);
        check_layer(names[c], &L, &config, MATRIX_BOTH_MODES);
        layer_free(&L);
    }
}

/* ---- non-finite inputs -------------------------------------------------------------------- */

static int row_equal(const uint16_t *a, const uint16_t *b, int64_t t, int64_t H) {
    return memcmp(a + t * H, b + t * H, (size_t)H * 2) == 0;
}

/* One token of one rank gets a NaN (or +Inf) in x. The pass returns MOK_OK; every other token's
 * y, dx, d_router_w, the schedule, the gradients of experts the token does not reach and the
 * shared gradients of the other ranks are bitwise those of the clean run; everything agrees with
 * the reference where the reference is finite. */
static void nonfinite_case(const char *name, uint16_t bad_bits, int bad_rank) {
    const mok_config config = matrix_config();
    const int P = 4;
    const int64_t t4[] = {40, 33, 47, 25};
    const mok_shape s = make_shape(128, 64, 16, 2, 64);
    layer L;
    if (layer_make(&L, &s, P, t4, case_seed(name), LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    const int64_t H = s.hidden, k = s.topk, El = s.num_experts / P, per = s.intermediate * H;
    uint64_t state = L.seed;
    const int64_t bad_token = (int64_t)(matrix_pick(&state) % (uint64_t)t4[bad_rank]);
    const int64_t bad_col = (int64_t)(matrix_pick(&state) % (uint64_t)H);

    layer_result clean = {0}, dirty = {0}, ref = {0};
    mok_status st = layer_run_backend(&L, &config, 0, &clean);
    CHECK(st == MOK_OK, "%s: clean run failed: %s", name, clean.message);
    L.x[bad_rank][bad_token * H + bad_col] = bad_bits;
    mok_status dst = layer_run_backend(&L, &config, 0, &dirty);
    CHECK(dst == MOK_OK, "%s: the run with a non-finite input returned %s: %s", name, mok_status_string(dst),
          dirty.message);
    if (st == MOK_OK && dst == MOK_OK) {
        char tag[160];
        snprintf(tag, sizeof tag, "%s (rank %d token %lld col %lld) MOK_TEST_SEED=%llu", name, bad_rank,
                 (long long)bad_token, (long long)bad_col, mok_test_seed());
        for (int p = 0; p < P; ++p) {
            /* the two runs' workspaces differ, and so does the tag in their schedules' headers */
            mok_sched_header *dirty_header = dirty.schedule[p];
            dirty_header->workspace = ((const mok_sched_header *)clean.schedule[p])->workspace;
            CHECK(memcmp(&clean.info[p], &dirty.info[p], sizeof clean.info[p]) == 0 &&
                      memcmp(clean.schedule[p], dirty.schedule[p], clean.schedule_bytes) == 0,
                  "%s: rank %d's schedule changed", tag, p);
            for (int64_t t = 0; t < L.num_tokens[p]; ++t) {
                const int bad = p == bad_rank && t == bad_token;
                if (bad) {
                    int64_t finite = 0;
                    for (int64_t h = 0; h < H; ++h) finite += isfinite(mok_bf16_to_float(dirty.y[p][t * H + h]));
                    CHECK(finite == 0, "%s: %lld elements of the poisoned token's y are finite", tag, (long long)finite);
                    continue;
                }
                CHECK(row_equal(clean.y[p], dirty.y[p], t, H), "%s: y of rank %d token %lld changed", tag, p,
                      (long long)t);
                CHECK(row_equal(clean.dx[p], dirty.dx[p], t, H), "%s: dx of rank %d token %lld changed", tag, p,
                      (long long)t);
                CHECK(memcmp(clean.d_router_w[p] + t * k, dirty.d_router_w[p] + t * k, (size_t)k * 4) == 0,
                      "%s: d_router_w of rank %d token %lld changed", tag, p, (long long)t);
            }
            for (int64_t e = 0; e < El; ++e) {
                int reached = 0;
                for (int64_t j = 0; j < k; ++j) reached |= L.topk_ids[bad_rank][bad_token * k + j] == p * El + e;
                if (reached) continue;
                for (int m = 0; m < 3; ++m)
                    CHECK(memcmp((uint16_t *)clean.dw[m][p] + e * per, (uint16_t *)dirty.dw[m][p] + e * per,
                                 (size_t)per * 2) == 0,
                          "%s: gradient %d of expert %lld, which the bad token does not reach, changed", tag, m,
                          (long long)(p * El + e));
            }
            if (p != bad_rank)
                for (int m = 0; m < 3; ++m)
                    CHECK(memcmp(clean.ds[m][p], dirty.ds[m][p], (size_t)(s.shared_intermediate * H) * 2) == 0,
                          "%s: shared gradient %d of rank %d changed", tag, m, p);
        }
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

MOK_TEST(cpu_nonfinite_input) {
    nonfinite_case("NaN in x", 0x7fc0, 0);
    nonfinite_case("+Inf in x", 0x7f80, 2);
}

/* ---- gradient modes ----------------------------------------------------------------------- */

MOK_TEST(cpu_accumulate_empty_experts) {
    const mok_config config = matrix_config();
    const int64_t t4[] = {30, 41, 0, 26};
    const mok_shape s = make_shape(128, 64, 16, 2, 64);
    const char *name = "empty experts, both gradient modes";
    layer L;
    if (layer_make(&L, &s, 4, t4, case_seed(name), LAYER_ROUTE_EVEN) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    for (int accumulate = 0; accumulate < 2; ++accumulate) {
        char tag[128];
        snprintf(tag, sizeof tag, "%s accumulate=%d MOK_TEST_SEED=%llu", name, accumulate, mok_test_seed());
        layer_result r = {0};
        mok_status st = layer_run_backend(&L, &config, accumulate, &r);
        CHECK(st == MOK_OK, "%s: %s", tag, r.message);
        if (st == MOK_OK) {
            int empty = matrix_check_empty_experts(tag, &L, &r);
            CHECK(empty >= 8, "%s: only %d experts without rows", tag, empty);
        }
        layer_result_free(&r);
    }
    /* the same with no tokens at all: every expert is empty */
    const int64_t none[] = {0, 0, 0, 0};
    layer_free(&L);
    if (layer_make(&L, &s, 4, none, case_seed(name), LAYER_ROUTE_UNIFORM) == 0)
        for (int accumulate = 0; accumulate < 2; ++accumulate) {
            layer_result r = {0};
            mok_status st = layer_run_backend(&L, &config, accumulate, &r);
            CHECK(st == MOK_OK, "no tokens, accumulate=%d: %s", accumulate, r.message);
            if (st == MOK_OK) {
                CHECK(matrix_check_empty_experts("no tokens", &L, &r) == 16, "no tokens: not every expert counted empty");
                /* the shared gradient of no tokens: zeros in bf16 mode, untouched when accumulating */
                for (int p = 0; p < 4; ++p)
                    for (int m = 0; m < 3; ++m) {
                        const size_t n = (size_t)(s.shared_intermediate * s.hidden);
                        if (accumulate) {
                            CHECK(memcmp(r.ds[m][p], r.ds_init[m][p], n * 4) == 0,
                                  "no tokens, accumulate: shared gradient %d of rank %d changed", m, p);
                        } else {
                            size_t bad = 0;
                            for (size_t i = 0; i < n; ++i) bad += ((const uint16_t *)r.ds[m][p])[i] != 0;
                            CHECK(bad == 0, "no tokens, bf16: %zu elements of shared gradient %d of rank %d are not 0",
                                  bad, m, p);
                        }
                    }
            }
            layer_result_free(&r);
        }
    layer_free(&L);
}

/* ---- determinism -------------------------------------------------------------------------- */

MOK_TEST(cpu_determinism) {
    const int quick = mok_test_quick();
    const mok_shape s = make_shape(128, 128, 8, 3, 64);
    const int64_t t4[] = {70, 33, 90, 51};
    const char *name = "determinism";
    layer L;
    if (layer_make(&L, &s, 4, t4, case_seed(name), LAYER_ROUTE_SKEWED) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    const layer_variant all[] = {
        {128, 512, 2, 1, 0, 0},   /* the base; runs three times on one workspace */
        {256, 512, 2, 1, 0, 0},   {512, 512, 2, 1, 0, 0},   {128, 128, 2, 1, 0, 0},   {128, 16384, 2, 1, 0, 0},
        {128, 512, 3, 1, 0, 0},   {128, 512, 4, 1, 0, 0},   {128, 512, 3, 2, 0, 0},   {128, 512, 4, 2, 0, 0},
        {128, 512, 2, 1, 128, 0}, {256, 256, 3, 2, 128, 0}, {128, 128, 4, 2, 128, 0},
    };
    const layer_variant few[] = {{128, 512, 2, 1, 0, 0}, {256, 512, 3, 2, 0, 0}, {128, 128, 2, 1, 128, 0},
                                 {512, 16384, 4, 1, 0, 0}};
    if (quick) check_determinism(name, &L, matrix_config(), few, sizeof few / sizeof few[0]);
    else check_determinism(name, &L, matrix_config(), all, sizeof all / sizeof all[0]);
    layer_free(&L);
}

/* ---- recompute ---------------------------------------------------------------------------- */

static int64_t count_not_poison(const uint16_t *p, size_t n) {
    int64_t c = 0;
    for (size_t i = 0; i < n; ++i) c += p[i] != LAYER_POISON_BF16;
    return c;
}

/* Two layers of one shape share a workspace: forward A, forward B, recompute A's context (it must
 * equal A's forward context bitwise, and y must stay untouched), then backward A from the
 * recomputed context and backward B, each checked against the reference. */
static void recompute_case(const char *name, const mok_config *config) {
    const int P = 3;
    const mok_shape s = make_shape(128, 128, 6, 2, 64);
    const int64_t ta[] = {60, 45, 80}, tb[] = {41, 77, 38};
    const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
    char name_b[128];
    snprintf(name_b, sizeof name_b, "%s, layer B", name);
    layer A, Bl;
    mok_shape sb = s;
    sb.max_tokens = 80; /* one workspace: both layers need the same T_max */
    mok_shape sa = sb;
    int okA = layer_make(&A, &sa, P, ta, case_seed(name), LAYER_ROUTE_SKEWED) == 0;
    int okB = layer_make(&Bl, &sb, P, tb, case_seed(name_b), LAYER_ROUTE_UNIFORM) == 0;
    CHECK(okA && okB, "%s: layer_make failed", name);
    layer_backend B = {0};
    mok_status st = okA && okB ? layer_backend_open(&B, &A, config) : MOK_ERR_INTERNAL;
    CHECK(!(okA && okB) || st == MOK_OK, "%s: %s", name, B.message);
    layer_result ra = {0}, rb = {0};
    void *ctx[MOK_MAX_RANKS] = {0};
    uint16_t *y[MOK_MAX_RANKS] = {0};
    if (st == MOK_OK) {
        char tag[160];
        snprintf(tag, sizeof tag, "%s MOK_TEST_SEED=%llu", name, mok_test_seed());
        st = layer_backend_forward(&B, &A, &ra);
        CHECK(st == MOK_OK, "%s: forward A: %s", tag, ra.message);
        mok_status stb = st == MOK_OK ? layer_backend_forward(&B, &Bl, &rb) : MOK_ERR_INTERNAL;
        CHECK(st != MOK_OK || stb == MOK_OK, "%s: forward B: %s", tag, rb.message);
        if (st == MOK_OK && stb == MOK_OK) {
            mok_forward_args args[MOK_MAX_RANKS];
            layer_forward_args(&A, &ra, args);
            for (int p = 0; p < P; ++p) {
                ctx[p] = aligned_alloc(64, (ra.context_bytes + 63) / 64 * 64);
                y[p] = aligned_alloc(64, (size_t)(ta[p] * H * 2 + 63) / 64 * 64);
                for (size_t i = 0; i < ra.context_bytes / 2; ++i) ((uint16_t *)ctx[p])[i] = LAYER_POISON_BF16;
                for (int64_t i = 0; i < ta[p] * H; ++i) y[p][i] = LAYER_POISON_BF16;
                args[p].context = ctx[p];
                args[p].y = y[p];
                args[p].w_down = NULL; /* not read by mok_recompute_context */
                args[p].s_down = NULL;
            }
            for (int round = 0; round < 2; ++round) {
                /* round 1: y = NULL, which the recompute may be given */
                if (round == 1)
                    for (int p = 0; p < P; ++p) args[p].y = NULL;
                st = mok_recompute_context(B.workspace, args);
                CHECK(st == MOK_OK, "%s: mok_recompute_context (round %d): %s", tag, round, mok_last_error());
                for (int p = 0; st == MOK_OK && p < P; ++p) {
                    const uint16_t *f = ra.context[p], *c = ctx[p];
                    size_t first = 0;
                    while (first < ra.context_bytes / 2 && f[first] == c[first]) ++first;
                    CHECK(first == ra.context_bytes / 2,
                          "%s: rank %d: recomputed context differs from the forward's at bf16 element %zu of %zu "
                          "(forward %#06x, recompute %#06x)",
                          tag, p, first, ra.context_bytes / 2, first < ra.context_bytes / 2 ? f[first] : 0,
                          first < ra.context_bytes / 2 ? c[first] : 0);
                    CHECK(count_not_poison(y[p], (size_t)(ta[p] * H)) == 0, "%s: rank %d: recompute wrote y", tag, p);
                    /* the forward filled at least every kept routed row's g|u and every token's shared g|u */
                    const int64_t kept = config->context_rows == 0 || config->context_rows > ra.info[p].padded_rows
                                             ? ra.info[p].padded_rows
                                             : config->context_rows;
                    const int64_t want = kept * 2 * I + ta[p] * 2 * Is;
                    const int64_t written = count_not_poison(f, ra.context_bytes / 2);
                    CHECK(written >= want, "%s: rank %d: the forward wrote %lld context elements, want >= %lld", tag, p,
                          (long long)written, (long long)want);
                }
            }
            /* backward of A from the recomputed context, after B's forward used the workspace */
            for (int p = 0; p < P; ++p) {
                void *t = ra.context[p];
                ra.context[p] = ctx[p];
                ctx[p] = t;
            }
            layer_result ref = {0};
            st = layer_backend_backward(&B, &A, 0, &ra);
            CHECK(st == MOK_OK, "%s: backward A: %s", tag, ra.message);
            if (st == MOK_OK && layer_run_reference(&A, &ref) == MOK_OK) {
                double err = layer_compare(&A, &ra, &ref, tag);
                CHECK(err <= 1.0, "%s: layer A after recompute: worst error %.3g > 1", tag, err);
            }
            layer_result_free(&ref);
            st = layer_backend_backward(&B, &Bl, 1, &rb);
            CHECK(st == MOK_OK, "%s: backward B: %s", tag, rb.message);
            if (st == MOK_OK && layer_run_reference(&Bl, &ref) == MOK_OK) {
                double err = layer_compare(&Bl, &rb, &ref, tag);
                CHECK(err <= 1.0, "%s: layer B: worst error %.3g > 1", tag, err);
            }
            layer_result_free(&ref);
        }
    }
    layer_backend_close(&B); /* also after a half-done open */
    for (int p = 0; p < P; ++p) {
        free(ctx[p]);
        free(y[p]);
    }
    layer_result_free(&ra);
    layer_result_free(&rb);
    layer_free(&A);
    layer_free(&Bl);
}

MOK_TEST(cpu_recompute_context) {
    mok_config whole = matrix_config();
    whole.ring_rows = 512;
    recompute_case("recompute, context keeps every row", &whole);
    mok_config replay = matrix_config();
    replay.ring_rows = 128;
    replay.context_rows = 128;
    recompute_case("recompute, context_rows 128, ring 128", &replay);
}

/* The transfer directions turned around (core/tasks.h): fwd_dispatch = bwd_combine = MOK_PUSH
 * (each rank writes its x rows, and its dy, x and router weights, into the peers' rings:
 * SCATTER), fwd_combine = bwd_dispatch = MOK_PULL (each rank gathers its expert outputs, and its
 * dx parts and router-weight gradients, from the peers' rings: GATHER). The rows are the same
 * bytes, so the outputs and gradients must equal the defaults' bit for bit, all four turned and
 * the two pushes alone, at P = 1, 2, 4 and 8, with
 * uneven tokens (one rank with none), skewed routing and several macrobatches; one case also
 * against the reference. */
MOK_TEST(cpu_gather_transfers) {
    const int quick = mok_test_quick();
    const mok_shape s4 = make_shape(128, 128, 8, 6, 64);
    const int sizes[] = {1, 2, 4, 8};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        const int P = sizes[i];
        const mok_shape s = P == 8 ? make_shape(128, 64, 16, 4, 0) : s4;
        int64_t tokens[MOK_MAX_RANKS];
        for (int p = 0; p < P; ++p) tokens[p] = p == 1 ? 0 : (quick ? 40 : 64) + 9 * p;
        for (int ring = 0; ring < 2; ++ring) {
            mok_config push = matrix_config();
            if (ring) {
                push.minibatch_rows = 128;
                push.ring_rows = 128;
            }
            mok_config pull = push; /* every direction turned */
            pull.fwd_dispatch = MOK_PUSH;
            pull.fwd_combine = MOK_PULL;
            pull.bwd_combine = MOK_PUSH;
            pull.bwd_dispatch = MOK_PULL;
            mok_config scatter = push; /* the pushes beside the other defaults */
            scatter.fwd_dispatch = MOK_PUSH;
            scatter.bwd_combine = MOK_PUSH;
            char tag[96];
            snprintf(tag, sizeof tag, "P = %d, %s", P, ring ? "ring = minibatch = 128" : "one macrobatch");
            layer L;
            if (layer_make(&L, &s, P, tokens, case_seed(tag), LAYER_ROUTE_SKEWED) != 0) {
                CHECK(0, "%s: layer_make failed", tag);
                layer_free(&L);
                continue;
            }
            layer_result a = {0}, b = {0}, c = {0};
            mok_status sa = layer_run_backend(&L, &push, 0, &a), sb = layer_run_backend(&L, &pull, 0, &b);
            mok_status sc = layer_run_backend(&L, &scatter, 0, &c);
            CHECK(sa == MOK_OK && sb == MOK_OK && sc == MOK_OK, "%s: defaults %s / turned %s / pushes %s", tag,
                  a.message, b.message, c.message);
            if (sa == MOK_OK && sb == MOK_OK && sc == MOK_OK) {
                char what[256] = "";
                CHECK(layer_equal(&L, &a, &b, what, sizeof what), "%s: the turned transfers differ: %s", tag, what);
                CHECK(layer_equal(&L, &a, &c, what, sizeof what), "%s: the pushes differ: %s", tag, what);
            }
            if (P == 4 && ring) check_layer(tag, &L, &pull, MATRIX_BF16_GRADS);
            layer_result_free(&a);
            layer_result_free(&b);
            layer_result_free(&c);
            layer_free(&L);
        }
    }
}
