/* tasks.h — the task list of one pass on one rank: every unit of work in the one global order,
 * each with the counters it waits on and the counter it bumps when done. A worker runs tasks of
 * one role (comm: moves rows; compute: GEMM tiles): a CTA on the cuda backend, a thread on the
 * cpu backend. The comm workers go by their backend's unit where they are counted: the config's
 * fwd_comm_sms and bwd_comm_sms (CTAs; the cuda tuning's fwd_comm_ctas, bwd_comm_ctas) and
 * cpu_comm_threads (threads; cpu_workspace.comm_workers).
 *
 * Deadlock freedom (DESIGN 2.4): a task only waits on counters bumped by tasks that come earlier
 * in the order, and every worker of a role takes its role's tasks in that order. Then the first
 * unfinished task always has its inputs ready and a worker on it. mok__tasks_check verifies the
 * first half of that for any list; the tests run it on every list they build.
 *
 * Counters are per minibatch, per row tile (the hand-offs between transfers and GEMMs and between
 * GEMMs: a gate/up or dh tile waits only for the rows of its own row tile to arrive, a down tile
 * only for the gate/up tiles of its own rows), per shared row tile or per macrobatch, and only
 * grow within a pass; a task's wait is "counter >= target".
 *
 * Transfer directions (DESIGN 2.4). By default every wait and every bump is on the rank's own
 * counters. With plan.combine_pull the forward's combine is pulled: each rank gathers the rows
 * it owns from every peer's ring (GATHER tasks, one per peer row tile), waiting on that peer's
 * down-tile counter and bumping that peer's `combined` counter, so a wait or a bump may name a
 * peer (wait_peer, done_peer). plan.dispatch_pull does the same for the backward's
 * reverse-dispatch: GATHER tasks take each row's dx part and router-weight gradient from the
 * expert rank's ring after its dx tile, and bump its `pushed` counter. plan.dispatch_push turns
 * the forward's dispatch around: each rank writes its own rows into every peer's ring (SCATTER
 * tasks, one per peer row tile), after that slot's previous occupant was combined there (a wait
 * on the peer's `combined`), and bumps the peer's `dispatched` of that tile; a rank's gate/up
 * waits for a SCATTER from every rank per tile. plan.combine_push does the same for the backward's
 * reverse-combine (dy, x and the router weight of each row): the expert rank first opens the
 * minibatch's ring slots with an OPEN task (its own refill waits, which senders cannot see),
 * and the senders' SCATTERs wait on its `opened` counter. Deadlock freedom then covers the ranks: every rank lays its list
 * out by minibatch index over the largest minibatch count of any rank, so that all lists
 * project one global order; mok__tasks_check_ranks simulates the lists together. Portable C: built on the host for the cpu backend,
 * the same code on the device for cuda. */
#ifndef MOK_CORE_TASKS_H
#define MOK_CORE_TASKS_H

#include <stdint.h>

#include "portable.h"

/* Minibatches the dispatching comm workers may run ahead of the compute workers (bounded by
 * the ring: never more than ring_rows / minibatch_rows - 1). */
#define MOK_LOOKAHEAD_MINIBATCHES 2

enum mok_role { MOK_ROLE_COMM = 0, MOK_ROLE_COMPUTE = 1 };

/* The task kinds, one row each: the name after MOK_TASK_, the name traces and tools print, the
 * role whose workers run it, and what one task does (a, b: its tile indices). The enum,
 * mok__task_kind_name and mok__task_kind_role come from this table; scripts/tasks_dump prints it
 * (for scripts/sim_pass.py). */
