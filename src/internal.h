/* internal.h — what the host side of the library shares: the error path, the group and
 * workspace handles with their calls, and what every backend uses of the config and the shape.
 * The backends' entry points, which api.c dispatches to, are in backend.h. */
#ifndef MOK_INTERNAL_H
#define MOK_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "core/plan.h"
#include "core/schedule.h"
#include "core/tasks.h"
#include "errors.h"
#include "mok.h"

/* What a collective call is. Every rank of a group makes the same collective calls in the same
 * order; each barrier of a call carries its mok_call to the peers, and a rank that meets a peer in
 * another call (another kind, workspace, call number, step, workspace digest or schedule build)
 * fails the call on every rank with a message that names both sides. */
typedef enum mok_call_kind {
    MOK_CALL_NONE = 0,
    MOK_CALL_WORKSPACE_CREATE,
    MOK_CALL_WORKSPACE_DESTROY,
    MOK_CALL_SCHEDULE_BUILD,
    MOK_CALL_FORWARD,
    MOK_CALL_RECOMPUTE,
    MOK_CALL_BACKWARD
} mok_call_kind;

typedef struct mok_call {
    int32_t kind;      /* mok_call_kind */
    int32_t step;      /* which barrier of the call (0 = its first) */
    int64_t workspace; /* the workspace's index in its group (creation order, from 0) */
    int64_t seq;       /* the call's number on its workspace (collective calls, from 1) */
    uint64_t digest;   /* the workspace's shape, group size and protocol config (mok__protocol_digest) */
    int64_t build;     /* the schedule build the call writes (schedule) or reads (passes), named by
                          its call's number; 0: none or unknown (a pass on cuda, whose schedule
                          the host does not read) */
} mok_call;

/* The call's name and number for messages: "mok_forward #3 (schedule build #2)". */
void mok__call_describe(const mok_call *call, char *out, size_t size);

struct mok_backend_ops;

struct mok_group {
    mok_backend backend; /* resolved: MOK_BACKEND_CPU or MOK_BACKEND_CUDA */
    const struct mok_backend_ops *ops; /* that backend's entry points (backend.h) */
    int nranks;
    int num_local_ranks; /* 1 (one rank per process) or nranks (one process drives all) */
    int first_rank;      /* global index of local rank 0 */
    mok_config config;
    int failed;          /* set after a timeout: peers may be out of step, the group is unusable */
    int64_t workspaces_created; /* the next workspace's index (every rank creates in the same order) */
    mok_workspace *workspaces;  /* the live workspaces made on this handle (a list through `next`):
                                   mok_group_destroy refuses while it is not empty */
    void *impl;          /* backend state */
};

struct mok_workspace {
    mok_group *group;
    const struct mok_backend_ops *ops; /* its group's */
    mok_workspace *next;    /* the group's next live workspace */
    mok_shape shape;
    mok_config config;
    int64_t num_local_experts;
    mok_sched_layout sched_layout;
    int64_t context_rows;   /* routed rows whose gate/up the context keeps */
    size_t context_routed_offset; /* byte offset of the routed rows' g/u in a context (past its tag) */
    size_t context_shared_offset; /* byte offset of the shared expert's g/u in a context */
    mok_sizes sizes;
    int failed;
    int64_t index;          /* creation order in the group, equal on every rank */
    uint64_t digest;        /* mok__protocol_digest of its shape and config */
    uint64_t tag;           /* mok__workspace_tag: what its schedules and contexts say of it */
    int64_t calls;          /* collective calls made on it so far (a schedule build is named by its
                               call's number) */
    mok_call call;          /* the call in progress (its build is per local rank: call_build) */
    int64_t call_build[MOK_MAX_RANKS]; /* the schedule build each local rank's part of the call uses */
    void *impl;
};

/* tags.c (core/schedule.h says what the tags hold). A new workspace's tag: unique in the process
 * for the workspace's life, never 0. */
uint64_t mok__workspace_tag(void);
/* The MOK_ERR_INVALID_ARGUMENT of a tag check that failed (code: MOK_TAG_*, with the value found
 * and the one expected), naming what was wrong and which argument: args ("args[0]") and its
 * schedule or context, or the bare "schedule" of mok_schedule_read when args is NULL. */
mok_status mok__tag_refuse(const mok_workspace *ws, const char *args, int local_rank, int code, int64_t found,
                           int64_t expected);

/* config.c: the digest of what every rank's workspace must agree on (shape, group size and the
 * config fields that change the protocol), and the first such config field two configs differ in
 * (its name and both values, in `out`; 0 when they agree). */
uint64_t mok__protocol_digest(const mok_shape *shape, const mok_config *config, int nranks);
int mok__config_protocol_diff(const mok_config *mine, const mok_config *theirs, int their_rank, char *out,
                              size_t size);

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
    int64_t cycles; /* GPU residency events: the SM's cycles (clock64) from the CTA's entry to its
                       exit, so that a trace tells the clock each SM ran at; 0 otherwise */
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
/* fp8.c: args[r].fp8_weights of a pass: NULL for bf16; for FP8 set, aligned and (cpu) written by
 * mok_quantize_weights for the workspace's shape. */
mok_status mok__check_fp8_weights(const mok_workspace *ws, int r, const void *fp8_weights);

/* What a workspace fixes of every pass's plan (core/plan.h), with the backend's tiles. */
static inline mok_plan_workspace mok__plan_workspace(const mok_workspace *ws, mok_plan_tiles tiles) {
    mok_plan_workspace w;
    w.shape = &ws->shape;
    w.config = &ws->config;
    w.nranks = ws->group->nranks;
    w.context_rows = ws->context_rows;
    w.tiles = tiles;
    return w;
}

#endif
