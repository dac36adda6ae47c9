/* mok.c — the `mok` command. `mok presets` lists the layers it knows; `mok run` builds one of
 * them (scaled down on request) on P ranks that this one process drives, with random weights and
 * routing, times the schedule, forward and backward passes, and with --check compares every
 * output and gradient with the library's fp64 reference.
 *
 * Backends: cpu (ranks are threads, memory is host memory) and cuda (rank r on GPU r, memory is
 * device memory; tools/buffers.c moves it). A backend whose backward is not supported yet
 * (mok_backward returns MOK_ERR_UNSUPPORTED) still gets its schedule and forward timed and
 * checked; the backward is reported as n/a.
 *
 * Exit status: 0 done (and PASS), 1 a --check FAIL, 2 bad usage or a failed library call. */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#endif

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "buffers.h"
#include "check.h"
#include "inputs.h"
#include "mok.h"
#include "presets.h"

/* --check without --check-tokens: every token when H*I is at most this, else the first
 * CHECK_TOKENS_LARGE tokens of each rank (the fp64 reference is naive). */
#define CHECK_FULL_MAX_HI (512 * 512)
#define CHECK_TOKENS_LARGE 32

static void usage(FILE *out) {
    fprintf(out,
            "usage: mok presets\n"
            "       mok run --preset NAME [options]\n"
            "\n"
            "mok run builds the preset's MoE layer on P ranks driven by this process, with random\n"
            "weights and softmax top-k routing of random logits, runs schedule, forward and backward\n"
            "--repeat times and prints the median time of each phase, its effective TFLOP/s, the\n"
            "memory per rank and, for P > 1, the forward's effective link bandwidth per rank.\n"
            "\n"
            "  --preset NAME       a layer from `mok presets` (case-insensitive)\n"
            "  --scale S           divide H, I, I_s and E by S > 0 (1 = full size, the default);\n"
            "                      dimensions round to multiples of %d, E to a multiple of P\n"
            "  --ranks P           expert-parallel ranks (default 1)\n"
            "  --tokens T          tokens per rank (default 4096 at full size, else 16384/S^2,\n"
            "                      at least 32 and at most 4096)\n"
            "  --uneven            rank r gets T*(r+1)/P tokens instead of T\n"
            "  --skew X            logit bias X*(1 - e/(E-1)): low expert ids hot (default 0)\n"
            "  --seed N            random inputs (default 1)\n"
            "  --backend B         cpu, cuda or auto (default auto: cuda when a GPU is visible,\n"
            "                      else cpu); cuda runs rank r on GPU r, so it needs P GPUs\n"
            "  --check             compare every output and gradient with the reference;\n"
            "                      prints PASS or FAIL (exit status 1)\n"
            "  --hash              without --check: print the outputs' hash and whether the\n"
            "                      --repeat runs wrote the same bits (PASS or FAIL, no reference)\n"
            "  --check-tokens N    with --check, run the reference on the first N tokens of every\n"
            "                      rank (default: all when H*I <= 512*512, else %d); when that is\n"
            "                      fewer than a rank has, the weight gradients (which sum over all\n"
            "                      tokens) are not compared, only y, dx and d_router_w\n"
            "  --no-backward       run (and check) schedule and forward only\n"
            "  --repeat R          timed runs to take the median of (default 3; on cuda one untimed\n"
            "                      warm-up run comes first)\n"
            "  --minibatch N       config minibatch_rows\n"
            "  --ring N            config ring_rows\n"
            "  --context-rows N    config context_rows (rows past it are replayed in the backward)\n"
            "  --threads N         config cpu_threads (per rank; 0 = the machine's cores)\n"
            "  --comm-threads N    config cpu_comm_threads\n"
            "  --comm-sms N        config fwd_comm_sms and bwd_comm_sms (cuda; 0 = auto)\n"
            "  --limit L           config swiglu_limit (0 = no clamp)\n"
            "  --fwd-dispatch D    config fwd_dispatch: pull (default) or push (each rank writes\n"
            "                      its x rows into the peers' rings)\n"
            "  --fwd-combine D     config fwd_combine: push (default) or pull (each rank gathers\n"
            "                      its expert outputs from the peers' rings)\n"
            "  --bwd-combine D     config bwd_combine: pull (default) or push (each rank writes\n"
            "                      its dy and x rows into the peers' rings)\n"
            "  --bwd-dispatch D    config bwd_dispatch: push (default) or pull (each rank\n"
            "                      gathers its dx parts and router-weight gradients)\n"
            "  --trace PATH        record the last run's tasks as Chrome trace JSON\n"
            "\n"
            "A backend that cannot run the backward yet gets it reported as n/a; the run still\n"
            "succeeds.\n"
            "\n"
            "Exit status: 0 success, 1 --check failed, 2 bad arguments or a library error.\n",
            MOK_DIM_TILE, CHECK_TOKENS_LARGE);
}

/* ---- argument parsing ----------------------------------------------------------------------- */

typedef struct run_options {
    const tools_preset *preset;
    double scale;
    int nranks;
    int64_t tokens; /* per rank; -1 = tools_default_tokens(scale) */
    int uneven;
    double skew;
    uint64_t seed;
    mok_backend backend;
    int check;
    int hash; /* --hash: the outputs' hash and the runs' bitwise agreement, without the reference */
    int64_t check_tokens; /* per rank; -1 = the default (see CHECK_FULL_MAX_HI) */
    int no_backward;
    int repeat;
    const char *trace_path;
    mok_config config;
} run_options;

static int bad_value(const char *flag, const char *text, const char *expected) {
    fprintf(stderr, "mok run: %s expects %s, not '%s'\n", flag, expected, text);
    return -1;
}

static int parse_int64(const char *flag, const char *text, int64_t min, int64_t max, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (text[0] == '\0' || text[0] == ' ' || text[0] == '\t' || end == text || *end != '\0')
        return bad_value(flag, text, "an integer");
    if (errno == ERANGE || value < min || value > max) {
        if (min == INT_MIN && max == INT_MAX) return bad_value(flag, text, "an integer that fits in an int");
        if (max == INT64_MAX)
            fprintf(stderr, "mok run: %s must be at least %lld, not '%s'\n", flag, (long long)min, text);
        else
            fprintf(stderr, "mok run: %s must be between %lld and %lld, not '%s'\n", flag, (long long)min,
                    (long long)max, text);
        return -1;
    }
    *out = value;
    return 0;
}

