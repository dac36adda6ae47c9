/* report.c — what `mok run` prints about a run (run.h): the layer and the config before anything
 * runs, the workspace's memory, then after the runs every rank's schedule and links, the phase
 * times with their TFLOP/s, and the outputs' hashes. */
#include <math.h>
#include <stdio.h>

#include "run.h"

void report_format_bytes(char *out, size_t size, double bytes) {
    if (bytes >= 1024.0 * 1024.0 * 1024.0) snprintf(out, size, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
    else if (bytes >= 1024.0 * 1024.0) snprintf(out, size, "%.2f MiB", bytes / (1024.0 * 1024.0));
    else snprintf(out, size, "%.1f KiB", bytes / 1024.0);
}

static void report_config(const run_state *st) {
    const mok_config *c = &st->opt->config;
    char context[32], limit[32], threads[32];
    if (c->context_rows == 0) snprintf(context, sizeof context, "all");
    else snprintf(context, sizeof context, "%lld", (long long)c->context_rows);
    if (c->swiglu_limit > 0.0f) snprintf(limit, sizeof limit, "%g", (double)c->swiglu_limit);
    else snprintf(limit, sizeof limit, "none");
    if (c->cpu_threads == 0) snprintf(threads, sizeof threads, "all cores");
    else snprintf(threads, sizeof threads, "%d", c->cpu_threads);
    printf("config   minibatch %d rows  ring %d rows  context rows %s  swiglu limit %s\n", c->minibatch_rows,
           c->ring_rows, context, limit);
    if (st->backend == MOK_BACKEND_CPU)
        printf("         cpu threads per rank %s, %d of them moving data\n", threads, c->cpu_comm_threads);
    else
        printf("         rank r on GPU r (GPUs 0..%d); SMs moving data: forward %d, backward %d (0: auto)\n",
               st->nranks - 1, c->fwd_comm_sms, c->bwd_comm_sms);
}

/* FP8 rounds --scale's H, I and I_s to multiples of MOK_FP8_BLOCK instead of MOK_DIM_TILE: the
 * dimensions where that gives another size than a bf16 run of the same --scale. */
static void report_fp8_rounding(const run_state *st) {
    const run_options *opt = st->opt;
    const mok_shape bf16 = tools_preset_shape(opt->preset, opt->scale, st->nranks, st->shape.max_tokens,
                                              MOK_PRECISION_BF16);
    const struct {
        const char *name;
        int64_t fp8, bf16;
    } dims[] = {{"H", st->shape.hidden, bf16.hidden},
                {"I", st->shape.intermediate, bf16.intermediate},
                {"shared I", st->shape.shared_intermediate, bf16.shared_intermediate}};
    char changed[160] = "";
    size_t n = 0;
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; ++d)
        if (dims[d].fp8 != dims[d].bf16 && n < sizeof changed)
            n += (size_t)snprintf(changed + n, sizeof changed - n, "%s%s %lld (bf16: %lld)", n ? ", " : "",
                                  dims[d].name, (long long)dims[d].fp8, (long long)dims[d].bf16);
    if (n)
        printf("         --scale %g rounds to multiples of %d under fp8 (its blocks), not %d: %s\n", opt->scale,
               MOK_FP8_BLOCK, MOK_DIM_TILE, changed);
}

void report_layer(const run_state *st) {
    const run_options *opt = st->opt;
    const mok_shape *s = &st->shape;
    const int fp8 = s->precision == MOK_PRECISION_FP8;
    printf("mok run  preset %s  scale %g  precision %s  backend %s  ranks %d  seed %llu  skew %g\n", opt->preset->name,
           opt->scale, fp8 ? "fp8" : "bf16", mok_backend_name(st->backend), st->nranks, (unsigned long long)opt->seed,
           opt->skew);
    printf("layer    H %lld  I %lld  E %lld (%lld per rank)  k %lld  shared I %lld\n", (long long)s->hidden,
           (long long)s->intermediate, (long long)s->num_experts, (long long)st->num_local_experts,
           (long long)s->topk, (long long)s->shared_intermediate);
    if (fp8) {
        printf("         fp8: E4M3 GEMM operands with power-of-two scales per 1x%d of x, h, dy, dg, du and per\n"
               "         %dx%d block of the weights, fp32 accumulation (include/mok.h, FP8)\n",
               MOK_FP8_BLOCK, MOK_FP8_BLOCK, MOK_FP8_BLOCK);
        report_fp8_rounding(st);
    }
    if (s->topk < opt->preset->topk)
        printf("         k lowered from the preset's %lld to %lld: --scale %g leaves %lld experts, and a token "
               "picks k different ones\n",
               (long long)opt->preset->topk, (long long)s->topk, opt->scale, (long long)s->num_experts);
    else if (s->topk == s->num_experts && opt->preset->topk < opt->preset->num_experts)
        printf("         k = E: --scale %g leaves %lld experts, so every token goes to every expert\n", opt->scale,
               (long long)s->num_experts);
    int64_t all_tokens = 0;
    for (int r = 0; r < st->nranks; ++r) all_tokens += run_rank_tokens(st, r);
    printf("tokens   %lld per rank%s (%lld in all)\n", (long long)st->tokens,
           opt->uneven ? " at most, rank r has T*(r+1)/P" : "", (long long)all_tokens);
    report_config(st);
    fflush(stdout);
}

