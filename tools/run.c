/* run.c — making and running one `mok run` (run.h): the group and workspace, the random tensors
 * of every rank, and the timed runs, each pass shown as it completes. */
#include "run.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inputs.h"

const char *const phase_names[NUM_PHASES] = {"schedule", "forward", "backward", "total"};

/* Calls a library function; on failure prints its message (options.c) and makes the enclosing
 * function return -1. */
#define CALL(function, ...)                                                          \
    do {                                                                             \
        mok_status call_status_ = function(__VA_ARGS__);                             \
        if (call_status_ != MOK_OK) return tools_library_failed(#function, call_status_); \
    } while (0)

int64_t run_tensor_count(const run_state *st, int64_t tokens, tools_tensor tensor) {
    const mok_shape *s = &st->shape;
    switch (tensor) {
    case TOOLS_Y:
    case TOOLS_DX: return tokens * s->hidden;
    case TOOLS_D_ROUTER_W: return tokens * s->topk;
    case TOOLS_DW_GATE:
    case TOOLS_DW_UP:
    case TOOLS_DW_DOWN: return st->num_local_experts * s->intermediate * s->hidden;
    default: return s->shared_intermediate * s->hidden;
    }
}

int run_per_token(tools_tensor tensor) { return tensor <= TOOLS_D_ROUTER_W; }

/* The gradients are written as bf16 (accumulate = 0). */
size_t run_output_element(tools_tensor tensor) { return tensor == TOOLS_D_ROUTER_W ? 4 : 2; }

int run_tensor_present(const run_state *st, tools_tensor tensor) {
    return tensor < TOOLS_DS_GATE || st->shape.shared_intermediate > 0;
}

/* Whether the passes that run write an output: y the forward, the rest the backward. */
static int output_written(const run_state *st, tools_tensor tensor) {
    return run_tensor_present(st, tensor) && (tensor == TOOLS_Y || st->backward);
}

static size_t bytes_of(int64_t count, size_t element) { return (size_t)count * element; }

/* ---- the group -------------------------------------------------------------------------------- */

/* The backend the run asks for. auto follows the library's rule (cuda when a GPU is visible); it
 * is resolved here because the devices argument depends on it. cuda is refused here with the real
 * cause: this build has no CUDA backend, no GPU is visible, or fewer GPUs than ranks. */
static int resolve_backend(const run_state *st, mok_backend *out) {
    const run_options *opt = st->opt;
    const int gpus = mok_backend_available(MOK_BACKEND_CUDA);
    *out = opt->backend == MOK_BACKEND_AUTO ? (gpus > 0 ? MOK_BACKEND_CUDA : MOK_BACKEND_CPU) : opt->backend;
    if (*out != MOK_BACKEND_CUDA) return 0;
#ifndef MOK_HAVE_CUDA
    fprintf(stderr,
            "mok run: --backend cuda: this build has no CUDA backend (nvcc was not on the PATH when it was "
            "built, or CUDA=0); rebuild with nvcc on the PATH, or use --backend cpu\n");
    return -1;
#else
    if (gpus == 0) {
        fprintf(stderr,
                "mok run: --backend cuda: no GPU is visible to this process (this build has the CUDA backend; "
                "check nvidia-smi and CUDA_VISIBLE_DEVICES), or use --backend cpu\n");
        return -1;
    }
    if (gpus < st->nranks) {
        fprintf(stderr,
                "mok run: %d ranks on the cuda backend need %d GPUs (rank r runs on GPU r), but %d %s visible; "
                "use --ranks %d or less%s\n",
                st->nranks, st->nranks, gpus, gpus == 1 ? "is" : "are", gpus,
                opt->backend == MOK_BACKEND_AUTO ? ", or --backend cpu" : "");
        return -1;
    }
    return 0;
#endif
}

/* The rules of the shape that a flag breaks, in the flag's words, before the library's own check. */
static int check_shape(const run_state *st) {
    const mok_shape *s = &st->shape;
    if (st->nranks >= 1 && st->nranks <= MOK_MAX_RANKS && s->num_experts % st->nranks != 0) {
        fprintf(stderr,
                "mok run: --ranks %d does not divide the %lld experts of %s (each rank owns E / P of them); "
                "use a divisor of %lld, or --scale, which rounds E to a multiple of --ranks\n",
                st->nranks, (long long)s->num_experts, st->opt->preset->name, (long long)s->num_experts);
        return -1;
    }
    CALL(mok_shape_validate, s, st->nranks);
    return 0;
}

int run_create_group(run_state *st) {
    const run_options *opt = st->opt;
    CALL(mok_config_validate, &opt->config);
    if (check_shape(st) != 0) return -1;
    mok_backend requested;
    if (resolve_backend(st, &requested) != 0) return -1;
    int *devices = NULL; /* GPU ordinals 0..P-1 on cuda; NULL on cpu */
    if (requested == MOK_BACKEND_CUDA) {
        devices = malloc((size_t)st->nranks * sizeof *devices);
        if (!devices) return fprintf(stderr, "mok run: out of host memory\n"), -1;
        for (int r = 0; r < st->nranks; ++r) devices[r] = r;
    }
    mok_status status = mok_group_create_local(&st->group, requested, st->nranks, devices, &opt->config);
    free(devices);
    if (status != MOK_OK) return tools_library_failed("mok_group_create_local", status);

    int nranks = 0, num_local = 0, first_rank = 0;
    CALL(mok_group_info, st->group, &nranks, &num_local, &first_rank, &st->backend);
    if (nranks != st->nranks || num_local != st->nranks || first_rank != 0) {
        fprintf(stderr, "mok run: the group drives %d of %d ranks from rank %d; expected all %d\n", num_local,
                nranks, first_rank, st->nranks);
        return -1;
    }
    return 0;
}

int run_create_workspace(run_state *st) {
    CALL(mok_workspace_create, &st->workspace, st->group, &st->shape, &st->opt->config);
    CALL(mok_workspace_sizes, st->workspace, &st->sizes);
    if (st->shape.precision == MOK_PRECISION_FP8) CALL(mok_workspace_fp8_layout, st->workspace, &st->fp8_layout);
    return 0;
}

/* ---- the tensors ------------------------------------------------------------------------------- */

static int allocate_arrays(run_state *st) {
    const int P = st->nranks, R = st->opt->repeat;
    st->ranks = calloc((size_t)P, sizeof *st->ranks);
    st->schedule_args = calloc((size_t)P, sizeof *st->schedule_args);
    st->forward_args = calloc((size_t)P, sizeof *st->forward_args);
    st->backward_args = calloc((size_t)P, sizeof *st->backward_args);
    st->quantize_args = calloc((size_t)P, sizeof *st->quantize_args);
    st->seconds = calloc((size_t)R, sizeof *st->seconds);
    st->output_hashes = calloc((size_t)R, sizeof *st->output_hashes);
    if (st->ranks && st->schedule_args && st->forward_args && st->backward_args && st->quantize_args && st->seconds &&
        st->output_hashes)
        return 0;
    fprintf(stderr, "mok run: out of host memory\n");
    return -1;
}

/* The shared expert: one host copy, the same weights on every rank. */
static int make_shared_expert(run_state *st) {
    const int64_t H = st->shape.hidden, Is = st->shape.shared_intermediate;
    static const tools_stream streams[3] = {TOOLS_STREAM_S_GATE, TOOLS_STREAM_S_UP, TOOLS_STREAM_S_DOWN};
    tools_fill fills[3];
    for (int w = 0; Is > 0 && w < 3; ++w) {
        st->shared[w] = tools_host_alloc(bytes_of(Is * H, 2));
        if (!st->shared[w]) return fprintf(stderr, "mok run: out of host memory for the shared expert\n"), -1;
        fills[w] = (tools_fill){st->shared[w], Is * H, tools_weight_bound(w == 2 ? Is : H),
                                tools_rng_make(st->opt->seed, streams[w], 0)};
    }
    if (Is > 0) tools_fill_bf16_many(fills, 3);
    return 0;
}

static int create_buffers(run_state *st, int r) {
    const mok_shape *s = &st->shape;
    const int64_t H = s->hidden, I = s->intermediate, Is = s->shared_intermediate, k = s->topk;
    const int64_t E_local = st->num_local_experts, T = st->ranks[r].tokens;
    rank_tensors *rt = &st->ranks[r];
    const tools_place place = {st->group, r, st->backend};
    const tools_place *pl = &place;
    if (tools_buffer_create(&rt->x, pl, bytes_of(T * H, 2), "x") ||
        tools_buffer_create(&rt->dy, pl, bytes_of(T * H, 2), "dy") ||
        tools_buffer_create(&rt->topk_ids, pl, bytes_of(T * k, 4), "topk_ids") ||
        tools_buffer_create(&rt->router_w, pl, bytes_of(T * k, 4), "router_w") ||
        tools_buffer_create(&rt->w_gate, pl, bytes_of(E_local * I * H, 2), "w_gate") ||
        tools_buffer_create(&rt->w_up, pl, bytes_of(E_local * I * H, 2), "w_up") ||
        tools_buffer_create(&rt->w_down, pl, bytes_of(E_local * H * I, 2), "w_down") ||
        tools_buffer_create_device(&rt->schedule, pl, st->sizes.schedule_bytes, "the schedule") ||
        tools_buffer_create_device(&rt->context, pl, st->sizes.context_bytes, "the forward context"))
        return -1;
    if (st->shape.precision == MOK_PRECISION_FP8 &&
        tools_buffer_create_device(&rt->fp8_weights, pl, st->fp8_layout.bytes, "the FP8 weights"))
        return -1;
    if (Is > 0 && (tools_buffer_mirror(&rt->s_gate, pl, st->shared[0], bytes_of(Is * H, 2), "s_gate") ||
                   tools_buffer_mirror(&rt->s_up, pl, st->shared[1], bytes_of(Is * H, 2), "s_up") ||
                   tools_buffer_mirror(&rt->s_down, pl, st->shared[2], bytes_of(H * Is, 2), "s_down")))
        return -1;
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
        if (!run_tensor_present(st, (tools_tensor)t)) continue;
        size_t bytes = bytes_of(run_tensor_count(st, T, (tools_tensor)t), run_output_element((tools_tensor)t));
        const char *name = tools_tolerance_of((tools_tensor)t, TOOLS_TABLE_BF16)->name; /* every table names them alike */
        if (tools_buffer_create_device(&rt->outputs[t], pl, bytes, name))
            return -1;
    }
    return 0;
}

