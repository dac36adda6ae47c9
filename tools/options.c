/* options.c — `mok run`'s command line: the usage text, one parser per flag (found through one
 * table), and the library's messages put in the flags' words. */
#include "options.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void tools_usage(FILE *out) {
    fprintf(out,
            "usage: mok presets\n"
            "       mok run --preset NAME [options]\n"
            "       mok --version\n"
            "\n"
            "mok run builds the preset's MoE layer on P ranks driven by this process, with random\n"
            "weights and softmax top-k routing of random logits, runs schedule, forward and backward\n"
            "--repeat times and prints the median time of each phase, its effective TFLOP/s, the\n"
            "memory per rank and, for P > 1, the forward's effective link bandwidth per rank. It\n"
            "prints the layer first and a line per run as the runs finish, and refuses a run that\n"
            "would not fit in the host memory available (it warns when it comes close).\n"
            "\n"
            "  --preset NAME       a layer from `mok presets` (case-insensitive)\n"
            "  --scale S           divide H, I, I_s and E by S, from 1 (full size, the default) to\n"
            "                      %g; dimensions round to multiples of %d (%d under FP8, the header\n"
            "                      says when that differs), E to a multiple of P, and k is cut to E\n"
            "                      when E falls below it (the header says so)\n"
            "  --precision P       bf16 (the default) or fp8: block-scaled E4M3 GEMM operands\n"
            "                      (include/mok.h's FP8 section, which says the backends that run\n"
            "                      it); the FP8 weights are quantized once, before the runs, and\n"
            "                      --check compares with the FP8 reference; then the same layer\n"
            "                      and inputs run in bf16 and both precisions' phases are shown\n"
            "                      side by side\n"
            "  --fp8-alone         with --precision fp8: no bf16 runs beside\n"
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
            "                      its x rows into the peers' rings); any case\n"
            "  --fwd-combine D     config fwd_combine: push (default) or pull (each rank gathers\n"
            "                      its expert outputs from the peers' rings)\n"
            "  --bwd-combine D     config bwd_combine: pull (default) or push (each rank writes\n"
            "                      its dy and x rows into the peers' rings)\n"
            "  --bwd-dispatch D    config bwd_dispatch: push (default) or pull (each rank\n"
            "                      gathers its dx parts and router-weight gradients)\n"
            "  --trace PATH        write the last run's forward and backward tasks as Chrome trace\n"
            "                      JSON (Perfetto, chrome://tracing): a process per rank and pass,\n"
            "                      a thread per worker; `python3 bench/timeline.py PATH --report`\n"
            "                      summarizes it (idle workers, each task kind's times)\n"
            "\n"
            "Exit status: 0 success, 1 --check failed, 2 bad arguments or a library error.\n",
            TOOLS_SCALE_MAX, MOK_DIM_TILE, MOK_FP8_BLOCK, CHECK_TOKENS_LARGE);
}

/* ---- values ---------------------------------------------------------------------------------- */

static int bad_value(const char *flag, const char *text, const char *expected) {
    fprintf(stderr, "mok run: %s expects %s, not '%s'\n", flag, expected, text);
    return -1;
}

static int starts_blank(const char *text) { return text[0] == '\0' || text[0] == ' ' || text[0] == '\t'; }

