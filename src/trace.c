/* trace.c — the kernel timeline as Chrome trace JSON: one process per rank, one thread per
 * worker (cpu thread or GPU CTA), one complete event per task, times in microseconds from the
 * earliest event. GPU CTAs add one "resident" event each (category "resident"), from the kernel's
 * start on that CTA to its end: what lies outside the tasks. Opens in Perfetto or chrome://tracing; bench/timeline.py draws it as a PNG. */
#include <stdio.h>

#include "core/tasks.h"
#include "internal.h"

mok_status mok__trace_write_json(const char *path, const mok_trace_event *const *events, const int64_t *counts,
                                 int num_ranks) {
    FILE *f = fopen(path, "w");
    if (!f) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "path: cannot open '%s' for writing", path);
    int64_t origin = INT64_MAX;
    for (int r = 0; r < num_ranks; ++r)
        for (int64_t i = 0; i < counts[r]; ++i)
            if (events[r][i].start_ns < origin) origin = events[r][i].start_ns;
    fprintf(f, "{\"traceEvents\":[\n");
    int first = 1;
    for (int r = 0; r < num_ranks; ++r)
        for (int64_t i = 0; i < counts[r]; ++i) {
            const mok_trace_event *e = &events[r][i];
            fprintf(f,
                    "%s{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                    "\"args\":{\"minibatch\":%d,\"gemm_us\":%.3f,\"epilogue_us\":%.3f}}",
                    first ? "" : ",\n", e->kind == MOK_TRACE_RESIDENT ? "resident" : mok__task_kind_name(e->kind),
                    e->kind == MOK_TRACE_RESIDENT ? "resident" : e->comm ? "comm" : "compute", e->rank, e->worker,
                    (double)(e->start_ns - origin) / 1e3, (double)(e->end_ns - e->start_ns) / 1e3, e->minibatch,
                    (double)e->gemm_ns / 1e3, (double)e->epi_ns / 1e3);
            first = 0;
        }
    fprintf(f, "\n]}\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return mok__fail(MOK_ERR_BACKEND, "path: error writing '%s'", path);
    return MOK_OK;
}
