/* trace.c — the kernel timeline as Chrome trace JSON (opens in Perfetto or chrome://tracing;
 * bench/timeline.py draws it as a PNG). A workspace keeps two passes: its last forward (or
 * recompute) and its last backward. Each (rank, pass) is one process, named "rank R forward" or
 * "rank R backward" (pid R and MOK_MAX_RANKS + R), each worker (cpu thread or GPU CTA) one thread
 * of it, named "comm worker W" or "compute worker W" (tid W), and each task one complete event
 * whose args repeat the rank and the pass. Times are microseconds from the earliest event of
 * either pass, so that the two passes keep their order on one axis. GPU CTAs add one "resident"
 * event each (category "resident"), from the kernel's start on that CTA to its end: what lies
 * outside the tasks; its args' sm_cycles are the SM's cycles over that time, so cycles over its
 * microseconds is the clock (MHz) the SM held through the pass. */
#include <stdio.h>
#include <stdlib.h>

#include "core/tasks.h"
#include "internal.h"

static const char *const pass_names[MOK_TRACE_PASSES] = {"forward", "backward"};

static int pid_of(int rank, int pass) { return pass * MOK_MAX_RANKS + rank; }

/* The separator before every event but the first. */
static const char *next(int *first) {
    const char *sep = *first ? "\n" : ",\n";
    *first = 0;
    return sep;
}

/* Names the process of one (rank, pass) and the thread of each worker in its events; a worker is
 * a comm worker when its events say so (a worker keeps its role for a whole pass). Returns 0, or
 * -1 when out of memory. */
static int write_names(FILE *f, int *first, const mok_trace_event *events, int64_t count, int pass) {
    const int rank = events[0].rank, pid = pid_of(rank, pass);
    fprintf(f, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d %s\"}}",
            next(first), pid, rank, pass_names[pass]);
    fprintf(f, "%s{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}}",
            next(first), pid, pid);
    int workers = 0;
    for (int64_t i = 0; i < count; ++i)
        if (events[i].worker >= workers) workers = events[i].worker + 1;
    signed char *role = calloc(workers > 0 ? (size_t)workers : 1, 1); /* 0 none, 1 compute, 2 comm */
    if (!role) return -1;
    for (int64_t i = 0; i < count; ++i)
        if (events[i].worker >= 0) role[events[i].worker] = events[i].comm ? 2 : 1;
    for (int w = 0; w < workers; ++w)
        if (role[w])
            fprintf(f,
                    "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s worker %d\"}}",
                    next(first), pid, w, role[w] == 2 ? "comm" : "compute", w);
    free(role);
    return 0;
}

static void write_event(FILE *f, int *first, const mok_trace_event *e, int pass, int64_t origin) {
    const int resident = e->kind == MOK_TRACE_RESIDENT;
    fprintf(f,
            "%s{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
            "\"args\":{\"rank\":%d,\"pass\":\"%s\",\"minibatch\":%d,\"gemm_us\":%.3f,\"epilogue_us\":%.3f",
            next(first), resident ? "resident" : mok__task_kind_name(e->kind),
            resident ? "resident" : e->comm ? "comm" : "compute", pid_of(e->rank, pass), e->worker,
            (double)(e->start_ns - origin) / 1e3, (double)(e->end_ns - e->start_ns) / 1e3, e->rank, pass_names[pass],
            e->minibatch, (double)e->gemm_ns / 1e3, (double)e->epi_ns / 1e3);
    if (resident && e->cycles > 0) fprintf(f, ",\"sm_cycles\":%lld", (long long)e->cycles);
    fputs("}}", f);
}

mok_status mok__trace_write_json(const char *path, const mok_trace_event *const *events, const int64_t *counts,
                                 int num_ranks) {
    FILE *f = fopen(path, "w");
    if (!f) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "path: cannot open '%s' for writing", path);
    const int parts = MOK_TRACE_PASSES * num_ranks;
    int64_t origin = INT64_MAX;
    for (int part = 0; part < parts; ++part)
        for (int64_t i = 0; i < counts[part]; ++i)
            if (events[part][i].start_ns < origin) origin = events[part][i].start_ns;
    fprintf(f, "{\"traceEvents\":[");
    int first = 1, out_of_memory = 0;
    for (int part = 0; part < parts && !out_of_memory; ++part) {
        const int pass = part / num_ranks;
        if (counts[part] == 0) continue;
        out_of_memory = write_names(f, &first, events[part], counts[part], pass) != 0;
        for (int64_t i = 0; i < counts[part]; ++i) write_event(f, &first, &events[part][i], pass, origin);
    }
    fprintf(f, "\n]}\n");
    const int bad = ferror(f);
    if (fclose(f) != 0 || bad) return mok__fail(MOK_ERR_BACKEND, "path: error writing '%s'", path);
    if (out_of_memory) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "trace: out of host memory naming the workers");
    return MOK_OK;
}