/* Random activations and routing by rank, routed weights by global expert id (the same layer for
 * every P), then up to the library's memory. */
static int fill_inputs(run_state *st, int r) {
    const mok_shape *s = &st->shape;
    const int64_t H = s->hidden, I = s->intermediate, k = s->topk, E_local = st->num_local_experts;
    const uint64_t seed = st->opt->seed;
    rank_tensors *rt = &st->ranks[r];
    const int64_t T = rt->tokens;
    tools_rng rng = tools_rng_make(seed, TOOLS_STREAM_LOGITS, (uint64_t)r);
    if (tools_route(rt->topk_ids.host, rt->router_w.host, T, s->num_experts, k, st->opt->skew, &rng) != 0)
        return fprintf(stderr, "mok run: out of host memory for routing\n"), -1;
    tools_fill *fills = malloc((size_t)(3 * E_local + 2) * sizeof *fills);
    if (!fills) return fprintf(stderr, "mok run: out of host memory for the weights' streams\n"), -1;
    fills[0] = (tools_fill){rt->x.host, T * H, 1.0, tools_rng_make(seed, TOOLS_STREAM_X, (uint64_t)r)};
    fills[1] = (tools_fill){rt->dy.host, T * H, 1.0, tools_rng_make(seed, TOOLS_STREAM_DY, (uint64_t)r)};
    for (int64_t l = 0; l < E_local; ++l) {
        uint64_t expert = (uint64_t)(r * E_local + l);
        tools_fill *f = fills + 2 + 3 * l;
        f[0] = (tools_fill){(uint16_t *)rt->w_gate.host + l * I * H, I * H, tools_weight_bound(H),
                            tools_rng_make(seed, TOOLS_STREAM_W_GATE, expert)};
        f[1] = (tools_fill){(uint16_t *)rt->w_up.host + l * I * H, I * H, tools_weight_bound(H),
                            tools_rng_make(seed, TOOLS_STREAM_W_UP, expert)};
        f[2] = (tools_fill){(uint16_t *)rt->w_down.host + l * H * I, H * I, tools_weight_bound(I),
                            tools_rng_make(seed, TOOLS_STREAM_W_DOWN, expert)};
    }
    tools_fill_bf16_many(fills, 3 * E_local + 2);
    free(fills);
    tools_buffer *uploads[] = {&rt->x, &rt->dy, &rt->topk_ids, &rt->router_w, &rt->w_gate, &rt->w_up,
                               &rt->w_down, &rt->s_gate, &rt->s_up, &rt->s_down};
    for (size_t u = 0; u < sizeof uploads / sizeof uploads[0]; ++u)
        if (uploads[u]->host && tools_buffer_upload(uploads[u]) != 0) return -1;
    return 0;
}