#define MOK_TASK_KINDS(X)                                                                                        \
    /* forward */                                                                                                \
    X(SHARED_UP, "shared_up", COMPUTE, "shared expert gate/up + SwiGLU for (token tile a, I_s tile b)")         \
    X(SHARED_DOWN, "shared_down", COMPUTE, "shared expert down for (token tile a, H tile b)")                     \
    X(DISPATCH, "dispatch", COMM, "pull the routed rows of row tile a into the ring")                            \
    X(GATEUP, "gateup", COMPUTE, "gate/up GEMM + SwiGLU for (row tile a, I tile b)")                              \
    X(DOWN, "down", COMPUTE, "down GEMM for (row tile a, H tile b)")                                             \
    X(COMBINE, "combine", COMM, "push the expert outputs of row tile a to their owners")                         \
    /* backward */                                                                                               \
    X(SHARED_DH, "shared_dh", COMPUTE, "dy.S_down + SwiGLU backward for (token tile a, I_s tile b)")              \
    X(SHARED_DX, "shared_dx", COMPUTE, "shared dx part for (token tile a, H tile b)")                            \
    X(PULL, "pull", COMM, "pull dy, router weight and x rows of row tile a into the ring")                       \
    X(DH, "dh", COMPUTE, "dy.W_down (+ replay of g/u) + SwiGLU backward + router dot, (row tile a, I tile b)")    \
    X(DX, "dx", COMPUTE, "dx part of row tile a, H tile b")                                                      \
    X(PUSH, "push", COMM, "push dx parts and router gradients of row tile a to their owners")                    \
    X(WGRAD, "wgrad", COMPUTE, "one weight-gradient tile of a local expert over a macrobatch's rows")            \
    X(SHARED_WGRAD, "shared_wgrad", COMPUTE, "one weight-gradient tile of the shared expert over all tokens")    \
    X(WGRAD_ZERO, "wgrad_zero", COMPUTE, "zero the gradients of an expert that received no rows (bf16 mode)")    \
    /* turned transfers (either pass) */                                                                         \
    X(GATHER, "gather", COMM,                                                                                    \
      "this rank's rows of peer `peer`'s row tile a: expert outputs (forward, combine_pull), dx parts and "      \
      "router-weight gradients (backward, dispatch_pull)")                                                       \
    X(SCATTER, "scatter", COMM,                                                                                  \
      "this rank's rows into peer `peer`'s row tile a: x (forward, dispatch_push); dy, x and the router "        \
      "weight (backward, combine_push)")                                                                         \
    X(OPEN, "open", COMM, "backward, combine_push: a minibatch's ring slots free for the senders")

enum mok_task_kind {
#define MOK_X_KIND(name, text, role, what) MOK_TASK_##name,
    MOK_TASK_KINDS(MOK_X_KIND)
#undef MOK_X_KIND
    MOK_TASK_NUM_KINDS
};

/* Weight-gradient tiles: which matrix, and a tile of its [rows, cols] output. */
enum mok_wgrad_matrix { MOK_WGRAD_GATE = 0, MOK_WGRAD_UP = 1, MOK_WGRAD_DOWN = 2 };

typedef struct mok_task {
    int16_t kind, role;
    int32_t minibatch;   /* minibatch (or macrobatch for WGRAD), -1 when none */
    int32_t a, b;        /* tile indices, meaning by kind (see above) */
    int32_t expert;      /* WGRAD, WGRAD_ZERO: local expert; else -1 */
    int32_t matrix;      /* WGRAD, SHARED_WGRAD: enum mok_wgrad_matrix; else -1 */
    int32_t done[2];     /* counters bumped when done, -1 none */
    int32_t wait[2];     /* counters waited on, -1 none */
    int32_t target[2];
    int32_t peer;        /* GATHER: the rank whose ring it reads; else -1 */
    int32_t wait_peer;   /* the rank whose counter wait[0] is; -1: this rank (wait[1] is always its own) */
    int32_t done_peer;   /* the rank whose counter done[0] is; -1: this rank (done[1] is always its own) */
} mok_task;

/* What the list is built from. Tiles: rows MOK_ROW_TILE; n_tile columns for the routed and
 * shared GEMM outputs; wgrad tiles are wgrad_tile x wgrad_tile_n (x wgrad_tile when 0). */