static int parse_int64(const char *flag, const char *text, int64_t min, int64_t max, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (starts_blank(text) || end == text || *end != '\0') return bad_value(flag, text, "an integer");
    if (errno == ERANGE) return bad_value(flag, text, "an integer that fits in 64 bits");
    if (value < min || value > max) {
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
    char *end = NULL;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (starts_blank(text) || end == text || *end != '\0') return bad_value(flag, text, "an integer");
    if (errno == ERANGE || value < INT_MIN || value > INT_MAX)
        return bad_value(flag, text, "an integer that fits in an int");
    *out = (int)value;
    return 0;
}

static int parse_double(const char *flag, const char *text, double *out) {
    char *end = NULL;
    errno = 0;
    double value = strtod(text, &end);
    if (starts_blank(text) || end == text || *end != '\0' || !isfinite(value) ||
        (errno == ERANGE && fabs(value) > 1.0))
        return bad_value(flag, text, "a finite number");
    *out = errno == ERANGE ? 0.0 : value; /* an underflow is as good as 0 */
    return 0;
}

static int lower(int c) { return c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c; }

static int equal_ignoring_case(const char *a, const char *b) {
    for (; *a && *b; ++a, ++b)
        if (lower((unsigned char)*a) != lower((unsigned char)*b)) return 0;
    return *a == *b;
}

/* ---- one parser per flag that takes a value ---------------------------------------------------- */

typedef int (*value_parser)(const char *flag, const char *value, run_options *opt);

static int parse_preset(const char *flag, const char *value, run_options *opt) {
    opt->preset = tools_preset_find(value);
    if (opt->preset) return 0;
    fprintf(stderr, "mok run: unknown preset '%s'; `mok presets` lists them\n", value);
    return -1;
}

static int parse_scale(const char *flag, const char *value, run_options *opt) {
    if (parse_double(flag, value, &opt->scale) != 0) return -1;
    if (opt->scale >= 1.0 && opt->scale <= TOOLS_SCALE_MAX) return 0;
    if (!(opt->scale > 0.0)) {
        fprintf(stderr, "mok run: --scale must be greater than 0, not '%s'\n", value);
        return -1;
    }
    fprintf(stderr,
            "mok run: --scale must be between 1 (the preset at full size) and %g (every dimension one tile), "
            "not '%s'\n",
            TOOLS_SCALE_MAX, value);
    return -1;
}

static int parse_ranks(const char *flag, const char *value, run_options *opt) {
    return parse_int(flag, value, &opt->nranks); /* the library checks the range */
}

static int parse_tokens(const char *flag, const char *value, run_options *opt) {
    return parse_int64(flag, value, 0, INT64_MAX, &opt->tokens); /* the library checks the upper bound */
}

static int parse_skew(const char *flag, const char *value, run_options *opt) {
    return parse_double(flag, value, &opt->skew);
}

static int parse_seed(const char *flag, const char *value, run_options *opt) {
    char *end = NULL;
    errno = 0;
    if (value[0] < '0' || value[0] > '9') return bad_value(flag, value, "a non-negative integer");
    unsigned long long seed = strtoull(value, &end, 10);
    if (*end != '\0' || errno == ERANGE) return bad_value(flag, value, "a non-negative 64-bit integer");
    opt->seed = seed;
    return 0;
}

static int parse_backend(const char *flag, const char *value, run_options *opt) {
    if (equal_ignoring_case(value, "cpu")) opt->backend = MOK_BACKEND_CPU;
    else if (equal_ignoring_case(value, "cuda")) opt->backend = MOK_BACKEND_CUDA;
    else if (equal_ignoring_case(value, "auto")) opt->backend = MOK_BACKEND_AUTO;
    else return bad_value(flag, value, "cpu, cuda or auto");
    return 0;
}

static int parse_precision(const char *flag, const char *value, run_options *opt) {
    if (equal_ignoring_case(value, "bf16")) opt->precision = MOK_PRECISION_BF16;
    else if (equal_ignoring_case(value, "fp8")) opt->precision = MOK_PRECISION_FP8;
    else return bad_value(flag, value, "bf16 or fp8");
    return 0;
}

static int parse_check_tokens(const char *flag, const char *value, run_options *opt) {
    return parse_int64(flag, value, 1, INT64_MAX, &opt->check_tokens);
}

static int parse_repeat(const char *flag, const char *value, run_options *opt) {
    int64_t repeat;
    if (parse_int64(flag, value, 1, 1000000, &repeat) != 0) return -1;
    opt->repeat = (int)repeat;
    return 0;
}

static int parse_minibatch(const char *flag, const char *value, run_options *opt) {
    return parse_int(flag, value, &opt->config.minibatch_rows);
}

static int parse_ring(const char *flag, const char *value, run_options *opt) {
    return parse_int(flag, value, &opt->config.ring_rows);
}

static int parse_context_rows(const char *flag, const char *value, run_options *opt) {
    return parse_int64(flag, value, INT64_MIN, INT64_MAX, &opt->config.context_rows);
}

static int parse_threads(const char *flag, const char *value, run_options *opt) {
    return parse_int(flag, value, &opt->config.cpu_threads);
}

static int parse_comm_threads(const char *flag, const char *value, run_options *opt) {
    return parse_int(flag, value, &opt->config.cpu_comm_threads);
}

static int parse_comm_sms(const char *flag, const char *value, run_options *opt) {
    if (parse_int(flag, value, &opt->config.fwd_comm_sms) != 0) return -1; /* the library checks the range */
    opt->config.bwd_comm_sms = opt->config.fwd_comm_sms;
    return 0;
}

static int parse_limit(const char *flag, const char *value, run_options *opt) {
    double limit;
    if (parse_double(flag, value, &limit) != 0) return -1;
    if (fabs(limit) > 3.0e38) return bad_value(flag, value, "a number in float range");
    opt->config.swiglu_limit = (float)limit;
    return 0;
}

static int parse_trace(const char *flag, const char *value, run_options *opt) {
    opt->trace_path = value;
    opt->config.trace = 1;
    return 0;
}

static int parse_direction(const char *flag, const char *value, int *field) {
    if (equal_ignoring_case(value, "push")) *field = MOK_PUSH;
    else if (equal_ignoring_case(value, "pull")) *field = MOK_PULL;
    else return bad_value(flag, value, "push or pull");
    return 0;
}

static int parse_fwd_dispatch(const char *flag, const char *value, run_options *opt) {
    return parse_direction(flag, value, &opt->config.fwd_dispatch);
}

static int parse_fwd_combine(const char *flag, const char *value, run_options *opt) {
    return parse_direction(flag, value, &opt->config.fwd_combine);
}

static int parse_bwd_combine(const char *flag, const char *value, run_options *opt) {
    return parse_direction(flag, value, &opt->config.bwd_combine);
}

static int parse_bwd_dispatch(const char *flag, const char *value, run_options *opt) {
    return parse_direction(flag, value, &opt->config.bwd_dispatch);
}

static const struct {
    const char *flag;
    value_parser parse;
} valued_flags[] = {
    {"--preset", parse_preset},           {"--scale", parse_scale},
    {"--ranks", parse_ranks},             {"--tokens", parse_tokens},
    {"--skew", parse_skew},               {"--seed", parse_seed},
    {"--backend", parse_backend},         {"--check-tokens", parse_check_tokens},
    {"--repeat", parse_repeat},           {"--minibatch", parse_minibatch},
    {"--ring", parse_ring},               {"--context-rows", parse_context_rows},
    {"--threads", parse_threads},         {"--comm-threads", parse_comm_threads},
    {"--comm-sms", parse_comm_sms},       {"--limit", parse_limit},
    {"--trace", parse_trace},             {"--fwd-dispatch", parse_fwd_dispatch},
    {"--fwd-combine", parse_fwd_combine}, {"--bwd-combine", parse_bwd_combine},
    {"--bwd-dispatch", parse_bwd_dispatch}, {"--precision", parse_precision},
};

static value_parser parser_of(const char *flag) {
    for (size_t i = 0; i < sizeof valued_flags / sizeof valued_flags[0]; ++i)
        if (strcmp(flag, valued_flags[i].flag) == 0) return valued_flags[i].parse;
    return NULL;
}

/* ---- the command line ---------------------------------------------------------------------------- */

static void set_defaults(run_options *opt) {
    memset(opt, 0, sizeof *opt);
    opt->scale = 1.0;
    opt->nranks = 1;
    opt->tokens = -1;
    opt->seed = 1;
    opt->backend = MOK_BACKEND_AUTO;
    opt->precision = MOK_PRECISION_BF16;
    opt->check_tokens = -1;
    opt->repeat = 3;
    opt->config = mok_config_default();
}

/* A flag without a value: 1 when arg is one (and it is set), else 0. */
static int set_switch(const char *arg, run_options *opt) {
    int *field = strcmp(arg, "--check") == 0         ? &opt->check
                 : strcmp(arg, "--hash") == 0        ? &opt->hash
                 : strcmp(arg, "--uneven") == 0      ? &opt->uneven
                 : strcmp(arg, "--no-backward") == 0 ? &opt->no_backward
                 : strcmp(arg, "--fp8-alone") == 0   ? &opt->fp8_alone
                                                     : NULL;
    if (field) *field = 1;
    return field != NULL;
}

/* A flag with a value, as `--flag VALUE` or `--flag=VALUE`, at argv[*i]; moves *i past the value.
 * Returns 0, or -1 with a message. */
static int parse_valued(int argc, char **argv, int *i, run_options *opt) {
    const char *arg = argv[*i];
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
        value = *i + 1 < argc ? argv[*i + 1] : NULL;
    }
    value_parser parse = parser_of(flag);
    if (!parse) {
        fprintf(stderr, "mok run: unknown option '%s' (see mok --help)\n", arg);
        return -1;
    }
    if (!value) {
        fprintf(stderr, "mok run: %s needs a value\n", flag);
        return -1;
    }
    if (!equals) ++*i;
    return parse(flag, value, opt);
}