static void fill_pass_args(run_state *st, int r) {
    rank_tensors *rt = &st->ranks[r];
    const int64_t T = rt->tokens;
    st->schedule_args[r] = (mok_schedule_args){
        .num_tokens = T, .topk_ids = rt->topk_ids.device, .schedule = rt->schedule.device, .stream = NULL};
    st->forward_args[r] = (mok_forward_args){
        .num_tokens = T, .schedule = rt->schedule.device, .x = rt->x.device, .router_w = rt->router_w.device,
        .w_gate = rt->w_gate.device, .w_up = rt->w_up.device, .w_down = rt->w_down.device,
        .s_gate = rt->s_gate.device, .s_up = rt->s_up.device, .s_down = rt->s_down.device,
        .y = rt->outputs[TOOLS_Y].device, .context = rt->context.device, .stream = NULL,
        .fp8_weights = rt->fp8_weights.device};
    st->backward_args[r] = (mok_backward_args){
        .num_tokens = T, .schedule = rt->schedule.device, .context = rt->context.device, .dy = rt->dy.device,
        .x = rt->x.device, .router_w = rt->router_w.device, .w_gate = rt->w_gate.device, .w_up = rt->w_up.device,
        .w_down = rt->w_down.device, .s_gate = rt->s_gate.device, .s_up = rt->s_up.device,
        .s_down = rt->s_down.device, .dx = rt->outputs[TOOLS_DX].device,
        .d_router_w = rt->outputs[TOOLS_D_ROUTER_W].device, .accumulate = 0,
        .dw_gate = rt->outputs[TOOLS_DW_GATE].device, .dw_up = rt->outputs[TOOLS_DW_UP].device,
        .dw_down = rt->outputs[TOOLS_DW_DOWN].device, .ds_gate = rt->outputs[TOOLS_DS_GATE].device,
        .ds_up = rt->outputs[TOOLS_DS_UP].device, .ds_down = rt->outputs[TOOLS_DS_DOWN].device, .stream = NULL,
        .fp8_weights = rt->fp8_weights.device};
    st->quantize_args[r] = (mok_quantize_args){
        .w_gate = rt->w_gate.device, .w_up = rt->w_up.device, .w_down = rt->w_down.device,
        .s_gate = rt->s_gate.device, .s_up = rt->s_up.device, .s_down = rt->s_down.device,
        .fp8_weights = rt->fp8_weights.device, .stream = NULL};
}

