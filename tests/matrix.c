/* matrix.c — the matrix tests' shared pieces (matrix.h). */
#include "matrix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

uint64_t matrix_case_seed(const char *name, uint64_t salt) {
    uint64_t h = 1469598103934665603ull ^ salt;
    for (const char *c = name; *c; ++c) h = (h ^ (unsigned char)*c) * 1099511628211ull;
    return h ^ (mok_test_seed() * 0x9e3779b97f4a7c15ull);
}

uint64_t matrix_pick(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

mok_config matrix_config(void) {
    mok_config c = MOK_CONFIG_INIT;
    c.minibatch_rows = 128;
    c.ring_rows = 256;
    c.cpu_threads = 2;
    c.cpu_comm_threads = 1;
    c.peer_timeout_ms = 120000.0;
    return c;
}

void matrix_expert_rows(const layer *L, int64_t *rows) {
    for (int64_t e = 0; e < L->shape.num_experts; ++e) rows[e] = 0;
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t s = 0; s < L->num_tokens[p] * L->shape.topk; ++s)
            if (L->topk_ids[p][s] >= 0) rows[L->topk_ids[p][s]] += 1;
}

int matrix_check_empty_experts(const char *tag, const layer *L, const layer_result *r) {
    const int64_t El = L->shape.num_experts / L->nranks, per = L->shape.intermediate * L->shape.hidden;
    int64_t *rows = malloc((size_t)L->shape.num_experts * sizeof *rows);
    CHECK(rows != NULL, "%s: out of memory", tag);
    if (!rows) return 0;
    matrix_expert_rows(L, rows);
    int empty = 0;
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t e = 0; e < El; ++e) {
            if (rows[p * El + e] != 0) continue;
            ++empty;
            for (int m = 0; m < 3; ++m) {
                if (r->grads_f32) {
                    const float *got = (const float *)r->dw[m][p] + e * per, *init = r->dw_init[m][p] + e * per;
                    CHECK(memcmp(got, init, (size_t)per * 4) == 0,
                          "%s: accumulate mode changed the fp32 gradient (matrix %d) of expert %lld, which has no rows",
                          tag, m, (long long)(p * El + e));
                } else {
                    const uint16_t *got = (const uint16_t *)r->dw[m][p] + e * per;
                    int64_t bad = 0;
                    for (int64_t i = 0; i < per; ++i) bad += got[i] != 0;
                    CHECK(bad == 0, "%s: %lld elements of the bf16 gradient (matrix %d) of expert %lld (no rows) are not +0",
                          tag, (long long)bad, m, (long long)(p * El + e));
                }
            }
        }
    free(rows);
    return empty;
}

void matrix_check_layer(const char *tag, const layer *L, const mok_config *config, int modes, matrix_run_check extra) {
    layer_result ref = {0};
    mok_status st = layer_run_reference(L, &ref);
    CHECK(st == MOK_OK, "%s: reference failed: %s", tag, ref.message);
    for (int accumulate = 0; st == MOK_OK && accumulate < (modes == MATRIX_BOTH_MODES ? 2 : 1); ++accumulate) {
        char sub[256];
        snprintf(sub, sizeof sub, "%s accumulate=%d MOK_TEST_SEED=%llu", tag, accumulate, mok_test_seed());
        layer_result got = {0};
        mok_status bst = layer_run_backend(L, config, accumulate, &got);
        CHECK(bst == MOK_OK, "%s: backend failed: %s", sub, got.message);
        if (bst == MOK_OK) {
            if (extra) extra(sub, L, config, &got);
            double err = layer_compare(L, &got, &ref, sub);
            CHECK(err <= 1.0, "%s: worst normalized error %.3g > 1 (layer seed %llu)", sub, err,
                  (unsigned long long)L->seed);
            matrix_check_empty_experts(sub, L, &got);
        }
        layer_result_free(&got);
    }
    layer_result_free(&ref);
}

void matrix_run_case(const char *name, uint64_t seed, const mok_shape *shape, int P, const int64_t *tokens,
                     int routing, float limit, const mok_config *config, int modes, matrix_run_check extra) {
    layer L;
    if (layer_make(&L, shape, P, tokens, seed, routing) != 0) {
        CHECK(0, "%s: layer_make failed", name);
        layer_free(&L);
        return;
    }
    L.swiglu_limit = limit;
    if (limit > 0.0f) layer_avoid_clamp_flips(&L);
    matrix_check_layer(name, &L, config, modes, extra);
    layer_free(&L);
}
