/* schedule.h — the schedule of one rank: which routed (peer, token, slot) rows its experts
 * receive, in what order, padded how. A pure, deterministic function of all ranks' topk_ids.
 *
 * Row order (the one global order every pass and every backend walks): local experts in
 * increasing id; inside an expert, rows interleaved round-robin across source peers (peer 0's
 * first row, peer 1's first row, ..., then the second rows, skipping peers with no rows left),
 * each peer's rows in increasing (token, slot) order; every expert's segment padded with
 * padding rows (peer -1) to a multiple of MOK_ROW_TILE, so a row tile never mixes experts.
 * Row i of a pass sits in ring slot i % ring_rows; minibatch b holds rows
 * [b * minibatch_rows, (b + 1) * minibatch_rows), macrobatch m rows [m * ring_rows, ...).
 *
 * The schedule lives in one caller buffer (host or device) laid out by mok__sched_layout; all
 * functions here are portable C (host and device), allocate nothing and do no I/O.
 *
 * Tags: the schedule's header and the forward context's tag (mok_context_tag) say which workspace
 * wrote them, with which schedule build, as which rank, so that a pass refuses a schedule or a
 * context that does not belong to it. They travel with the bytes: a copy of a schedule or a
 * context is accepted, and a buffer's address means nothing. */
#ifndef MOK_CORE_SCHEDULE_H
#define MOK_CORE_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"
#include "portable.h"

#define MOK_SCHED_MAGIC 0x4d4f4b5343484431ll /* "MOKSCHD1" */

/* Fixed header at the start of the buffer. */
typedef struct mok_sched_header {
    int64_t magic;
    int32_t nranks, rank;
    int32_t num_local_experts, topk;
    int64_t max_rows;          /* capacity of the row arrays */
    int64_t routed_rows;       /* real rows routed to this rank */
    int64_t padded_rows;       /* rows including padding */
    int64_t max_expert_rows;
    int32_t error;             /* nonzero: the build found an inconsistency (see MOK_SCHED_ERR_*) */
    int32_t pad_;
    uint64_t workspace;        /* the tag of the workspace that built it (mok_workspace.tag; never 0),
                                  0 when built outside one (mok__sched_build alone) */
    int64_t build;             /* which build of that workspace: the number of its mok_schedule_build
                                  call among the workspace's collective calls (api.c's NOTE) */
    int64_t num_tokens[MOK_MAX_RANKS];
} mok_sched_header;

#define MOK_SCHED_ERR_EXPERT_ID 1 /* an id >= E or < -1 */
#define MOK_SCHED_ERR_CAPACITY 2  /* more rows than max_rows (cannot happen for valid T) */
#define MOK_SCHED_ERR_TOKENS 3    /* a peer's T outside [0, T_max] */

/* Byte offsets of the arrays inside a schedule buffer; every array starts 16-byte aligned. */
typedef struct mok_sched_layout {
    int nranks, num_local_experts, topk;
    int64_t max_tokens, max_rows;
    size_t off_expert_start; /* int64 [E_local + 1]: first padded row of each local expert */
    size_t off_expert_rows;  /* int64 [E_local]: real rows of each local expert */
    size_t off_counts;       /* int64 [E_local][P]: rows from each peer */
    size_t off_row_peer;     /* int32 [max_rows]: source rank of each row, -1 = padding */
    size_t off_row_slot;     /* int32 [max_rows]: t * k + j on the source rank, -1 = padding */
    size_t off_own_ids;      /* int32 [T_max * k]: this rank's topk_ids (read by the epilogues) */
    size_t bytes;
} mok_sched_layout;

/* Worst-case padded rows one rank can receive: every slot of every rank routed here, plus the
 * padding of every local expert. */
MOK_CORE int64_t mok__sched_max_rows(int nranks, int64_t num_local_experts, int64_t topk, int64_t max_tokens);
MOK_CORE void mok__sched_layout(mok_sched_layout *layout, int nranks, int64_t num_local_experts, int64_t topk,
                              int64_t max_tokens);