int tools_parse_run_options(int argc, char **argv, run_options *opt) {
    set_defaults(opt);
    for (int i = 0; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            tools_usage(stdout);
            return 1;
        }
        if (set_switch(arg, opt)) continue;
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "mok run: unexpected argument '%s' (see mok --help)\n", arg);
            return -1;
        }
        if (parse_valued(argc, argv, &i, opt) != 0) return -1;
    }
    if (!opt->preset) {
        fprintf(stderr, "mok run: --preset NAME is required; `mok presets` lists them\n");
        return -1;
    }
    return 0;
}

/* ---- the library's messages in the flags' words -------------------------------------------------- */

/* The library's names of what a flag sets. A message that starts with one of them is about that
 * flag; the names inside a message are replaced too (a ring that is not a multiple of
 * minibatch_rows). */
static const struct {
    const char *field;
    const char *flag;
} field_flags[] = {
    {"nranks", "--ranks"},
    {"shape.max_tokens", "--tokens"},
    {"shape.precision", "--precision"},
    {"config.minibatch_rows", "--minibatch"},
    {"minibatch_rows", "--minibatch"},
    {"config.ring_rows", "--ring"},
    {"config.context_rows", "--context-rows"},
    {"config.cpu_threads", "--threads"},
    {"cpu_threads", "--threads"},
    {"config.cpu_comm_threads", "--comm-threads"},
    {"config.fwd_comm_sms", "--comm-sms"},
    {"config.bwd_comm_sms", "--comm-sms"},
    {"config.swiglu_limit", "--limit"},
    {"config.fwd_dispatch", "--fwd-dispatch"},
    {"config.fwd_combine", "--fwd-combine"},
    {"config.bwd_combine", "--bwd-combine"},
    {"config.bwd_dispatch", "--bwd-dispatch"},
    {"config.trace", "--trace"},
};

