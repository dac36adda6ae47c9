/* determinism.c — check_determinism (determinism.h). */
#include "determinism.h"

#include <stdio.h>
#include <string.h>

#include "test.h"

void check_determinism(const char *name, const layer *L, mok_config base, const layer_variant *list, size_t count) {
    layer_result first[2] = {{0}, {0}};
    int have_first = 0;
    for (size_t v = 0; v < count; ++v) {
        mok_config c = base;
        c.minibatch_rows = list[v].minibatch;
        c.ring_rows = list[v].ring;
        c.cpu_threads = list[v].threads;
        c.cpu_comm_threads = list[v].comm;
        c.context_rows = list[v].context;
        if (list[v].turned) {
            c.fwd_dispatch = MOK_PUSH;
            c.fwd_combine = MOK_PULL;
            c.bwd_combine = MOK_PUSH;
            c.bwd_dispatch = MOK_PULL;
        }
        char tag[192];
        snprintf(tag, sizeof tag, "%s minibatch %d ring %d threads %d comm %d context_rows %lld turned %d "
                 "MOK_TEST_SEED=%llu", name, c.minibatch_rows, c.ring_rows, c.cpu_threads, c.cpu_comm_threads,
                 (long long)c.context_rows, list[v].turned, mok_test_seed());
        layer_backend B;
        mok_status st = layer_backend_open(&B, L, &c);
        CHECK(st == MOK_OK, "%s: %s", tag, B.message);
        const int repeats = v == 0 ? 3 : 1;
        for (int rep = 0; st == MOK_OK && rep < repeats; ++rep)
            for (int accumulate = 0; accumulate < 2; ++accumulate) {
                layer_result r = {0};
                mok_status rst = layer_backend_run(&B, L, accumulate, &r);
                CHECK(rst == MOK_OK, "%s accumulate=%d run %d: %s", tag, accumulate, rep, r.message);
                if (rst == MOK_OK) {
                    if (v == 0 && rep == 0) {
                        first[accumulate] = r;
                        have_first |= 1 << accumulate;
                        continue;
                    }
                    char what[200] = "";
                    CHECK(!(have_first >> accumulate & 1) || layer_equal(L, &first[accumulate], &r, what, sizeof what),
                          "%s accumulate=%d run %d: not bitwise equal to the first run: %s", tag, accumulate, rep,
                          what);
                    /* an FP8 layer's quantized weights too, byte for byte */
                    for (int p = 0; have_first >> accumulate & 1 && r.fp8_bytes && p < L->nranks; ++p)
                        CHECK(memcmp(first[accumulate].fp8_weights[p], r.fp8_weights[p], r.fp8_bytes) == 0,
                              "%s: rank %d's FP8 weights differ from the first run's", tag, p);
                }
                layer_result_free(&r);
            }
        layer_backend_close(&B);
    }
    /* what the runs agree on must also be right */
    if (have_first == 3) {
        layer_result ref = {0};
        mok_status st = layer_run_reference(L, &ref);
        CHECK(st == MOK_OK, "%s: reference failed: %s", name, ref.message);
        for (int accumulate = 0; st == MOK_OK && accumulate < 2; ++accumulate) {
            char tag[128];
            snprintf(tag, sizeof tag, "%s base accumulate=%d MOK_TEST_SEED=%llu", name, accumulate, mok_test_seed());
            double err = layer_compare(L, &first[accumulate], &ref, tag);
            CHECK(err <= 1.0, "%s: worst normalized error %.3g > 1", tag, err);
        }
        layer_result_free(&ref);
    }
    layer_result_free(&first[0]);
    layer_result_free(&first[1]);
}