typedef struct mok_plan {
    int backward;       /* 0 forward, 1 backward */
    int recompute;      /* forward only: rebuild the context (no down, no combine) */
    int accumulate;     /* backward: fp32 in-place weight gradients */
    int64_t padded_rows;
    int64_t context_rows; /* rows < context_rows have g/u in the context */
    int64_t num_tokens;   /* local T */
    int64_t hidden, intermediate, shared_intermediate;
    int num_local_experts;
    int minibatch_rows, ring_rows;
    int n_tile;         /* columns of I (or I_s) per gate/up, SwiGLU-backward task */
    int n_tile_h;       /* columns of H per down, dx task */
    int wgrad_tile;     /* rows of a weight-gradient tile (and its columns when wgrad_tile_n is 0) */
    int wgrad_tile_n;   /* columns of a weight-gradient tile; 0: wgrad_tile */
    int raster;         /* GEMM spans walk their tiles in runs of `raster` (mok__span_tile); 0, 1: tile-major */
    const int64_t *expert_start; /* [E_local + 1] padded row offsets */
    const int64_t *expert_rows;  /* [E_local] */
    /* Transfer directions other than the default (zero: pull dispatch, push combine, pull
       reverse-combine, push reverse-dispatch, and the fields below unused). */
    int combine_pull;            /* forward: owners gather expert outputs from the peers' rings */
    int dispatch_pull;           /* backward: owners gather dx parts and router-weight gradients */
    int dispatch_push;           /* forward (not recompute): owners write x rows into the peers' rings */
    int combine_push;            /* backward: owners write dy, x, w rows into the peers' rings */
    int nranks, rank;
    const int64_t *peer_padded_rows; /* [nranks]: every rank's padded rows (either of the two) */
} mok_plan;

/* Counter layout for a plan: [kind-major blocks]. */
typedef struct mok_counters_layout {
    int64_t num_minibatches, num_macrobatches, num_token_tiles, num_row_tiles;
    int64_t dispatched;                                         /* per row tile */
    int64_t gateup_done, combined;                              /* per minibatch */
    int64_t gateup_tile, down_tile;                             /* per row tile */
    int64_t shared_up_done;                                     /* per token tile */
    int64_t pushed;                                             /* per minibatch */
    int64_t pulled;                                             /* per row tile */
    int64_t dh_tile, dx_tile;                                   /* per row tile */
    int64_t wgrad_done, dh_macro_done;                          /* per macrobatch */
    int64_t opened;                                             /* per minibatch (combine_push) */
    int64_t wgrad_expert;                                       /* per local expert, over the macrobatches */
    int64_t shared_dh_all;                                      /* one */
    int64_t total;
} mok_counters_layout;

MOK_CORE void mok__counters_layout(const mok_plan *plan, mok_counters_layout *layout);

/* The list is built as spans: a span is one kind of task for one minibatch (or all token
 * tiles of the shared expert, or one expert of a macrobatch's weight gradients), its tasks
 * (tile, sub-tile) in tile-major order, all with the same waits (or wait[0] per tile) and the
 * same counters to bump (or done[0] per tile). A GPU CTA walks its role's spans with a ticket;
 * the cpu backend expands them into tasks. */
typedef struct mok_task_span {
    int16_t kind, role;
    int32_t minibatch;             /* minibatch; WGRAD: macrobatch; else -1 */
    int32_t first_tile, num_tiles; /* row or token tiles; WGRAD, WGRAD_ZERO: the expert, 1 */
    int32_t n_tiles;               /* tasks per tile */
    int32_t wait[2], target[2];    /* counters waited on (-1 none) */
    int32_t done[2];               /* counters bumped per task (-1 none) */
    int8_t wait_per_tile;          /* wait[0] + (tile - first_tile) */
    int8_t done_per_tile;          /* done[0] + (tile - first_tile) */
    int16_t raster;                /* tiles per run of the walk (mok__span_tile); 0, 1: tile-major */
    int8_t peer, wait_peer, done_peer; /* as in mok_task; -1 none / this rank */
    int8_t reserved;
} mok_task_span;

/* Task t of a span: its tile and sub-tile. Tile-major by default (all sub-tiles of a tile, then the
 * next tile). With raster r > 1 the tiles go in runs of r, and within a run each sub-tile visits
 * every tile of the run before the next sub-tile: the CTAs that run neighbouring tickets at once
 * then share a sub-tile's operand (a block of weights) in L2 instead of each streaming its own.
 * Any order within a span is deadlock-free: a task waits only on counters of earlier spans. */
static inline MOK_HD void mok__span_tile(const mok_task_span *g, int64_t t, int64_t *tile, int64_t *sub) {
    if (g->raster <= 1) {
        *tile = g->first_tile + t / g->n_tiles;
        *sub = t % g->n_tiles;
        return;
    }
    const int64_t run = t / ((int64_t)g->raster * g->n_tiles), in = t % ((int64_t)g->raster * g->n_tiles);
    const int64_t left = g->num_tiles - run * g->raster, rows = left < g->raster ? left : g->raster;
    *tile = g->first_tile + run * g->raster + in % rows;
    *sub = in / rows;
}