void report_memory(const run_state *st) {
    char sched[32], ctx[32], ws[32], sym[32];
    report_format_bytes(sched, sizeof sched, (double)st->sizes.schedule_bytes);
    report_format_bytes(ctx, sizeof ctx, (double)st->sizes.context_bytes);
    report_format_bytes(ws, sizeof ws, (double)st->sizes.workspace_bytes);
    report_format_bytes(sym, sizeof sym, (double)st->sizes.symmetric_bytes);
    printf("memory   per rank: workspace %s (%zu bytes), of it symmetric %s (%zu bytes)\n", ws,
           st->sizes.workspace_bytes, sym, st->sizes.symmetric_bytes);
    printf("         schedule %s, context %s; worst case %lld routed rows\n", sched, ctx,
           (long long)st->sizes.max_routed_rows);
    if (st->shape.precision == MOK_PRECISION_FP8) {
        char fp8[32];
        report_format_bytes(fp8, sizeof fp8, (double)st->fp8_layout.bytes);
        printf("         FP8 weights %s (%zu bytes: codes, block scales and the transposed copies)\n", fp8,
               st->fp8_layout.bytes);
    }
    char tuning[256]; /* the backend's knobs as the workspace resolved them (none on cpu) */
    if (mok_workspace_tuning(st->workspace, tuning, sizeof tuning) == MOK_OK && tuning[0]) printf("tuning   %s\n", tuning);
    fflush(stdout);
}

/* Bytes of one remote row in the forward's dispatch: H bf16 values, or under FP8 H E4M3 codes and
 * an fp32 scale per MOK_FP8_BLOCK of them (mok.h: the dispatch moves x^). */
static double dispatch_row_bytes(const run_state *st) {
    const double H = (double)st->shape.hidden;
    return st->shape.precision == MOK_PRECISION_FP8 ? H + H / MOK_FP8_BLOCK * 4.0 : 2.0 * H;
}

/* Bytes that crossed rank q's links in the forward: its remote rows, once in the dispatch and once
 * in the combine (H bf16 values). */
static double link_bytes(const run_state *st, int q) {
    return (double)st->ranks[q].remote_rows * (dispatch_row_bytes(st) + 2.0 * (double)st->shape.hidden);
}

/* Effective GB/s per rank of the forward's links (median forward time); NAN if not known. */
static double link_gbps(const run_state *st, int q) {
    double seconds = st->median[PHASE_FORWARD];
    return seconds > 0.0 ? link_bytes(st, q) / seconds * 1e-9 : NAN;
}

int report_ranks(run_state *st) {
    const int links = st->nranks > 1;
    printf("\n%4s %8s %12s %12s %15s %12s %13s", "rank", "tokens", "routed rows", "padded rows", "busiest expert",
           "minibatches", "macrobatches");
    if (links) printf(" %12s %14s", "remote rows", "fwd link GB/s");
    printf("\n");
    for (int r = 0; r < st->nranks; ++r) {
        mok_schedule_info info;
        mok_status status = mok_schedule_read(st->workspace, st->ranks[r].schedule.device, r, &info);
        if (status != MOK_OK) return tools_library_failed("mok_schedule_read", status);
        printf("%4d %8lld %12lld %12lld %15lld %12lld %13lld", r, (long long)st->ranks[r].tokens,
               (long long)info.routed_rows, (long long)info.padded_rows, (long long)info.max_expert_rows,
               (long long)info.num_minibatches, (long long)info.num_macrobatches);
        if (links) printf(" %12lld %14.4g", (long long)st->ranks[r].remote_rows, link_gbps(st, r));
        printf("\n");
    }
    if (links)
        printf("(remote rows: rows of other ranks' tokens routed to this rank's experts; fwd link GB/s:\n"
               " remote rows x %s, dispatch plus combine, over the median forward time)\n",
               st->shape.precision == MOK_PRECISION_FP8 ? "(H + H/32 + 2H) bytes (FP8 x^ and its scales out, bf16 back)"
                                                       : "H x 2 bytes");
    return 0;
}