static int parse_int(const char *flag, const char *text, int *out) {
    int64_t value;
    if (parse_int64(flag, text, INT_MIN, INT_MAX, &value) != 0) return -1;
    *out = (int)value;
    return 0;
}

static int parse_double(const char *flag, const char *text, double *out) {
    char *end = NULL;
    errno = 0;
    double value = strtod(text, &end);
    if (text[0] == '\0' || text[0] == ' ' || text[0] == '\t' || end == text || *end != '\0' ||
        errno == ERANGE || !isfinite(value))
        return bad_value(flag, text, "a finite number");
    *out = value;
    return 0;
}

static int parse_seed(const char *text, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    if (text[0] < '0' || text[0] > '9') return bad_value("--seed", text, "a non-negative integer");
    unsigned long long value = strtoull(text, &end, 10);
    if (*end != '\0' || errno == ERANGE) return bad_value("--seed", text, "a non-negative 64-bit integer");
    *out = value;
    return 0;
}

static int lower(int c) { return c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c; }

static int equal_ignoring_case(const char *a, const char *b) {
    for (; *a && *b; ++a, ++b)
        if (lower((unsigned char)*a) != lower((unsigned char)*b)) return 0;
    return *a == *b;
}

static int parse_backend(const char *text, mok_backend *out) {
    if (equal_ignoring_case(text, "cpu")) *out = MOK_BACKEND_CPU;
    else if (equal_ignoring_case(text, "cuda")) *out = MOK_BACKEND_CUDA;
    else if (equal_ignoring_case(text, "auto")) *out = MOK_BACKEND_AUTO;
    else return bad_value("--backend", text, "cpu, cuda or auto");
    return 0;
}

/* Returns 0 to run, 1 after printing help, -1 on a bad argument (message printed). */
static int parse_run_options(int argc, char **argv, run_options *opt) {
    memset(opt, 0, sizeof *opt);
    opt->scale = 1.0;
    opt->nranks = 1;
    opt->tokens = -1;
    opt->seed = 1;
    opt->backend = MOK_BACKEND_AUTO;
    opt->check_tokens = -1;
    opt->repeat = 3;
    opt->config = mok_config_default();

    for (int i = 0; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(arg, "--check") == 0) {
            opt->check = 1;
            continue;
        }
        if (strcmp(arg, "--hash") == 0) {
            opt->hash = 1;
            continue;
        }
        if (strcmp(arg, "--uneven") == 0) {
            opt->uneven = 1;
            continue;
        }
        if (strcmp(arg, "--no-backward") == 0) {
            opt->no_backward = 1;
            continue;
        }
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "mok run: unexpected argument '%s' (see mok --help)\n", arg);
            return -1;
        }
        /* Every other flag takes a value: --flag VALUE or --flag=VALUE. */
        char flag[64];
        const char *value;
        const char *equals = strchr(arg, '=');
        if (equals) {
            size_t length = (size_t)(equals - arg);
            if (length >= sizeof flag) length = sizeof flag - 1;
            memcpy(flag, arg, length);
            flag[length] = '\0';
            value = equals + 1;
        } else {
            snprintf(flag, sizeof flag, "%s", arg);
            value = i + 1 < argc ? argv[i + 1] : NULL;
        }
        static const char *const valued[] = {"--preset", "--scale", "--ranks", "--tokens", "--skew",
                                             "--seed", "--backend", "--repeat", "--minibatch", "--ring",
                                             "--context-rows", "--threads", "--comm-threads", "--limit",
                                             "--trace", "--check-tokens", "--comm-sms", "--fwd-dispatch",
                                             "--fwd-combine", "--bwd-combine", "--bwd-dispatch"};
        int known = 0;
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; ++k) known |= strcmp(flag, valued[k]) == 0;
        if (!known) {
            fprintf(stderr, "mok run: unknown option '%s' (see mok --help)\n", arg);
            return -1;
        }
        if (!value) {
            fprintf(stderr, "mok run: %s needs a value\n", flag);
            return -1;
        }
        if (!equals) ++i;

        int64_t number;
        int rc = 0;
        if (strcmp(flag, "--preset") == 0) {
            opt->preset = tools_preset_find(value);
            if (!opt->preset) {
                fprintf(stderr, "mok run: unknown preset '%s'; `mok presets` lists them\n", value);
                return -1;
            }
        } else if (strcmp(flag, "--scale") == 0) {
            rc = parse_double(flag, value, &opt->scale);
            if (rc == 0 && !(opt->scale > 0.0)) {
                fprintf(stderr, "mok run: --scale must be greater than 0, not '%s'\n", value);
                rc = -1;
            }
        } else if (strcmp(flag, "--ranks") == 0) {
            rc = parse_int(flag, value, &opt->nranks); /* the library checks the range */
        } else if (strcmp(flag, "--tokens") == 0) {
            rc = parse_int64(flag, value, 0, INT64_MAX, &opt->tokens);
        } else if (strcmp(flag, "--skew") == 0) {
            rc = parse_double(flag, value, &opt->skew);
        } else if (strcmp(flag, "--seed") == 0) {
            rc = parse_seed(value, &opt->seed);
        } else if (strcmp(flag, "--backend") == 0) {
            rc = parse_backend(value, &opt->backend);
        } else if (strcmp(flag, "--check-tokens") == 0) {
            rc = parse_int64(flag, value, 1, INT64_MAX, &opt->check_tokens);
        } else if (strcmp(flag, "--repeat") == 0) {
            rc = parse_int64(flag, value, 1, 1000000, &number);
            opt->repeat = (int)number;
        } else if (strcmp(flag, "--minibatch") == 0) {
            rc = parse_int(flag, value, &opt->config.minibatch_rows);
        } else if (strcmp(flag, "--ring") == 0) {
            rc = parse_int(flag, value, &opt->config.ring_rows);
        } else if (strcmp(flag, "--context-rows") == 0) {
            rc = parse_int64(flag, value, INT64_MIN, INT64_MAX, &opt->config.context_rows);
        } else if (strcmp(flag, "--threads") == 0) {
            rc = parse_int(flag, value, &opt->config.cpu_threads);
        } else if (strcmp(flag, "--comm-threads") == 0) {
            rc = parse_int(flag, value, &opt->config.cpu_comm_threads);
        } else if (strcmp(flag, "--comm-sms") == 0) {
            rc = parse_int(flag, value, &opt->config.fwd_comm_sms); /* the library checks the range */
            opt->config.bwd_comm_sms = opt->config.fwd_comm_sms;
        } else if (strcmp(flag, "--limit") == 0) {
            double limit;
            rc = parse_double(flag, value, &limit);
            if (rc == 0 && fabs(limit) > 3.0e38) rc = bad_value(flag, value, "a number in float range");
            opt->config.swiglu_limit = (float)limit;
        } else if (strcmp(flag, "--trace") == 0) {
            opt->trace_path = value;
            opt->config.trace = 1;
        } else if (strcmp(flag, "--fwd-dispatch") == 0 || strcmp(flag, "--fwd-combine") == 0 ||
                   strcmp(flag, "--bwd-combine") == 0 || strcmp(flag, "--bwd-dispatch") == 0) {
            int *field = strcmp(flag, "--fwd-dispatch") == 0  ? &opt->config.fwd_dispatch
                         : strcmp(flag, "--fwd-combine") == 0 ? &opt->config.fwd_combine
                         : strcmp(flag, "--bwd-combine") == 0 ? &opt->config.bwd_combine
                                                              : &opt->config.bwd_dispatch;
            if (strcmp(value, "push") == 0) *field = MOK_PUSH;
            else if (strcmp(value, "pull") == 0) *field = MOK_PULL;
            else rc = bad_value(flag, value, "push or pull");
        }
        if (rc != 0) return -1;
    }
    if (!opt->preset) {
        fprintf(stderr, "mok run: --preset NAME is required; `mok presets` lists them\n");
        return -1;
    }
    return 0;
}