/* Rows that cross links in the forward: (p, t, j) whose expert lives on a rank q != p, counted on q
 * (dispatch brings the token's row to q, combine takes q's output row back). */
static void count_remote_rows(run_state *st) {
    const int64_t k = st->shape.topk, E_local = st->num_local_experts;
    for (int p = 0; p < st->nranks; ++p) {
        const int32_t *ids = st->ranks[p].topk_ids.host;
        for (int64_t i = 0; i < st->ranks[p].tokens * k; ++i) {
            if (ids[i] < 0 || E_local <= 0) continue;
            int64_t q = ids[i] / E_local;
            if (q != p && q < st->nranks) st->ranks[q].remote_rows++;
        }
    }
}

int64_t run_rank_tokens(const run_state *st, int rank) {
    return st->opt->uneven ? st->tokens * (rank + 1) / st->nranks : st->tokens;
}

int run_make_tensors(run_state *st) {
    if (allocate_arrays(st) != 0 || make_shared_expert(st) != 0) return -1;
    for (int r = 0; r < st->nranks; ++r) {
        st->ranks[r].tokens = run_rank_tokens(st, r);
        if (create_buffers(st, r) != 0 || fill_inputs(st, r) != 0) return -1;
        fill_pass_args(st, r);
    }
    count_remote_rows(st);
    return 0;
}