/* Typed views of a schedule buffer. */
typedef struct mok_sched_view {
    mok_sched_header *header;
    int64_t *expert_start; /* [E_local + 1] */
    int64_t *expert_rows;  /* [E_local] */
    int64_t *counts;       /* [E_local * P] */
    int32_t *row_peer;     /* [max_rows] */
    int32_t *row_slot;     /* [max_rows] */
    int32_t *own_ids;      /* [T_max * k] */
} mok_sched_view;

MOK_CORE mok_sched_view mok__sched_view(const mok_sched_layout *layout, void *buffer);

/* Builds rank `rank`'s schedule from all ranks' topk_ids (ids[p] -> [num_tokens[p], k]).
 * Sequential reference form, used by the cpu backend and the tests; the cuda backend runs the
 * same phases in parallel. Returns the header's error code (0 = fine). */
MOK_CORE int mok__sched_build(const mok_sched_layout *layout, void *buffer, int rank, int64_t num_experts,
                            const int64_t *num_tokens, const int32_t *const *ids);

/* Expert (local index) that padded row `row` belongs to: binary search of expert_start. */
MOK_CORE int mok__sched_row_expert(const mok_sched_view *view, int num_local_experts, int64_t row);

/* Names the workspace and build that own a schedule (its header's tag fields). Every build of a
 * workspace's schedule calls it once the header is written, on both backends. */
MOK_CORE void mok__sched_tag(void *buffer, uint64_t workspace, int64_t build);

/* The tag at the start of a forward context (MOK_CONTEXT_TAG_BYTES of it, mok.h): which workspace's
 * pass wrote the context, with which schedule build, as which rank. Every forward and recompute
 * writes it whole (the bytes past the struct as zeros), the backward reads the struct. At the start
 * because the start lies inside every workspace's context: a backward given another workspace's
 * smaller context reads its tag, never past its end. */
#define MOK_CONTEXT_MAGIC 0x4d4f4b4354585431ll /* "MOKCTXT1" */
typedef struct mok_context_tag {
    int64_t magic;      /* MOK_CONTEXT_MAGIC once a forward or recompute wrote the context */
    uint64_t workspace; /* the tag of the workspace whose pass wrote it */
    int64_t build;      /* the build of the schedule that pass read */
    int32_t rank;       /* the rank that pass ran as */
    int32_t pad_;
} mok_context_tag;

/* What a tag check finds: MOK_TAG_OK, or what does not belong to the pass. The details each
 * check reports beside its code (the value found, the value the pass expected) say what was
 * wrong in the message. */
enum {
    MOK_TAG_OK = 0,
    MOK_TAG_SCHEDULE_WORKSPACE = 1, /* the schedule was built by another workspace (found: its tag) */
    MOK_TAG_SCHEDULE_RANK = 2,      /* built for another rank (found: that rank) */
    MOK_TAG_CONTEXT_MISSING = 3,    /* the context holds no tag: no forward or recompute wrote it */
    MOK_TAG_CONTEXT_WORKSPACE = 4,  /* written by another workspace's pass (found: its tag) */
    MOK_TAG_CONTEXT_RANK = 5,       /* written by another rank's pass (found: that rank) */
    MOK_TAG_CONTEXT_BUILD = 6       /* written with another schedule build than the schedule's
                                       (found: the context's build, expected: the schedule's) */
};

/* A schedule (its magic already checked) for a pass of workspace `workspace` as rank `rank`. */
MOK_CORE int mok__sched_tag_check(const mok_sched_header *header, uint64_t workspace, int rank, int64_t *found,
                                  int64_t *expected);
/* A context for a backward of workspace `workspace` as rank `rank` with schedule build `build`. */
MOK_CORE int mok__context_tag_check(const mok_context_tag *tag, uint64_t workspace, int64_t build, int rank,
                                    int64_t *found, int64_t *expected);
/* The whole tag a forward or recompute writes (MOK_CONTEXT_TAG_BYTES: the struct, then zeros). */
MOK_CORE void mok__context_tag_write(void *context, uint64_t workspace, int64_t build, int rank);

#endif