/* ---- the run -------------------------------------------------------------------------------- */

enum { PHASE_SCHEDULE, PHASE_FORWARD, PHASE_BACKWARD, PHASE_TOTAL, NUM_PHASES };
static const char *const phase_names[NUM_PHASES] = {"schedule", "forward", "backward", "total"};

/* One rank's tensors, in the layouts of mok.h. Shared-expert buffers mirror one host copy. */
typedef struct rank_tensors {
    int64_t tokens;
    int64_t remote_rows;                    /* (token, slot) pairs of other ranks routed here */
    tools_buffer x, dy;                     /* [T, H] bf16 */
    tools_buffer topk_ids, router_w;        /* [T, k] */
    tools_buffer w_gate, w_up, w_down;      /* [E_local, I, H], [E_local, H, I] */
    tools_buffer s_gate, s_up, s_down;      /* [I_s, H], [H, I_s]; empty when I_s = 0 */
    tools_buffer outputs[TOOLS_NUM_TENSORS]; /* y, dx, d_router_w, then the gradients (bf16);
                                               library memory only, read back for --check */
    tools_buffer schedule, context;         /* library memory only */
} rank_tensors;

typedef struct run_state {
    const run_options *opt;
    mok_shape shape;
    int nranks;
    mok_backend backend;
    int64_t num_local_experts;
    mok_group *group;
    mok_workspace *workspace;
    mok_sizes sizes;
    uint16_t *shared[3]; /* host copies of s_gate, s_up, s_down */
    rank_tensors *ranks;
    mok_schedule_args *schedule_args;
    mok_forward_args *forward_args;
    mok_backward_args *backward_args;
    double (*seconds)[NUM_PHASES]; /* [repeat]; NAN for a phase that did not run */
    uint64_t *output_hashes;       /* [repeat], with --check */
    double input_seconds;          /* making and uploading the random inputs */
    double median[NUM_PHASES], min[NUM_PHASES], max[NUM_PHASES]; /* NAN: the phase never ran */
    /* The backward: skipped with --no-backward, or reported n/a once mok_backward has returned
     * MOK_ERR_UNSUPPORTED (its message is kept); backward_ran says whether any run did it. */
    int skip_backward;
    int backward_ran;
    char backward_note[512];
} run_state;

static int library_failed(const char *function, mok_status status) {
    fprintf(stderr, "mok: %s: %s: %s\n", function, mok_status_string(status), mok_last_error());
    return -1;
}

/* Calls a library function; on failure prints `mok: <function>: <status>: <message>` and makes
 * the enclosing function return -1. */