static const char *flag_of(const char *word, size_t length) {
    for (size_t i = 0; i < sizeof field_flags / sizeof field_flags[0]; ++i)
        if (strlen(field_flags[i].field) == length && strncmp(word, field_flags[i].field, length) == 0)
            return field_flags[i].flag;
    return NULL;
}

static int word_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.';
}

/* message with every field name of the table replaced by its flag, into out. */
static void replace_fields(const char *message, char *out, size_t size) {
    size_t n = 0;
    for (const char *p = message; *p && n + 1 < size;) {
        if (!word_char(*p)) {
            out[n++] = *p++;
            continue;
        }
        const char *start = p;
        while (word_char(*p)) ++p;
        size_t length = (size_t)(p - start);
        while (length > 0 && start[length - 1] == '.') --length; /* a sentence's full stop */
        const char *flag = flag_of(start, length);
        const char *text = flag ? flag : start;
        size_t text_length = flag ? strlen(flag) : (size_t)(p - start);
        if (flag) p = start + length;
        if (text_length > size - 1 - n) text_length = size - 1 - n;
        memcpy(out + n, text, text_length);
        n += text_length;
    }
    out[n] = '\0';
}

int tools_library_failed(const char *function, mok_status status) {
    const char *message = mok_last_error();
    const char *colon = strchr(message, ':');
    const char *flag = colon ? flag_of(message, (size_t)(colon - message)) : NULL;
    if (!flag) {
        fprintf(stderr, "mok: %s: %s: %s\n", function, mok_status_string(status), message);
        return -1;
    }
    char rest[1024];
    replace_fields(colon + 1, rest, sizeof rest);
    fprintf(stderr, "mok run: %s:%s\n", flag, rest);
    return -1;
}