int run_switch_precision(run_state *st, mok_precision precision) {
    mok_workspace_destroy(st->workspace); /* first: the two workspaces are never held at once */
    st->workspace = NULL;
    st->shape.precision = precision;
    if (run_create_workspace(st) != 0) return -1;
    for (int r = 0; r < st->nranks; ++r) {
        rank_tensors *rt = &st->ranks[r];
        const tools_place place = {st->group, r, st->backend};
        if (rt->schedule.bytes < st->sizes.schedule_bytes) {
            tools_buffer_destroy(&rt->schedule);
            if (tools_buffer_create_device(&rt->schedule, &place, st->sizes.schedule_bytes, "the schedule")) return -1;
        }
        if (rt->context.bytes < st->sizes.context_bytes) {
            tools_buffer_destroy(&rt->context);
            if (tools_buffer_create_device(&rt->context, &place, st->sizes.context_bytes, "the forward context"))
                return -1;
        }
        fill_pass_args(st, r);
        if (precision != MOK_PRECISION_FP8) st->forward_args[r].fp8_weights = st->backward_args[r].fp8_weights = NULL;
    }
    return 0;
}

int run_quantize_weights(run_state *st) {
    CALL(mok_quantize_weights, st->workspace, st->quantize_args);
    CALL(mok_synchronize, st->workspace);
    return 0;
}

/* ---- the runs ----------------------------------------------------------------------------------- */

static uint64_t fnv1a(uint64_t hash, const void *data, size_t bytes) {
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
    return hash;
}

/* The bits of every output the passes wrote, read back chunk by chunk. */
static int hash_outputs(run_state *st, uint64_t *out) {
    const size_t chunk = (size_t)8 << 20;
    unsigned char *staging = malloc(chunk);
    if (!staging) return fprintf(stderr, "mok run: out of host memory\n"), -1;
    uint64_t hash = 0xcbf29ce484222325ull;
    int rc = 0;
    for (int r = 0; rc == 0 && r < st->nranks; ++r)
        for (int t = 0; rc == 0 && t < TOOLS_NUM_TENSORS; ++t) {
            if (!output_written(st, (tools_tensor)t)) continue;
            const tools_buffer *b = &st->ranks[r].outputs[t];
            for (size_t done = 0; rc == 0 && done < b->bytes; done += chunk) {
                size_t n = b->bytes - done < chunk ? b->bytes - done : chunk;
                rc = tools_buffer_read(b, done, staging, n);
                if (rc == 0) hash = fnv1a(hash, staging, n);
            }
        }
    free(staging);
    *out = hash;
    return rc;
}

typedef enum { PASS_SCHEDULE, PASS_FORWARD, PASS_BACKWARD } pass_kind;

/* One pass and the mok_synchronize that ends it (on cuda the calls only queue work), timed and
 * shown on the run's line. Returns its seconds, or -1 with the message printed after the line. */
static double timed_pass(run_state *st, pass_kind kind) {
    static const char *const names[] = {"schedule", "forward", "backward"};
    static const char *const functions[] = {"mok_schedule_build", "mok_forward", "mok_backward"};
    tools_progress_pass(st->progress, names[kind]);
    double start = tools_now_seconds();
    mok_status status = kind == PASS_SCHEDULE  ? mok_schedule_build(st->workspace, st->schedule_args)
                        : kind == PASS_FORWARD ? mok_forward(st->workspace, st->forward_args)
                                               : mok_backward(st->workspace, st->backward_args);
    const char *function = functions[kind];
    if (status == MOK_OK) {
        status = mok_synchronize(st->workspace);
        function = "mok_synchronize";
    }
    double seconds = tools_now_seconds() - start;
    if (status != MOK_OK) {
        tools_progress_end_line(st->progress);
        tools_library_failed(function, status);
        return -1.0;
    }
    tools_progress_done(st->progress, seconds);
    return seconds;
}