#define CALL(function, ...)                                                 \
    do {                                                                    \
        mok_status call_status_ = function(__VA_ARGS__);                    \
        if (call_status_ != MOK_OK) return library_failed(#function, call_status_); \
    } while (0)

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int64_t tensor_count(const run_state *st, int64_t tokens, tools_tensor tensor) {
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

/* y, dx and d_router_w have one row per token; the weight gradients sum over all tokens. */
static int per_token(tools_tensor tensor) { return tensor <= TOOLS_D_ROUTER_W; }

/* What the library writes per element (the gradients as bf16: accumulate = 0). */
static size_t output_element(tools_tensor tensor) { return tensor == TOOLS_D_ROUTER_W ? 4 : 2; }

static int has_shared(const run_state *st) { return st->shape.shared_intermediate > 0; }

static int tensor_present(const run_state *st, tools_tensor tensor) {
    return tensor < TOOLS_DS_GATE || has_shared(st);
}

static tools_place place_of(const run_state *st, int rank) {
    tools_place place = {st->group, rank, st->backend};
    return place;
}

/* Creates the group and workspace. The library validates the config and the shape first, so
 * that a bad flag fails before anything is allocated. */
static int create_group(run_state *st) {
    const run_options *opt = st->opt;
    CALL(mok_config_validate, &opt->config);
    CALL(mok_shape_validate, &st->shape, st->nranks);

    /* auto follows the library's rule (cuda when a GPU is visible); it is resolved here because
     * the devices argument depends on the backend. */
    int gpus = mok_backend_available(MOK_BACKEND_CUDA);
    mok_backend requested = opt->backend;
    if (requested == MOK_BACKEND_AUTO) requested = gpus > 0 ? MOK_BACKEND_CUDA : MOK_BACKEND_CPU;
    /* With no GPU at all the library itself refuses cuda, with its own message. */
    if (requested == MOK_BACKEND_CUDA && gpus > 0 && gpus < st->nranks) {
        fprintf(stderr,
                "mok run: %d ranks on the cuda backend need %d GPUs (rank r runs on GPU r), but %d %s "
                "visible; use --ranks %d or less%s\n",
                st->nranks, st->nranks, gpus, gpus == 1 ? "is" : "are", gpus,
                opt->backend == MOK_BACKEND_AUTO ? ", or --backend cpu" : "");
        return -1;
    }
    int *devices = NULL; /* GPU ordinals 0..P-1 on cuda; NULL on cpu */
    if (requested == MOK_BACKEND_CUDA) {
        devices = malloc((size_t)st->nranks * sizeof *devices);
        if (!devices) return fprintf(stderr, "mok run: out of host memory\n"), -1;
        for (int r = 0; r < st->nranks; ++r) devices[r] = r;
    }
    mok_status status = mok_group_create_local(&st->group, requested, st->nranks, devices, &opt->config);
    free(devices);
    if (status != MOK_OK) return library_failed("mok_group_create_local", status);

    int nranks = 0, num_local = 0, first_rank = 0;
    CALL(mok_group_info, st->group, &nranks, &num_local, &first_rank, &st->backend);
    if (st->backend != MOK_BACKEND_CPU && st->backend != MOK_BACKEND_CUDA) {
        fprintf(stderr, "mok run: the group has backend %s, which this command does not know\n",
                mok_backend_name(st->backend));
        return -1;
    }
    if (nranks != st->nranks || num_local != st->nranks || first_rank != 0) {
        fprintf(stderr, "mok run: the group drives %d of %d ranks from rank %d; expected all %d\n",
                num_local, nranks, first_rank, st->nranks);
        return -1;
    }
    CALL(mok_workspace_create, &st->workspace, st->group, &st->shape, &opt->config);
    CALL(mok_workspace_sizes, st->workspace, &st->sizes);
    return 0;
}

static size_t bytes_of(int64_t count, size_t element) { return (size_t)count * element; }

/* Makes every rank's inputs and output buffers and fills the argument arrays of the passes. */
static int make_tensors(run_state *st) {
    const mok_shape *s = &st->shape;
    const run_options *opt = st->opt;
    const int P = st->nranks;
    const int64_t H = s->hidden, I = s->intermediate, Is = s->shared_intermediate, k = s->topk;
    const int64_t E_local = st->num_local_experts;

    st->ranks = calloc((size_t)P, sizeof *st->ranks);
    st->schedule_args = calloc((size_t)P, sizeof *st->schedule_args);
    st->forward_args = calloc((size_t)P, sizeof *st->forward_args);
    st->backward_args = calloc((size_t)P, sizeof *st->backward_args);
    st->seconds = calloc((size_t)opt->repeat, sizeof *st->seconds);
    st->output_hashes = calloc((size_t)opt->repeat, sizeof *st->output_hashes);
    if (!st->ranks || !st->schedule_args || !st->forward_args || !st->backward_args || !st->seconds ||
        !st->output_hashes)
        return fprintf(stderr, "mok run: out of host memory\n"), -1;

    /* The shared expert: one host copy, the same weights on every rank. */
    if (Is > 0) {
        static const tools_stream streams[3] = {TOOLS_STREAM_S_GATE, TOOLS_STREAM_S_UP, TOOLS_STREAM_S_DOWN};
        for (int w = 0; w < 3; ++w) {
            st->shared[w] = tools_host_alloc(bytes_of(Is * H, 2));
            if (!st->shared[w]) return fprintf(stderr, "mok run: out of host memory for the shared expert\n"), -1;
            tools_rng rng = tools_rng_make(opt->seed, streams[w], 0);
            tools_fill_bf16(st->shared[w], Is * H, tools_weight_bound(w == 2 ? Is : H), &rng);
        }
    }

    for (int r = 0; r < P; ++r) {
        rank_tensors *rt = &st->ranks[r];
        const tools_place place = place_of(st, r);
        const tools_place *pl = &place;
        int64_t T = opt->uneven ? s->max_tokens * (r + 1) / P : s->max_tokens;
        if (opt->tokens == 0) T = 0; /* max_tokens is at least 1; --tokens 0 means none */
        rt->tokens = T;

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
        if (Is > 0 && (tools_buffer_mirror(&rt->s_gate, pl, st->shared[0], bytes_of(Is * H, 2), "s_gate") ||
                       tools_buffer_mirror(&rt->s_up, pl, st->shared[1], bytes_of(Is * H, 2), "s_up") ||
                       tools_buffer_mirror(&rt->s_down, pl, st->shared[2], bytes_of(H * Is, 2), "s_down")))
            return -1;
        for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
            if (!tensor_present(st, (tools_tensor)t)) continue;
            size_t bytes = bytes_of(tensor_count(st, T, (tools_tensor)t), output_element((tools_tensor)t));
            if (tools_buffer_create_device(&rt->outputs[t], pl, bytes, tools_tolerance_of((tools_tensor)t)->name))
                return -1;
        }

        tools_rng rng = tools_rng_make(opt->seed, TOOLS_STREAM_X, (uint64_t)r);
        tools_fill_bf16(rt->x.host, T * H, 1.0, &rng);
        rng = tools_rng_make(opt->seed, TOOLS_STREAM_DY, (uint64_t)r);
        tools_fill_bf16(rt->dy.host, T * H, 1.0, &rng);
        rng = tools_rng_make(opt->seed, TOOLS_STREAM_LOGITS, (uint64_t)r);
        if (tools_route(rt->topk_ids.host, rt->router_w.host, T, s->num_experts, k, opt->skew, &rng) != 0)
            return fprintf(stderr, "mok run: out of host memory for routing\n"), -1;
        /* Routed weights are keyed by global expert id: the same layer for every P. */
        for (int64_t l = 0; l < E_local; ++l) {
            uint64_t expert = (uint64_t)(r * E_local + l);
            rng = tools_rng_make(opt->seed, TOOLS_STREAM_W_GATE, expert);
            tools_fill_bf16((uint16_t *)rt->w_gate.host + l * I * H, I * H, tools_weight_bound(H), &rng);
            rng = tools_rng_make(opt->seed, TOOLS_STREAM_W_UP, expert);
            tools_fill_bf16((uint16_t *)rt->w_up.host + l * I * H, I * H, tools_weight_bound(H), &rng);
            rng = tools_rng_make(opt->seed, TOOLS_STREAM_W_DOWN, expert);
            tools_fill_bf16((uint16_t *)rt->w_down.host + l * H * I, H * I, tools_weight_bound(I), &rng);
        }
        tools_buffer *uploads[] = {&rt->x, &rt->dy, &rt->topk_ids, &rt->router_w, &rt->w_gate, &rt->w_up,
                                   &rt->w_down, &rt->s_gate, &rt->s_up, &rt->s_down};
        for (size_t u = 0; u < sizeof uploads / sizeof uploads[0]; ++u)
            if (uploads[u]->host && tools_buffer_upload(uploads[u]) != 0) return -1;

        st->schedule_args[r] = (mok_schedule_args){
            .num_tokens = T, .topk_ids = rt->topk_ids.device, .schedule = rt->schedule.device, .stream = NULL};
        st->forward_args[r] = (mok_forward_args){
            .num_tokens = T, .schedule = rt->schedule.device, .x = rt->x.device,
            .router_w = rt->router_w.device, .w_gate = rt->w_gate.device, .w_up = rt->w_up.device,
            .w_down = rt->w_down.device, .s_gate = rt->s_gate.device, .s_up = rt->s_up.device,
            .s_down = rt->s_down.device, .y = rt->outputs[TOOLS_Y].device, .context = rt->context.device,
            .stream = NULL};
        st->backward_args[r] = (mok_backward_args){
            .num_tokens = T, .schedule = rt->schedule.device, .context = rt->context.device,
            .dy = rt->dy.device, .x = rt->x.device, .router_w = rt->router_w.device,
            .w_gate = rt->w_gate.device, .w_up = rt->w_up.device, .w_down = rt->w_down.device,
            .s_gate = rt->s_gate.device, .s_up = rt->s_up.device, .s_down = rt->s_down.device,
            .dx = rt->outputs[TOOLS_DX].device, .d_router_w = rt->outputs[TOOLS_D_ROUTER_W].device,
            .accumulate = 0, .dw_gate = rt->outputs[TOOLS_DW_GATE].device,
            .dw_up = rt->outputs[TOOLS_DW_UP].device, .dw_down = rt->outputs[TOOLS_DW_DOWN].device,
            .ds_gate = rt->outputs[TOOLS_DS_GATE].device, .ds_up = rt->outputs[TOOLS_DS_UP].device,
            .ds_down = rt->outputs[TOOLS_DS_DOWN].device, .stream = NULL};
    }

    /* Rows that cross links in the forward: (p, t, j) whose expert lives on a rank q != p, counted
     * on q (dispatch brings the token's row to q, combine takes q's output row back). */
    for (int p = 0; p < P; ++p) {
        const int32_t *ids = st->ranks[p].topk_ids.host;
        for (int64_t i = 0; i < st->ranks[p].tokens * k; ++i) {
            if (ids[i] < 0 || E_local <= 0) continue;
            int64_t q = ids[i] / E_local;
            if (q != p && q < P) st->ranks[q].remote_rows++;
        }
    }
    return 0;
}

static uint64_t fnv1a(uint64_t hash, const void *data, size_t bytes) {
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
    return hash;
}

/* Whether an output is written by the passes that run: y by the forward, the rest by the
 * backward. */
static int output_written(const run_state *st, tools_tensor tensor, int backward) {
    return tensor_present(st, tensor) && (tensor == TOOLS_Y || backward);
}

/* The bits of every output the passes wrote, read back chunk by chunk. */
static int hash_outputs(run_state *st, int backward, uint64_t *out) {
    const size_t chunk = (size_t)8 << 20;
    unsigned char *staging = malloc(chunk);
    if (!staging) return fprintf(stderr, "mok run: out of host memory\n"), -1;
    uint64_t hash = 0xcbf29ce484222325ull;
    int rc = 0;
    for (int r = 0; rc == 0 && r < st->nranks; ++r)
        for (int t = 0; rc == 0 && t < TOOLS_NUM_TENSORS; ++t) {
            if (!output_written(st, (tools_tensor)t, backward)) continue;
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

/* One schedule + forward (+ backward), outputs poisoned first so that the check sees only what
 * this run wrote. Every timed phase ends with mok_synchronize inside its timing: on cuda the
 * calls only queue work. seconds and hash may be NULL (the untimed warm-up). */
static int run_once(run_state *st, double *seconds, uint64_t *hash) {
    int backward = !st->skip_backward;
    for (int r = 0; r < st->nranks; ++r)
        for (int t = 0; t < TOOLS_NUM_TENSORS; ++t)
            if (output_written(st, (tools_tensor)t, backward) && tools_buffer_poison(&st->ranks[r].outputs[t]) != 0)
                return -1;
    CALL(mok_synchronize, st->workspace);

    double start = now_seconds();
    CALL(mok_schedule_build, st->workspace, st->schedule_args);
    CALL(mok_synchronize, st->workspace);
    double scheduled = now_seconds();
    CALL(mok_forward, st->workspace, st->forward_args);
    CALL(mok_synchronize, st->workspace);
    double forwarded = now_seconds();
    double done = forwarded;
    if (backward) {
        mok_status status = mok_backward(st->workspace, st->backward_args);
        if (status == MOK_ERR_UNSUPPORTED) {
            /* Not a failure of the run: the backend cannot do it yet. Later runs skip it. */
            snprintf(st->backward_note, sizeof st->backward_note, "%s", mok_last_error());
            st->skip_backward = 1;
            backward = 0;
        } else if (status != MOK_OK) {
            return library_failed("mok_backward", status);
        } else {
            CALL(mok_synchronize, st->workspace);
            done = now_seconds();
            st->backward_ran = 1;
        }
    }
    if (seconds) {
        seconds[PHASE_SCHEDULE] = scheduled - start;
        seconds[PHASE_FORWARD] = forwarded - scheduled;
        seconds[PHASE_BACKWARD] = backward ? done - forwarded : NAN;
        seconds[PHASE_TOTAL] = done - start;
    }
    if (hash && (st->opt->check || st->opt->hash)) /* determinism: every run must write the same bits */
        if (hash_outputs(st, backward, hash) != 0) return -1;
    return 0;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median, min and max of each phase over the runs that did it (NAN when none did). */
static int summarize_timings(run_state *st) {
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

static void format_bytes(char *out, size_t size, size_t bytes) {
    if (bytes >= ((size_t)1 << 30)) snprintf(out, size, "%.2f GiB", (double)bytes / (double)(1u << 30));
    else if (bytes >= ((size_t)1 << 20)) snprintf(out, size, "%.2f MiB", (double)bytes / (double)(1u << 20));
    else snprintf(out, size, "%.1f KiB", (double)bytes / 1024.0);
}

/* Bytes that crossed rank q's links in the forward: its remote rows, H bf16 values each, once
 * in the dispatch and once in the combine. */
static double link_bytes(const run_state *st, int q) {
    return 2.0 * (double)st->ranks[q].remote_rows * (double)st->shape.hidden * 2.0;
}

/* Effective GB/s per rank of the forward's links (median forward time); NAN if not known. */
static double link_gbps(const run_state *st, int q) {
    double seconds = st->median[PHASE_FORWARD];
    return seconds > 0.0 ? link_bytes(st, q) / seconds * 1e-9 : NAN;
}

static int print_header(run_state *st) {
    const run_options *opt = st->opt;
    const mok_shape *s = &st->shape;
    const mok_config *c = &opt->config;
    int64_t all_tokens = 0;
    for (int r = 0; r < st->nranks; ++r) all_tokens += st->ranks[r].tokens;

    printf("mok run  preset %s  scale %g  backend %s  ranks %d  seed %llu  skew %g\n", opt->preset->name,
           opt->scale, mok_backend_name(st->backend), st->nranks, (unsigned long long)opt->seed, opt->skew);
    printf("layer    H %lld  I %lld  E %lld (%lld per rank)  k %lld  shared I %lld\n", (long long)s->hidden,
           (long long)s->intermediate, (long long)s->num_experts, (long long)st->num_local_experts,
           (long long)s->topk, (long long)s->shared_intermediate);
    printf("tokens   %lld per rank%s (%lld in all)\n", (long long)s->max_tokens,
           opt->uneven ? " at most, rank r has T*(r+1)/P" : "", (long long)all_tokens);
    char threads[32];
    if (c->cpu_threads == 0) snprintf(threads, sizeof threads, "all cores");
    else snprintf(threads, sizeof threads, "%d", c->cpu_threads);
    char context[32];
    if (c->context_rows == 0) snprintf(context, sizeof context, "all");
    else snprintf(context, sizeof context, "%lld", (long long)c->context_rows);
    char limit[32];
    if (c->swiglu_limit > 0.0f) snprintf(limit, sizeof limit, "%g", (double)c->swiglu_limit);
    else snprintf(limit, sizeof limit, "none");
    printf("config   minibatch %d rows  ring %d rows  context rows %s  swiglu limit %s\n", c->minibatch_rows,
           c->ring_rows, context, limit);
    if (st->backend == MOK_BACKEND_CPU)
        printf("         cpu threads per rank %s, %d of them moving data\n", threads, c->cpu_comm_threads);
    else
        printf("         rank r on GPU r (GPUs 0..%d); SMs moving data: forward %d, backward %d (0: auto)\n",
               st->nranks - 1, c->fwd_comm_sms, c->bwd_comm_sms);
    char tuning[256]; /* the backend's knobs as the workspace resolved them (none on cpu) */
    if (mok_workspace_tuning(st->workspace, tuning, sizeof tuning) == MOK_OK && tuning[0]) printf("tuning   %s\n", tuning);
    char sched[32], ctx[32], ws[32], sym[32];
    format_bytes(sched, sizeof sched, st->sizes.schedule_bytes);
    format_bytes(ctx, sizeof ctx, st->sizes.context_bytes);
    format_bytes(ws, sizeof ws, st->sizes.workspace_bytes);
    format_bytes(sym, sizeof sym, st->sizes.symmetric_bytes);
    printf("memory   per rank: workspace %s (%zu bytes), of it symmetric %s (%zu bytes)\n", ws,
           st->sizes.workspace_bytes, sym, st->sizes.symmetric_bytes);
    printf("         schedule %s, context %s; worst case %lld routed rows\n", sched, ctx,
           (long long)st->sizes.max_routed_rows);
    printf("inputs   random, made in %.2f s\n", st->input_seconds);

    int links = st->nranks > 1;
    printf("\n%4s %8s %12s %12s %15s %12s %13s", "rank", "tokens", "routed rows", "padded rows",
           "busiest expert", "minibatches", "macrobatches");
    if (links) printf(" %12s %14s", "remote rows", "fwd link GB/s");
    printf("\n");
    for (int r = 0; r < st->nranks; ++r) {
        mok_schedule_info info;
        CALL(mok_schedule_read, st->workspace, st->ranks[r].schedule.device, r, &info);
        printf("%4d %8lld %12lld %12lld %15lld %12lld %13lld", r, (long long)st->ranks[r].tokens,
               (long long)info.routed_rows, (long long)info.padded_rows, (long long)info.max_expert_rows,
               (long long)info.num_minibatches, (long long)info.num_macrobatches);
        if (links) printf(" %12lld %14.4g", (long long)st->ranks[r].remote_rows, link_gbps(st, r));
        printf("\n");
    }
    if (links)
        printf("(remote rows: rows of other ranks' tokens routed to this rank's experts; fwd link GB/s:\n"
               " remote rows x H x 2 bytes, dispatch plus combine, over the median forward time)\n");
    return 0;
}

/* Effective FLOPs per rank, averaged over ranks (DESIGN 6): forward 6·T·k·H·I routed plus
 * 6·T·H·I_s shared, backward twice that. */
static void print_timings(const run_state *st) {
    const mok_shape *s = &st->shape;
    const int R = st->opt->repeat;
    double tokens = 0.0;
    for (int r = 0; r < st->nranks; ++r) tokens += (double)st->ranks[r].tokens;
    tokens /= (double)st->nranks;
    double forward_flops = 6.0 * tokens * (double)s->hidden *
                           ((double)s->topk * (double)s->intermediate + (double)s->shared_intermediate);
    int backward = !isnan(st->median[PHASE_BACKWARD]);
    double flops[NUM_PHASES] = {0.0, forward_flops, 2.0 * forward_flops,
                                (backward ? 3.0 : 1.0) * forward_flops};

    printf("\n%-9s %11s %10s %10s %17s\n", "phase", "median ms", "min ms", "max ms", "TFLOP/s per rank");
    for (int p = 0; p < NUM_PHASES; ++p) {
        if (isnan(st->median[p])) {
            printf("%-9s n/a (%s)\n", phase_names[p],
                   st->backward_note[0] ? st->backward_note : "did not run");
            continue;
        }
        printf("%-9s %11.3f %10.3f %10.3f", phase_names[p], 1e3 * st->median[p], 1e3 * st->min[p],
               1e3 * st->max[p]);
        if (flops[p] > 0.0 && st->median[p] > 0.0) printf(" %17.4g", flops[p] / st->median[p] * 1e-12);
        if (p == PHASE_TOTAL && !backward) printf("   (schedule + forward)");
        printf("\n");
    }
    printf("(host wall clock around each call and the mok_synchronize that ends it; %d run%s%s;\n"
           " TFLOP/s counts %s)\n",
           R, R == 1 ? "" : "s, median", st->backend == MOK_BACKEND_CUDA ? ", after one untimed warm-up run" : "",
           s->shared_intermediate > 0 ? "6*T*H*(k*I + I_s) forward, twice that backward"
                                      : "6*T*k*H*I forward, twice that backward");
    if (st->nranks > 1 && st->median[PHASE_FORWARD] > 0.0) {
        double sum = 0.0, most = -1.0, bytes = 0.0;
        int busiest = 0;
        for (int q = 0; q < st->nranks; ++q) {
            double gbps = link_gbps(st, q);
            sum += gbps;
            bytes += link_bytes(st, q);
            if (gbps > most) {
                most = gbps;
                busiest = q;
            }
        }
        printf("forward links: %.4g MB per rank on average crossed them, %.4g GB/s per rank on average,\n"
               "               %.4g GB/s at most (rank %d)\n",
               bytes / st->nranks * 1e-6, sum / st->nranks, most, busiest);
    }
}

/* The tokens per rank that --check hands the reference. */
static int64_t check_tokens_of(const run_state *st) {
    if (st->opt->check_tokens >= 0) return st->opt->check_tokens;
    return st->shape.hidden * st->shape.intermediate <= CHECK_FULL_MAX_HI ? INT64_MAX : CHECK_TOKENS_LARGE;
}

/* Whether every run wrote the same bits (with more than one), and the first run's hash (the same
 * inputs, --seed, on another build give the same hash when it computes the same bits). Returns 1
 * when the runs differ. */
static int print_hashes(const run_state *st) {
    int same = 1;
    for (int i = 1; i < st->opt->repeat; ++i) same &= st->output_hashes[i] == st->output_hashes[0];
    if (st->opt->repeat > 1)
        printf("outputs bitwise identical over %d runs: %s\n", st->opt->repeat, same ? "yes" : "NO");
    printf("outputs hash (FNV-1a, first run): %016llx\n", (unsigned long long)st->output_hashes[0]);
    return !same;
}

/* --check: the reference on the same host inputs (the first N tokens of every rank), then the
 * worst error of each tensor over the ranks. A token's outputs (y, dx, d_router_w) depend only on
 * that token, so a prefix is checked exactly; the weight gradients sum over every token and are
 * compared only when the reference saw all of them. Returns 0 PASS, 1 FAIL, -1 error. */
static int check_against_reference(run_state *st) {
    const mok_shape *s = &st->shape;
    const int P = st->nranks;
    const int backward = st->backward_ran;
    int result = -1;

    int64_t *num_tokens = calloc((size_t)P, sizeof *num_tokens);
    const void **x = calloc((size_t)P, sizeof *x), **dy = calloc((size_t)P, sizeof *dy);
    const int32_t **ids = calloc((size_t)P, sizeof *ids);
    const float **router_w = calloc((size_t)P, sizeof *router_w);
    const void **w_gate = calloc((size_t)P, sizeof *w_gate), **w_up = calloc((size_t)P, sizeof *w_up),
               **w_down = calloc((size_t)P, sizeof *w_down);
    void **ref[TOOLS_NUM_TENSORS] = {0};
    void *got = NULL;
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) ref[t] = calloc((size_t)P, sizeof *ref[t]);
    int ok = num_tokens && x && dy && ids && router_w && w_gate && w_up && w_down;
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) ok = ok && ref[t];

    const int64_t sample = check_tokens_of(st);
    int sampled = 0;
    for (int r = 0; ok && r < P; ++r) {
        const rank_tensors *rt = &st->ranks[r];
        num_tokens[r] = rt->tokens < sample ? rt->tokens : sample;
        sampled |= num_tokens[r] < rt->tokens;
    }
    /* The tensors compared: y; with a backward, dx and d_router_w; without sampling, the
     * gradients too. The reference backward still needs buffers for every gradient. */
    int compared[TOOLS_NUM_TENSORS] = {0};
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t)
        compared[t] = tensor_present(st, (tools_tensor)t) && (t == TOOLS_Y || backward) &&
                      (per_token((tools_tensor)t) || !sampled);
    size_t most = 0; /* the largest tensor read back */
    for (int r = 0; ok && r < P; ++r) {
        const rank_tensors *rt = &st->ranks[r];
        x[r] = rt->x.host;
        dy[r] = rt->dy.host;
        ids[r] = rt->topk_ids.host;
        router_w[r] = rt->router_w.host;
        w_gate[r] = rt->w_gate.host;
        w_up[r] = rt->w_up.host;
        w_down[r] = rt->w_down.host;
        for (int t = 0; ok && t < TOOLS_NUM_TENSORS; ++t) {
            if (!tensor_present(st, (tools_tensor)t) || (t != TOOLS_Y && !backward)) continue;
            int64_t count = tensor_count(st, num_tokens[r], (tools_tensor)t);
            size_t element = (t == TOOLS_Y || t == TOOLS_DX) ? 2 : 4; /* the reference keeps fp32 grads */
            ref[t][r] = tools_host_alloc(bytes_of(count, element));
            ok = ref[t][r] != NULL;
            size_t bytes = bytes_of(count, output_element((tools_tensor)t));
            if (compared[t] && bytes > most) most = bytes;
        }
    }
    if (ok) ok = (got = tools_host_alloc(most)) != NULL;
    if (!ok) {
        fprintf(stderr, "mok run: out of host memory for the reference\n");
        goto done;
    }

    mok_ref_layer layer = {.shape = s, .nranks = P, .swiglu_limit = st->opt->config.swiglu_limit,
                           .num_tokens = num_tokens, .x = x, .topk_ids = ids, .router_w = router_w,
                           .w_gate = w_gate, .w_up = w_up, .w_down = w_down,
                           .s_gate = st->shared[0], .s_up = st->shared[1], .s_down = st->shared[2]};
    double start = now_seconds();
    mok_status status = mok_ref_forward(&layer, ref[TOOLS_Y]);
    if (status != MOK_OK) {
        library_failed("mok_ref_forward", status);
        goto done;
    }
    int shared = has_shared(st);
    if (backward) {
        status = mok_ref_backward(&layer, dy, ref[TOOLS_DX], (float *const *)ref[TOOLS_D_ROUTER_W],
                                  (float *const *)ref[TOOLS_DW_GATE], (float *const *)ref[TOOLS_DW_UP],
                                  (float *const *)ref[TOOLS_DW_DOWN],
                                  shared ? (float *const *)ref[TOOLS_DS_GATE] : NULL,
                                  shared ? (float *const *)ref[TOOLS_DS_UP] : NULL,
                                  shared ? (float *const *)ref[TOOLS_DS_DOWN] : NULL);
        if (status != MOK_OK) {
            library_failed("mok_ref_backward", status);
            goto done;
        }
    }
    double reference_seconds = now_seconds() - start;

    int failed = 0;
    char which[96];
    if (sampled) snprintf(which, sizeof which, "the first %lld tokens of each rank", (long long)sample);
    else snprintf(which, sizeof which, "all tokens");
    printf("\ncheck against the reference (fp64, %s, %.2f s); error = max|got-ref| / (atol + rtol*max|ref|)\n",
           which, reference_seconds);
    printf("%-11s %13s %12s %7s %9s %5s\n", "tensor", "max abs err", "max |ref|", "rtol", "error", "rank");
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
        if (!tensor_present(st, (tools_tensor)t)) continue;
        const char *name = tools_tolerance_of((tools_tensor)t)->name;
        if (!compared[t]) {
            printf("%-11s n/a (%s)\n", name, t != TOOLS_Y && !backward ? "no backward" : "sampled tokens");
            continue;
        }
        tools_error worst = {0.0, 0.0, -1.0, -1};
        int worst_rank = 0;
        for (int r = 0; r < P; ++r) {
            int64_t count = tensor_count(st, num_tokens[r], (tools_tensor)t);
            if (tools_buffer_read(&st->ranks[r].outputs[t], 0, got, bytes_of(count, output_element((tools_tensor)t))) != 0)
                goto done;
            tools_dtype got_type = t == TOOLS_D_ROUTER_W ? TOOLS_F32 : TOOLS_BF16;
            tools_dtype ref_type = (t == TOOLS_Y || t == TOOLS_DX) ? TOOLS_BF16 : TOOLS_F32;
            tools_error e = tools_compare((tools_tensor)t, got, got_type, ref[t][r], ref_type, count);
            if (!(e.normalized <= worst.normalized)) { /* NaN counts as worse */
                worst = e;
                worst_rank = r;
            }
        }
        int pass = worst.normalized <= 1.0;
        failed |= !pass;
        printf("%-11s %13.4e %12.4e %7.0e %9.4f %5d %s\n", name, worst.max_abs_error, worst.max_abs_ref,
               tools_tolerance_of((tools_tensor)t)->rtol, worst.normalized, worst_rank, pass ? "ok" : "FAIL");
    }
    failed |= print_hashes(st);
    printf("%s\n", failed ? "FAIL" : "PASS");
    result = failed ? 1 : 0;

done:
    for (int t = 0; t < TOOLS_NUM_TENSORS; ++t) {
        for (int r = 0; ref[t] && r < P; ++r) free(ref[t][r]);
        free(ref[t]);
    }
    free(got);
    free(num_tokens);
    free(x);
    free(dy);
    free(ids);
    free(router_w);
    free(w_gate);
    free(w_up);
    free(w_down);
    return result;
}

static void destroy_state(run_state *st) {
    /* Statuses are ignored here: the run's outcome is already decided and printed. The buffers
     * go first: their memory belongs to the group's ranks. */
    for (int r = 0; st->ranks && r < st->nranks; ++r) {
        rank_tensors *rt = &st->ranks[r];
        tools_buffer *all[] = {&rt->x, &rt->dy, &rt->topk_ids, &rt->router_w, &rt->w_gate, &rt->w_up,
                               &rt->w_down, &rt->s_gate, &rt->s_up, &rt->s_down, &rt->schedule, &rt->context};
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
    free(st->seconds);
    free(st->output_hashes);
}

static int run_layer(const run_options *opt) {
    run_state st;
    memset(&st, 0, sizeof st);
    st.opt = opt;
    st.nranks = opt->nranks;
    st.backend = MOK_BACKEND_CPU;
    if (opt->no_backward) {
        st.skip_backward = 1;
        snprintf(st.backward_note, sizeof st.backward_note, "skipped: --no-backward");
    }
    int64_t tokens = opt->tokens >= 0 ? opt->tokens : tools_default_tokens(opt->scale);
    st.shape = tools_preset_shape(opt->preset, opt->scale, opt->nranks, tokens > 0 ? tokens : 1);
    st.num_local_experts = opt->nranks > 0 ? st.shape.num_experts / opt->nranks : 0;

    int result = 2;
    if (create_group(&st) != 0) goto done;
    double start = now_seconds();
    if (make_tensors(&st) != 0) goto done;
    st.input_seconds = now_seconds() - start;
    /* cuda: the first run pays for module loading, first-touch of memory and the like. */
    if (st.backend == MOK_BACKEND_CUDA && run_once(&st, NULL, NULL) != 0) goto done;
    for (int i = 0; i < opt->repeat; ++i)
        if (run_once(&st, st.seconds[i], &st.output_hashes[i]) != 0) goto done;
    if (opt->trace_path) {
        mok_status status = mok_trace_write(st.workspace, opt->trace_path);
        if (status != MOK_OK) {
            library_failed("mok_trace_write", status);
            goto done;
        }
    }
    if (summarize_timings(&st) != 0) goto done;
    if (print_header(&st) != 0) goto done;
    print_timings(&st);
    if (opt->trace_path) printf("trace of the last run written to %s\n", opt->trace_path);
    if (opt->check) {
        fflush(stdout);
        int checked = check_against_reference(&st);
        if (checked < 0) goto done;
        result = checked;
    } else if (opt->hash) {
        result = print_hashes(&st);
        printf("%s\n", result ? "FAIL" : "PASS");
    } else {
        result = 0;
    }
done:
    fflush(stdout);
    destroy_state(&st);
    return result;
}

static int list_presets(void) {
    printf("%-18s %6s %6s %5s %3s %9s  %s\n", "name", "H", "I", "E", "k", "shared I", "note");
    for (int i = 0; i < tools_preset_count(); ++i) {
        const tools_preset *p = tools_preset_at(i);
        printf("%-18s %6lld %6lld %5lld %3lld %9lld  %s\n", p->name, (long long)p->hidden,
               (long long)p->intermediate, (long long)p->num_experts, (long long)p->topk,
               (long long)p->shared_intermediate, p->note);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *command = argv[1];
    if (strcmp(command, "--help") == 0 || strcmp(command, "-h") == 0 || strcmp(command, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(command, "presets") == 0) {
        if (argc > 2) {
            fprintf(stderr, "mok presets: takes no arguments\n");
            return 2;
        }
        return list_presets();
    }
    if (strcmp(command, "run") == 0) {
        run_options opt;
        int parsed = parse_run_options(argc - 2, argv + 2, &opt);
        if (parsed != 0) return parsed > 0 ? 0 : 2;
        return run_layer(&opt);
    }
    fprintf(stderr, "mok: unknown command '%s' (commands: run, presets; see mok --help)\n", command);
    return 2;
}
