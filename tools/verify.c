/* verify.c — `mok run --check`: the library's fp64 reference (mok_ref_forward / mok_ref_backward,
 * of the run's shape and so of its precision: under FP8 it quantizes at the FP8 points itself)
 * on the same host inputs, the first N tokens of every rank, then the worst error of each output
 * over the ranks. A token's outputs (y, dx, d_router_w) depend only on that token, so a prefix is
 * checked exactly; the weight gradients sum over every token and are compared only when the
 * reference saw all of them. */
#include <stdio.h>
#include <stdlib.h>

#include "run.h"

/* The reference's inputs (per rank, pointing into the run's host copies) and outputs. */
typedef struct reference {
    int nranks;
    int64_t sample;   /* tokens per rank handed to the reference (INT64_MAX: all) */
    int sampled;      /* some rank has more tokens than the reference saw */
    int64_t *num_tokens;
    const void **x, **dy, **w_gate, **w_up, **w_down;
    const int32_t **ids;
    const float **router_w;
    void **out[TOOLS_NUM_TENSORS]; /* [P] each; y and dx bf16, the rest fp32 (unrounded) */
    int compared[TOOLS_NUM_TENSORS];
    void *got;        /* staging for the library's output, the largest compared tensor */
} reference;

int64_t verify_tokens(const run_options *opt, const mok_shape *shape) {
    if (opt->check_tokens >= 0) return opt->check_tokens;
    return shape->hidden * shape->intermediate <= CHECK_FULL_MAX_HI ? INT64_MAX : CHECK_TOKENS_LARGE;
}

static void reference_free(reference *ref) {
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
        for (int r = 0; ref->out[t] && r < ref->nranks; ++r) free(ref->out[t][r]);
        free(ref->out[t]);
    }
    free(ref->got);
    free(ref->num_tokens);
    free(ref->x);
    free(ref->dy);
    free(ref->ids);
    free(ref->router_w);
    free(ref->w_gate);
    free(ref->w_up);
    free(ref->w_down);
}

static int allocate_pointer_arrays(reference *ref) {
    const size_t P = (size_t)ref->nranks;
    ref->num_tokens = calloc(P, sizeof *ref->num_tokens);
    ref->x = calloc(P, sizeof *ref->x);
    ref->dy = calloc(P, sizeof *ref->dy);
    ref->ids = calloc(P, sizeof *ref->ids);
    ref->router_w = calloc(P, sizeof *ref->router_w);
    ref->w_gate = calloc(P, sizeof *ref->w_gate);
    ref->w_up = calloc(P, sizeof *ref->w_up);
    ref->w_down = calloc(P, sizeof *ref->w_down);
    int ok = ref->num_tokens && ref->x && ref->dy && ref->ids && ref->router_w && ref->w_gate && ref->w_up &&
             ref->w_down;
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) ok = ok && (ref->out[t] = calloc(P, sizeof *ref->out[t])) != NULL;
    return ok ? 0 : -1;
}

/* Which tensors are compared: y; with a backward, dx and d_router_w; without sampling, the weight
 * gradients too. */
static void choose_compared(const run_state *st, reference *ref) {
    for (int r = 0; r < st->nranks; ++r) {
        const int64_t tokens = st->ranks[r].tokens;
        ref->num_tokens[r] = tokens < ref->sample ? tokens : ref->sample;
        ref->sampled |= ref->num_tokens[r] < tokens;
    }
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t)
        ref->compared[t] = run_tensor_present(st, (tools_tensor)t) && (t == TOOLS_Y || st->backward) &&
                           (run_per_token((tools_tensor)t) || !ref->sampled);
}

/* Points the reference at the run's host copies and allocates its outputs (the reference backward
 * needs a buffer for every gradient, compared or not) and the staging buffer. */
static int reference_open(const run_state *st, reference *ref) {
    ref->nranks = st->nranks;
    ref->sample = verify_tokens(st->opt, &st->shape);
    if (allocate_pointer_arrays(ref) != 0) return -1;
    choose_compared(st, ref);
    size_t most = 0;
    for (int r = 0; r < st->nranks; ++r) {
        const rank_tensors *rt = &st->ranks[r];
        ref->x[r] = rt->x.host;
        ref->dy[r] = rt->dy.host;
        ref->ids[r] = rt->topk_ids.host;
        ref->router_w[r] = rt->router_w.host;
        ref->w_gate[r] = rt->w_gate.host;
        ref->w_up[r] = rt->w_up.host;
        ref->w_down[r] = rt->w_down.host;
        for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
            if (!run_tensor_present(st, (tools_tensor)t) || (t != TOOLS_Y && !st->backward)) continue;
            const int64_t count = run_tensor_count(st, ref->num_tokens[r], (tools_tensor)t);
            const size_t element = (t == TOOLS_Y || t == TOOLS_DX) ? 2 : 4;
            if (!(ref->out[t][r] = tools_host_alloc((size_t)count * element))) return -1;
            const size_t bytes = (size_t)count * run_output_element((tools_tensor)t);
            if (ref->compared[t] && bytes > most) most = bytes;
        }
    }
    return (ref->got = tools_host_alloc(most)) ? 0 : -1;
}