static void report_links(const run_state *st) {
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

/* Effective FLOPs per rank, averaged over ranks (DESIGN 6): forward 6·T·k·H·I routed plus
 * 6·T·H·I_s shared, backward twice that. */
void report_timings(const run_state *st) {
    const mok_shape *s = &st->shape;
    const int R = st->opt->repeat;
    double tokens = 0.0;
    for (int r = 0; r < st->nranks; ++r) tokens += (double)st->ranks[r].tokens;
    tokens /= (double)st->nranks;
    double forward_flops = 6.0 * tokens * (double)s->hidden *
                           ((double)s->topk * (double)s->intermediate + (double)s->shared_intermediate);
    double flops[NUM_PHASES] = {0.0, forward_flops, 2.0 * forward_flops, (st->backward ? 3.0 : 1.0) * forward_flops};

    printf("\n%-9s %11s %10s %10s %17s\n", "phase", "median ms", "min ms", "max ms", "TFLOP/s per rank");
    for (int p = 0; p < NUM_PHASES; ++p) {
        if (isnan(st->median[p])) {
            printf("%-9s n/a (%s)\n", phase_names[p], st->opt->no_backward ? "skipped: --no-backward" : "did not run");
            continue;
        }
        printf("%-9s %11.3f %10.3f %10.3f", phase_names[p], 1e3 * st->median[p], 1e3 * st->min[p], 1e3 * st->max[p]);
        if (flops[p] > 0.0 && st->median[p] > 0.0) printf(" %17.4g", flops[p] / st->median[p] * 1e-12);
        if (p == PHASE_TOTAL && !st->backward) printf("   (schedule + forward)");
        printf("\n");
    }
    printf("(host wall clock around each call and the mok_synchronize that ends it; %d run%s%s;\n"
           " TFLOP/s counts %s)\n",
           R, R == 1 ? "" : "s, median", st->backend == MOK_BACKEND_CUDA ? ", after one untimed warm-up run" : "",
           s->shared_intermediate > 0 ? "6*T*H*(k*I + I_s) forward, twice that backward"
                                      : "6*T*k*H*I forward, twice that backward");
    if (s->precision == MOK_PRECISION_FP8)
        printf("FP8 weights quantized once before the runs (mok_quantize_weights, every rank): %.3f ms, not in\n"
               " the phases above (a training step quantizes once per optimizer step)\n",
               1e3 * st->quantize_seconds);
    if (st->nranks > 1 && st->median[PHASE_FORWARD] > 0.0) report_links(st);
}

void report_beside(const run_state *st, const double fp8_median[NUM_PHASES]) {
    printf("\n%-9s %11s %11s %9s\n", "phase", "bf16 ms", "FP8 ms", "bf16/FP8");
    for (int p = 0; p < NUM_PHASES; ++p) {
        if (isnan(st->median[p]) || isnan(fp8_median[p])) {
            printf("%-9s n/a (did not run)\n", phase_names[p]);
            continue;
        }
        printf("%-9s %11.3f %11.3f", phase_names[p], 1e3 * st->median[p], 1e3 * fp8_median[p]);
        if (fp8_median[p] > 0.0) printf(" %8.2fx", st->median[p] / fp8_median[p]);
        printf("\n");
    }
    printf("(medians of %d run%s each on the same inputs; FP8's exclude mok_quantize_weights, once per\n"
           " optimizer step: %.3f ms)\n",
           st->opt->repeat, st->opt->repeat == 1 ? "" : "s", 1e3 * st->quantize_seconds);
}

/* Whether every run wrote the same bits (with more than one), and the first run's hash (the same
 * inputs, --seed, on another build give the same hash when it computes the same bits). */
int report_hashes(const run_state *st) {
    int same = 1;
    for (int i = 1; i < st->opt->repeat; ++i) same &= st->output_hashes[i] == st->output_hashes[0];
    if (st->opt->repeat > 1) printf("outputs bitwise identical over %d runs: %s\n", st->opt->repeat, same ? "yes" : "NO");
    printf("outputs hash (FNV-1a, first run): %016llx\n", (unsigned long long)st->output_hashes[0]);
    return !same;
}
