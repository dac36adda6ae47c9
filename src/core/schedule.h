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
 * functions here are portable C (host and device), allocate nothing and do no I/O. */
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

#endif