/* The reference's passes, each shown as it completes. Returns 0, or -1 with the message printed. */
static int reference_run(run_state *st, reference *ref) {
    const int shared = st->shape.shared_intermediate > 0;
    mok_ref_layer layer = {.shape = &st->shape, .nranks = st->nranks, .swiglu_limit = st->opt->config.swiglu_limit,
                           .num_tokens = ref->num_tokens, .x = ref->x, .topk_ids = ref->ids,
                           .router_w = ref->router_w, .w_gate = ref->w_gate, .w_up = ref->w_up,
                           .w_down = ref->w_down, .s_gate = st->shared[0], .s_up = st->shared[1],
                           .s_down = st->shared[2]};
    tools_progress_line(st->progress, "reference");
    tools_progress_pass(st->progress, "forward");
    double start = tools_now_seconds();
    mok_status status = mok_ref_forward(&layer, ref->out[TOOLS_Y]);
    const char *function = "mok_ref_forward";
    if (status == MOK_OK) {
        tools_progress_done(st->progress, tools_now_seconds() - start);
        if (st->backward) {
            tools_progress_pass(st->progress, "backward");
            start = tools_now_seconds();
            function = "mok_ref_backward";
            status = mok_ref_backward(&layer, ref->dy, ref->out[TOOLS_DX], (float *const *)ref->out[TOOLS_D_ROUTER_W],
                                      (float *const *)ref->out[TOOLS_DW_GATE], (float *const *)ref->out[TOOLS_DW_UP],
                                      (float *const *)ref->out[TOOLS_DW_DOWN],
                                      shared ? (float *const *)ref->out[TOOLS_DS_GATE] : NULL,
                                      shared ? (float *const *)ref->out[TOOLS_DS_UP] : NULL,
                                      shared ? (float *const *)ref->out[TOOLS_DS_DOWN] : NULL);
            if (status == MOK_OK) tools_progress_done(st->progress, tools_now_seconds() - start);
        }
    }
    tools_progress_end_line(st->progress);
    return status == MOK_OK ? 0 : tools_library_failed(function, status);
}

/* The worst error of one tensor over the ranks (NaN counts as worse than anything). */
static int compare_tensor(const run_state *st, const reference *ref, tools_tensor t, tools_error *worst,
                          int *worst_rank) {
    *worst = (tools_error){0.0, 0.0, -1.0, -1};
    *worst_rank = 0;
    for (int r = 0; r < st->nranks; ++r) {
        const int64_t count = run_tensor_count(st, ref->num_tokens[r], t);
        if (tools_buffer_read(&st->ranks[r].outputs[t], 0, ref->got, (size_t)count * run_output_element(t)) != 0)
            return -1;
        const tools_dtype got_type = t == TOOLS_D_ROUTER_W ? TOOLS_F32 : TOOLS_BF16;
        const tools_dtype ref_type = (t == TOOLS_Y || t == TOOLS_DX) ? TOOLS_BF16 : TOOLS_F32;
        const tools_error e =
            tools_compare(t, tools_table_of(st->shape.precision, st->backend), ref->got, got_type, ref->out[t][r], ref_type, count);
        if (!(e.normalized <= worst->normalized)) {
            *worst = e;
            *worst_rank = r;
        }
    }
    return 0;
}

/* The table of errors; returns 1 when a tensor fails, 0 when all pass, -1 on an error. */
static int print_comparison(const run_state *st, const reference *ref) {
    printf("%-11s %13s %12s %7s %9s %5s\n", "tensor", "max abs err", "max |ref|", "rtol", "error", "rank");
    int failed = 0;
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
        if (!run_tensor_present(st, (tools_tensor)t)) continue;
        const tools_tolerance *tol = tools_tolerance_of((tools_tensor)t, tools_table_of(st->shape.precision, st->backend));
        if (!ref->compared[t]) {
            printf("%-11s n/a (%s)\n", tol->name, t != TOOLS_Y && !st->backward ? "no backward" : "sampled tokens");
            continue;
        }
        tools_error worst;
        int worst_rank;
        if (compare_tensor(st, ref, (tools_tensor)t, &worst, &worst_rank) != 0) return -1;
        const int pass = worst.normalized <= 1.0;
        failed |= !pass;
        printf("%-11s %13.4e %12.4e %7.2g %9.4f %5d %s\n", tol->name, worst.max_abs_error, worst.max_abs_ref, tol->rtol,
               worst.normalized, worst_rank, pass ? "ok" : "FAIL");
    }
    return failed;
}

int verify_against_reference(run_state *st) {
    reference ref = {0};
    int result = -1;
    if (reference_open(st, &ref) != 0) {
        fprintf(stderr, "mok run: out of host memory for the reference\n");
    } else {
        char which[96];
        if (ref.sampled) snprintf(which, sizeof which, "the first %lld tokens of each rank", (long long)ref.sample);
        else snprintf(which, sizeof which, "all tokens");
        printf("\ncheck against the reference (fp64, %s%s); error = max|got-ref| / (atol + rtol*max|ref|)\n",
               st->shape.precision == MOK_PRECISION_FP8 ? "the FP8 function, " : "", which);
        fflush(stdout);
        if (reference_run(st, &ref) == 0) {
            int failed = print_comparison(st, &ref);
            if (failed >= 0) {
                failed |= report_hashes(st);
                printf("%s\n", failed ? "FAIL" : "PASS");
                result = failed ? 1 : 0;
            }
        }
    }
    reference_free(&ref);
    return result;
}
