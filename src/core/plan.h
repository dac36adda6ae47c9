/* plan.h — the one place where a workspace's shape and config become the plan of a pass
 * (mok_plan, core/tasks.h): a pass's own, and the worst case that bounds every pass's task list,
 * spans and counters (the backends size their buffers from it at workspace creation). The config's
 * transfer directions become the plan's switches here and nowhere else. Host C: the cpu backend
 * calls it per pass, the cuda backend's host code for the worst case (its kernels rebuild a
 * pass's plan from the pass's parameters, megakernel/params.cuh: make_plan). */
#ifndef MOK_CORE_PLAN_H
#define MOK_CORE_PLAN_H

#include <stdint.h>

#include "core/schedule.h"
#include "core/tasks.h"
#include "mok.h"

/* The pass a plan is for. */
enum mok_pass_kind { MOK_PASS_FORWARD = 0, MOK_PASS_RECOMPUTE = 1, MOK_PASS_BACKWARD = 2 };

/* The tiles a backend builds its lists for (mok_plan's fields of the same names). */
typedef struct mok_plan_tiles {
    int n_tile, n_tile_h, wgrad_tile, wgrad_tile_n, raster;
} mok_plan_tiles;

/* What a workspace fixes of every pass's plan. */
typedef struct mok_plan_workspace {
    const mok_shape *shape;
    const mok_config *config;
    int nranks;
    int64_t context_rows; /* the workspace's: routed rows whose gate/up the context keeps */
    mok_plan_tiles tiles;
} mok_plan_workspace;

/* What one pass on one rank adds: its kind, its tokens and its schedule. */
typedef struct mok_plan_pass {
    int kind;        /* enum mok_pass_kind */
    int accumulate;  /* backward: fp32 in-place weight gradients */
    int rank;        /* global */
    int64_t num_tokens;
    const mok_sched_view *sched; /* padded rows and expert segments */
} mok_plan_pass;

/* The worst case of a pass's plan on the workspace: every switch the config turns, no rows and no
 * tokens (mok__tasks_max, mok__spans_max, mok__counters_max take the maxima). */
mok_plan mok__plan_worst(const mok_plan_workspace *ws);

/* The plan of one pass. Its peer_padded_rows stays NULL: a list that names peers needs every
 * rank's padded rows, which the backend reads from the peers' schedules. */
mok_plan mok__plan_pass(const mok_plan_workspace *ws, const mok_plan_pass *pass);

/* A pass's kind and transfer switches alone (mok_plan's backward, recompute, combine_pull,
 * dispatch_push, dispatch_pull, combine_push; the rest zero): for a backend whose kernels build the
 * rest of the plan themselves. */
mok_plan mok__plan_switches(const mok_config *config, int kind);

/* Whether the config turns any transfer from its default direction (pull dispatch, push combine,
 * pull reverse-combine, push reverse-dispatch): then some pass's list names peers, and peers reach
 * the rings, counters and schedule (core/layout.h). */
int mok__config_turned(const mok_config *config);

#endif
