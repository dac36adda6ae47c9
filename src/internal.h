/* internal.h — what the host side of the library shares: the error path, the group and
 * workspace handles, and the backend entry points that api.c dispatches to. */
#ifndef MOK_INTERNAL_H
#define MOK_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "core/schedule.h"
#include "core/tasks.h"
#include "mok.h"

/* Records the thread-local message (printf format) and returns `status`. */
mok_status mok__fail(mok_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mok__clear_error(void);

struct mok_group {
    mok_backend backend; /* resolved: MOK_BACKEND_CPU or MOK_BACKEND_CUDA */
    int nranks;
    int num_local_ranks; /* 1 (one rank per process) or nranks (one process drives all) */
    int first_rank;      /* global index of local rank 0 */
    mok_config config;
    int failed;          /* set after a timeout: peers may be out of step, the group is unusable */
    void *impl;          /* backend state */
};

struct mok_workspace {
    mok_group *group;
    mok_shape shape;
    mok_config config;
    int64_t num_local_experts;
    mok_sched_layout sched_layout;
    int64_t context_rows;   /* routed rows whose gate/up the context keeps */
    size_t context_shared_offset; /* byte offset of the shared expert's g/u in a context */
    mok_sizes sizes;
    int failed;
    void *impl;
};

/* One recorded task (config.trace): which worker (cpu thread or GPU CTA) ran what, when. */
typedef struct mok_trace_event {
    int16_t kind, worker;
    int32_t minibatch;
    int16_t rank, comm; /* comm: 1 for a data-moving worker */
    int32_t gemm_ns;    /* GPU compute tasks: time inside the GEMM main loops, waits for operands
                           included (the rest of the task is presets and epilogues); 0 otherwise */
    int32_t epi_ns;     /* GPU compute tasks: from the end of the last main loop to the task's end
                           (its epilogue and closing barrier); 0 otherwise */
    int64_t start_ns, end_ns;
} mok_trace_event;
/* The kind of a worker's residency event (entry to exit of a GPU CTA), beside the task kinds. */
#define MOK_TRACE_RESIDENT 64

/* A workspace records two passes (config.trace): its last forward or recompute (pass 0) and its
 * last backward (pass 1), each into a buffer of its own, so that writing the trace after a
 * backward still shows the forward before it. */
#define MOK_TRACE_PASSES 2

/* trace.c: writes the recorded events as Chrome trace JSON (opens in Perfetto). events[i] and
 * counts[i] for i = pass * num_ranks + local rank: the events of that pass on that local rank. */
mok_status mok__trace_write_json(const char *path, const mok_trace_event *const *events, const int64_t *counts,
                                 int num_ranks);

/* Validation shared by every backend (api.c). */
mok_status mok__check_ptr(const void *ptr, const char *name, int required);

/* The worst case of a pass's plan on a workspace, for the bounds of its task list and counters
 * (the backend's tile widths). */
mok_plan mok__plan_worst(const mok_workspace *ws, int n_tile, int n_tile_h, int wgrad_tile);

/* The cpu backend's cross-rank barrier (ok = 0: this rank rejected its arguments). */
mok_status mok__cpu_barrier(mok_group *group, int local_rank, int ok);

/* Backend entry points. The cpu backend is always built; the cuda one when MOK_HAVE_CUDA. */
#define MOK_BACKEND_FUNCS(prefix)                                                                  \
    mok_status prefix##_group_create(mok_group *group, int rank, const mok_unique_id *id,          \
                                     const int *devices);                                          \
    void prefix##_group_destroy(mok_group *group);                                                 \
    mok_status prefix##_workspace_create(mok_workspace *ws);                                       \
    void prefix##_workspace_destroy(mok_workspace *ws);                                            \
    mok_status prefix##_schedule_build(mok_workspace *ws, const mok_schedule_args *args);          \
    mok_status prefix##_schedule_read(mok_workspace *ws, const void *schedule, int local_rank,     \
                                      mok_sched_header *header);                                   \
    mok_status prefix##_forward(mok_workspace *ws, const mok_forward_args *args, int recompute);   \
    mok_status prefix##_backward(mok_workspace *ws, const mok_backward_args *args);                \
    mok_status prefix##_trace_write(mok_workspace *ws, const char *path);                         \
    mok_status prefix##_memory_alloc(mok_group *group, int local_rank, size_t bytes, void **ptr);  \
    mok_status prefix##_memory_free(mok_group *group, int local_rank, void *ptr);                  \
    mok_status prefix##_memory_copy(mok_group *group, int local_rank, void *dst, const void *src,  \
                                    size_t bytes, mok_copy_kind kind);                             \
    mok_status prefix##_synchronize(mok_workspace *ws);

MOK_BACKEND_FUNCS(mok__cpu)
#ifdef MOK_HAVE_CUDA
MOK_BACKEND_FUNCS(mok__cuda)
int mok__cuda_device_count(void);
mok_status mok__cuda_unique_id(mok_unique_id *id);
#endif

#endif
