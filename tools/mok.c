/* mok.c — the `mok` command. `mok presets` lists the layers it knows; `mok --version` says the
 * version and the backends of this build; `mok run` builds one of the layers (scaled down on
 * request) on P ranks that this one process drives, with random weights and routing, times the
 * schedule, forward and backward passes, and with --check compares every output and gradient
 * with the library's fp64 reference.
 *
 * A run prints what it runs before it runs it, refuses a run that cannot fit in the host memory
 * available (memory.h), and shows every pass as it completes (progress.h).
 *
 * Backends: cpu (ranks are threads, memory is host memory) and cuda (rank r on GPU r, memory is
 * device memory; tools/buffers.c moves it).
 *
 * Exit status: 0 done (and PASS), 1 a --check FAIL, 2 bad usage or a failed library call. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory.h"
#include "mok.h"
#include "options.h"
#include "presets.h"
#include "run.h"

/* A run whose estimate passes this share of the available host memory gets a warning. */
#define MEMORY_WARN_SHARE 0.8

/* --trace PATH is checked before the runs, so that a bad path does not wait for them: its folder
 * must exist and be writable, and PATH must not be a folder. */
static int check_trace_path(const char *path) {
    char folder[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(folder, sizeof folder, ".");
    else if (slash == path) snprintf(folder, sizeof folder, "/");
    else snprintf(folder, sizeof folder, "%.*s", (int)(slash - path), path);
    struct stat info;
    if (stat(folder, &info) != 0 || !S_ISDIR(info.st_mode)) {
        fprintf(stderr, "mok run: --trace %s: the folder '%s' does not exist\n", path, folder);
        return -1;
    }
    if (stat(path, &info) == 0 && S_ISDIR(info.st_mode)) {
        fprintf(stderr, "mok run: --trace %s: is a folder; give a file name\n", path);
        return -1;
    }
    if (access(stat(path, &info) == 0 ? path : folder, W_OK) != 0) {
        fprintf(stderr, "mok run: --trace %s: cannot write there (%s)\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---- host memory ------------------------------------------------------------------------------- */

/* The host memory a run of `shape` with `tokens` per rank needs; the workspace's sizes are the
 * measured ones times `workspace_share` (to estimate a smaller layer's from this one's). */
static tools_host_need need_of(const run_state *st, const mok_shape *shape, int64_t tokens, double workspace_share) {
    const int64_t check_tokens = verify_tokens(st->opt, shape);
    tools_run_size run = {.shape = shape,
                          .nranks = st->nranks,
                          .tokens = tokens,
                          .library_on_host = st->backend == MOK_BACKEND_CPU,
                          .backward = st->backward,
                          .check = st->opt->check,
                          .check_tokens = check_tokens < tokens ? check_tokens : tokens,
                          .workspace_bytes = workspace_share * (double)st->sizes.workspace_bytes,
                          .schedule_bytes = workspace_share * (double)st->sizes.schedule_bytes,
                          .context_bytes = workspace_share * (double)st->sizes.context_bytes,
                          .fp8_weight_bytes = workspace_share * (double)st->fp8_layout.bytes};
    return tools_host_need_of(&run);
}

/* The smallest --scale, doubling from this run's, whose estimate fits within the warning share of
 * `available`; 0 when none does. A workspace's size grows at most linearly with H and I (its rows
 * are H or I wide; their number does not grow with --scale), so this one's, times the larger of
 * the two ratios, bounds the smaller layer's. */
static double scale_that_fits(const run_state *st, double available) {
    const run_options *opt = st->opt;
    for (double scale = 2.0 * opt->scale; scale <= TOOLS_SCALE_MAX; scale *= 2.0) {
        const int64_t tokens = opt->tokens >= 0 ? opt->tokens : tools_default_tokens(scale);
        const mok_shape shape = tools_preset_shape(opt->preset, scale, st->nranks, tokens > 0 ? tokens : 1,
                                                  opt->precision);
        double share = (double)shape.hidden / (double)st->shape.hidden;
        const double share_i = (double)shape.intermediate / (double)st->shape.intermediate;
        if (share_i > share) share = share_i;
        if (need_of(st, &shape, tokens, share).total <= MEMORY_WARN_SHARE * available) return scale;
    }
    return 0.0;
}

/* Refuses (-1) a run that needs more host memory than `available` and warns about one that comes
 * close; available < 0: not known, nothing is checked. It runs twice: before the workspace exists
 * (st->sizes still zero: the tensors and the reference alone), and once its sizes are known, when
 * it also prints the estimate (`report`). */
static int check_host_memory(const run_state *st, double available, int report) {
    const tools_host_need need = need_of(st, &st->shape, st->tokens, 1.0);
    char total[32], workspace[32], tensors[32], reference[32], have[32];
    report_format_bytes(total, sizeof total, need.total);
    report_format_bytes(workspace, sizeof workspace, need.workspace);
    report_format_bytes(tensors, sizeof tensors, need.tensors);
    report_format_bytes(reference, sizeof reference, need.reference);
    report_format_bytes(have, sizeof have, available);
    if (report)
        printf("         host memory: about %s at the peak (workspaces %s, tensors %s, reference %s), %s available\n",
               total, workspace, tensors, reference, available >= 0.0 ? have : "not known");
    fflush(stdout);
    if (available < 0.0 || need.total <= MEMORY_WARN_SHARE * available) return 0;
    const double scale = scale_that_fits(st, available);
    char hint[160] = "";
    if (scale > 0.0) snprintf(hint, sizeof hint, "; --scale %g fits", scale);
    else if (st->opt->tokens >= 0) snprintf(hint, sizeof hint, "; no --scale fits with --tokens %lld", (long long)st->tokens);
    if (need.total > available) {
        fprintf(stderr, "mok run: this run needs about %s of host memory but %s %s available%s%s\n", total, have,
                available == 1.0 ? "is" : "are", hint, st->opt->check ? " (or leave out --check)" : "");
        return -1;
    }
    if (report)
        fprintf(stderr, "mok run: warning: this run needs about %s of the %s of host memory available%s\n", total,
                have, hint);
    return 0;
}

/* ---- mok run ------------------------------------------------------------------------------------- */

/* The random inputs and, under FP8, the FP8 weights quantized from them once (as a training step
 * would after each optimizer step), all before the timed runs. */
static int make_inputs(run_state *st) {
    tools_progress_line(st->progress, "inputs");
    tools_progress_pass(st->progress, "random");
    double start = tools_now_seconds();
    int rc = run_make_tensors(st);
    if (rc == 0) {
        tools_progress_done(st->progress, tools_now_seconds() - start);
        if (st->shape.precision == MOK_PRECISION_FP8) {
            tools_progress_pass(st->progress, "quantize");
            start = tools_now_seconds();
            rc = run_quantize_weights(st);
            st->quantize_seconds = tools_now_seconds() - start;
            if (rc == 0) tools_progress_done(st->progress, st->quantize_seconds);
        }
    }
    tools_progress_end_line(st->progress);
    return rc;
}

static int write_trace(const run_state *st) {
    mok_status status = mok_trace_write(st->workspace, st->opt->trace_path);
    if (status != MOK_OK) return tools_library_failed("mok_trace_write", status);
    return 0;
}

/* The report after the runs and the verdict: 0 done (PASS), 1 FAIL, -1 an error. */
static int report(run_state *st) {
    const run_options *opt = st->opt;
    if (run_summarize(st) != 0 || report_ranks(st) != 0) return -1;
    report_timings(st);
    if (opt->trace_path)
        printf("trace of the last run's forward%s written to %s\n", st->backward ? " and backward" : "",
               opt->trace_path);
    if (opt->check) {
        fflush(stdout);
        return verify_against_reference(st);
    }
    if (opt->hash) {
        const int differ = report_hashes(st);
        printf("%s\n", differ ? "FAIL" : "PASS");
        return differ;
    }
    return 0;
}

/* FP8: the same layer on the same inputs in bf16, timed as the FP8 runs were (the same phases),
 * and both precisions' phases side by side. After the FP8 verdict: the bf16 runs overwrite the
 * outputs. */
static int run_bf16_beside(run_state *st, double available) {
    double fp8_median[NUM_PHASES];
    memcpy(fp8_median, st->median, sizeof fp8_median);
    printf("\nbf16 beside FP8: the same layer and inputs in bf16, timed the same way\n");
    fflush(stdout);
    if (run_switch_precision(st, MOK_PRECISION_BF16) != 0 || check_host_memory(st, available, 0) != 0 ||
        run_passes(st) != 0 || run_summarize(st) != 0)
        return -1;
    report_beside(st, fp8_median);
    return 0;
}

static int run_layer(const run_options *opt) {
    run_state st;
    memset(&st, 0, sizeof st);
    st.opt = opt;
    st.nranks = opt->nranks;
    st.backend = MOK_BACKEND_CPU;
    st.backward = !opt->no_backward;
    st.tokens = opt->tokens >= 0 ? opt->tokens : tools_default_tokens(opt->scale);
    st.shape = tools_preset_shape(opt->preset, opt->scale, opt->nranks, st.tokens > 0 ? st.tokens : 1,
                                  opt->precision);
    st.num_local_experts = opt->nranks > 0 ? st.shape.num_experts / opt->nranks : 0;

    int result = 2;
    const double available = tools_host_available(); /* before the workspace takes any of it */
    if (opt->trace_path && check_trace_path(opt->trace_path) != 0) goto done;
    if (run_create_group(&st) != 0) goto done;
    report_layer(&st);
    if (check_host_memory(&st, available, 0) != 0 || run_create_workspace(&st) != 0) goto done;
    report_memory(&st);
    if (check_host_memory(&st, available, 1) != 0) goto done;
    st.progress = tools_progress_start(stdout);
    if (make_inputs(&st) != 0 || run_passes(&st) != 0) goto done;
    if (opt->trace_path && write_trace(&st) != 0) goto done;
    result = report(&st);
    if (result < 0) result = 2;
    if (result != 2 && st.shape.precision == MOK_PRECISION_FP8 && !opt->fp8_alone &&
        run_bf16_beside(&st, available) != 0)
        result = 2;
done:
    fflush(stdout);
    tools_progress_stop(st.progress);
    run_destroy(&st);
    return result;
}

/* ---- the other commands -------------------------------------------------------------------------- */

static int list_presets(void) {
    printf("%-18s %6s %6s %5s %3s %9s  %s\n", "name", "H", "I", "E", "k", "shared I", "note");
    for (int i = 0; i < tools_preset_count(); ++i) {
        const tools_preset *p = tools_preset_at(i);
        printf("%-18s %6lld %6lld %5lld %3lld %9lld  %s\n", p->name, (long long)p->hidden, (long long)p->intermediate,
               (long long)p->num_experts, (long long)p->topk, (long long)p->shared_intermediate, p->note);
    }
    return 0;
}

/* The library's version (include/mok.h, the one home of it) and what this build can run on. */
static int print_version(void) {
    const int version = mok_version();
    printf("mok %d.%d.%d\n", version / 10000, version / 100 % 100, version % 100);
#ifdef MOK_HAVE_CUDA
    const int gpus = mok_backend_available(MOK_BACKEND_CUDA);
    printf("backends: cpu, cuda (%d GPU%s visible)\n", gpus, gpus == 1 ? "" : "s");
#else
    printf("backends: cpu (this build has no CUDA backend)\n");
#endif
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        tools_usage(stderr);
        return 2;
    }
    const char *command = argv[1];
    if (strcmp(command, "--help") == 0 || strcmp(command, "-h") == 0 || strcmp(command, "help") == 0) {
        tools_usage(stdout);
        return 0;
    }
    if (strcmp(command, "--version") == 0 || strcmp(command, "version") == 0) {
        if (argc > 2) {
            fprintf(stderr, "mok %s: takes no arguments\n", command);
            return 2;
        }
        return print_version();
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
        int parsed = tools_parse_run_options(argc - 2, argv + 2, &opt);
        if (parsed != 0) return parsed > 0 ? 0 : 2;
        return run_layer(&opt);
    }
    fprintf(stderr, "mok: unknown command '%s' (commands: run, presets, --version; see mok --help)\n", command);
    return 2;
}