/* Upper bounds, for sizing buffers at workspace creation. */
MOK_CORE int64_t mok__tasks_max(const mok_plan *worst_case, int64_t max_rows, int64_t max_tokens);
MOK_CORE int64_t mok__spans_max(const mok_plan *worst_case, int64_t max_rows, int64_t max_tokens);
MOK_CORE int64_t mok__counters_max(const mok_plan *worst_case, int64_t max_rows, int64_t max_tokens);

/* The spans in the global order (capacity cap); returns the count, or -1 if cap is too small. */
MOK_CORE int64_t mok__spans_build(const mok_plan *plan, mok_task_span *spans, int64_t cap);
/* The same, publishing the list as it grows for readers that run beside the build: after each span
 * is written, *published = count << 1 (a release store on the device), count the spans written so
 * far (at most cap). The complete bit (bit 0) is the caller's to set once the build returns:
 * readers take span g once g < *published >> 1, and know there are no more once bit 0 is set. */
MOK_CORE int64_t mok__spans_build_published(const mok_plan *plan, mok_task_span *spans, int64_t cap,
                                            uint64_t *published);
/* Task t of a span. */
MOK_CORE void mok__span_task(const mok_plan *plan, const mok_task_span *span, int64_t t, mok_task *task);
/* The tasks in the global order (the spans expanded); returns the count, or -1. */
MOK_CORE int64_t mok__tasks_build(const mok_plan *plan, mok_task *tasks, int64_t cap);

/* Weight-gradient tiles of one expert: tile t -> matrix and output tile (row, col) indices;
 * dims are rounded up to whole tiles (the last may be partial). */
MOK_CORE int64_t mok__wgrad_tiles(const mok_plan *plan, int64_t inter);
MOK_CORE void mok__wgrad_tile(const mok_plan *plan, int64_t inter, int64_t t, int *matrix, int64_t *row_tile,
                              int64_t *col_tile);

/* Returns 0 if every wait of every task is satisfied by tasks earlier in the list; else the
 * index + 1 of the first task that breaks it. scratch: num_counters int64 (host only). Lists
 * that name peers (wait_peer, done_peer) need mok__tasks_check_ranks. */
#ifndef __CUDACC__
int64_t mok__tasks_check(const mok_task *tasks, int64_t count, int64_t num_counters, int64_t *scratch);
/* The lists of ranks 0..nranks-1 run together, one worker per role per rank, each role's tasks
 * in list order, counters per rank: returns the number of tasks that ran (the sum of counts when
 * none deadlocks). counters[r]: num_counters[r] int64 of rank r (zeroed here). on_run (may be
 * NULL) is called with each task as it runs, before its counters are bumped. */
int64_t mok__tasks_check_ranks(int nranks, const mok_task *const *tasks, const int64_t *counts,
                               const int64_t *num_counters, int64_t *const *counters,
                               void (*on_run)(void *ctx, int rank, int64_t index), void *ctx);
#endif

/* The task kind's name (for traces) and role (enum mok_role), from MOK_TASK_KINDS; "?" and -1 for
 * a value that is not a kind. */
MOK_CORE const char *mok__task_kind_name(int kind);
MOK_CORE int mok__task_kind_role(int kind);

/* Whether the plan turns a transfer around, so that its list waits on or bumps peers' counters
 * (combine_pull, dispatch_pull, dispatch_push, combine_push). */
MOK_CORE int mok__plan_names_peers(const mok_plan *plan);

/* Whether the pass's compute tiles write its outputs where its transfers would: on one rank with
 * the default directions the down tiles write each row's expert output into its (token, slot) row
 * of the combine buffer, and the dx tiles the dx parts and d_router_w into theirs (both backends).
 * The list then has no COMBINE (forward) or PUSH (backward) tasks, which would move nothing yet
 * hold a comm worker behind those tiles: the down / dx tiles bump the minibatch's `combined` /
 * `pushed` counter themselves, and a refill waits for all of them. */
MOK_CORE int mok__plan_in_place(const mok_plan *plan);

/* Rows [first, end) of the expert `e` that fall inside macrobatch m. */
MOK_CORE void mok__expert_rows_in(const mok_plan *plan, int e, int64_t m, int64_t *first, int64_t *end);

#endif
