/* memory.h — whether a `mok run` fits in the host memory it can have, decided before its large
 * allocations. The estimate adds what the run holds at its peak: on the cpu backend the
 * workspaces (mok_workspace_sizes) and every tensor (the library's memory is host memory); on the
 * cuda backend the host copies of the inputs; and with --check the reference (its fp64 copy of
 * the layer and its outputs, and the fp32 gradients the command compares against). Under FP8 the
 * library's memory holds each rank's FP8 weights too, and the reference a second fp64 copy of
 * the layer, quantized. */
#ifndef MOK_TOOLS_MEMORY_H
#define MOK_TOOLS_MEMORY_H

#include <stdint.h>

#include "mok.h"

typedef struct tools_run_size {
    const mok_shape *shape;
    int nranks;
    int64_t tokens;        /* per rank (the most any rank has) */
    int library_on_host;   /* cpu backend: the library's memory is host memory */
    int backward;
    int check;             /* the reference runs */
    int64_t check_tokens;  /* per rank handed to the reference (at most tokens) */
    double workspace_bytes, schedule_bytes, context_bytes; /* per rank (mok_workspace_sizes) */
    double fp8_weight_bytes; /* per rank (mok_fp8_layout.bytes); 0 for bf16 */
} tools_run_size;

/* The parts of a run's peak host memory, in bytes. */
typedef struct tools_host_need {
    double workspace; /* workspaces, schedules, contexts and FP8 weights (cpu backend) */
    double tensors;   /* inputs, outputs and their host copies */
    double reference; /* --check */
    double total;
} tools_host_need;

tools_host_need tools_host_need_of(const tools_run_size *run);

/* Host memory this process can still have, in bytes: MOK_HOST_MEMORY when set (bytes, or with a
 * K, M, G or T suffix: a share of a machine, or a test's small one), else MemAvailable of
 * /proc/meminfo, or less under a cgroup's memory limit. -1 when none can be read. */
double tools_host_available(void);

#endif