/* One schedule + forward (+ backward), outputs poisoned first so that the check sees only what
 * this run wrote. seconds and hash may be NULL (the untimed warm-up). */
static int run_once(run_state *st, const char *label, double *seconds, uint64_t *hash) {
    for (int r = 0; r < st->nranks; ++r)
        for (int t = 0; t < TOOLS_NUM_TENSORS; ++t)
            if (output_written(st, (tools_tensor)t) && tools_buffer_poison(&st->ranks[r].outputs[t]) != 0) return -1;
    CALL(mok_synchronize, st->workspace);
    tools_progress_line(st->progress, label);
    double phase[NUM_PHASES] = {0.0, 0.0, NAN, 0.0};
    for (int kind = PASS_SCHEDULE; kind <= (st->backward ? PASS_BACKWARD : PASS_FORWARD); ++kind) {
        phase[kind] = timed_pass(st, (pass_kind)kind);
        if (phase[kind] < 0.0) return -1;
    }
    tools_progress_end_line(st->progress);
    phase[PHASE_TOTAL] = phase[PHASE_SCHEDULE] + phase[PHASE_FORWARD] + (st->backward ? phase[PHASE_BACKWARD] : 0.0);
    if (seconds) memcpy(seconds, phase, sizeof phase);
    if (hash && (st->opt->check || st->opt->hash)) /* determinism: every run must write the same bits */
        if (hash_outputs(st, hash) != 0) return -1;
    return 0;
}

int run_passes(run_state *st) {
    /* cuda: the first run pays for module loading, first-touch of memory and the like. */
    if (st->backend == MOK_BACKEND_CUDA && run_once(st, "warm-up", NULL, NULL) != 0) return -1;
    for (int i = 0; i < st->opt->repeat; ++i) {
        char label[32];
        snprintf(label, sizeof label, "run %d/%d", i + 1, st->opt->repeat);
        if (run_once(st, label, st->seconds[i], &st->output_hashes[i]) != 0) return -1;
    }
    return 0;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int run_summarize(run_state *st) {
    const int R = st->opt->repeat;
    double *sorted = malloc((size_t)R * sizeof *sorted);
    if (!sorted) return fprintf(stderr, "mok run: out of host memory\n"), -1;
    for (int p = 0; p < NUM_PHASES; ++p) {
        int n = 0;
        for (int i = 0; i < R; ++i)
            if (!isnan(st->seconds[i][p])) sorted[n++] = st->seconds[i][p];
        if (n == 0) {
            st->median[p] = st->min[p] = st->max[p] = NAN;
            continue;
        }
        qsort(sorted, (size_t)n, sizeof *sorted, compare_doubles);
        st->median[p] = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
        st->min[p] = sorted[0];
        st->max[p] = sorted[n - 1];
    }
    free(sorted);
    return 0;
}

void run_destroy(run_state *st) {
    /* Statuses are ignored here: the run's outcome is already decided and printed. The buffers
     * go first: their memory belongs to the group's ranks. */
    for (int r = 0; st->ranks && r < st->nranks; ++r) {
        rank_tensors *rt = &st->ranks[r];
        tools_buffer *all[] = {&rt->x, &rt->dy, &rt->topk_ids, &rt->router_w, &rt->w_gate, &rt->w_up,
                               &rt->w_down, &rt->s_gate, &rt->s_up, &rt->s_down, &rt->schedule, &rt->context,
                               &rt->fp8_weights};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) tools_buffer_destroy(all[i]);
        for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) tools_buffer_destroy(&rt->outputs[t]);
    }
    if (st->workspace) mok_workspace_destroy(st->workspace);
    if (st->group) mok_group_destroy(st->group);
    for (int w = 0; w < 3; ++w) free(st->shared[w]);
    free(st->ranks);
    free(st->schedule_args);
    free(st->forward_args);
    free(st->backward_args);
    free(st->quantize_args);
    free(st->seconds);
    free(st->output_hashes);
}
