/* layout.h — a rank's symmetric region: the byte offsets of what its peers read and write (the
 * same on every rank, since every rank's workspace has the same shape and protocol config), for
 * both backends, and the named slots past a pass's counters. Plain C: the cpu backend and the cuda
 * backend's host code compute the layout here (mok__region_layout); the kernels read the offsets
 * from their pass parameters and the slot names from here. */
#ifndef MOK_CORE_LAYOUT_H
#define MOK_CORE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

/* A rank's counter block: a pass's counters (counters_cap of them, mok__counters_max), then
 * MOK_COUNTER_EXTRA_SLOTS more: each role's ticket (MOK_COUNTER_SLOT_TICKET + enum mok_role,
 * which its workers take their spans by) and the abort word (MOK_COUNTER_SLOT_ABORT: set when the
 * rank's pass stops early, so that peers waiting on its counters stop too); the rest is unused.
 * The cuda backend's block has them; the cpu backend's has the counters only (its workers keep
 * the tickets and the abort apart: cpu_rank.cursor, cpu_rank.abort and the region's `failed`). */
#define MOK_COUNTER_SLOT_TICKET 0
#define MOK_COUNTER_SLOT_ABORT 2
#define MOK_COUNTER_EXTRA_SLOTS 8

/* Byte offsets in a symmetric region; a part a backend does not have is empty (its offset is
 * the next part's), except the schedule's, the counters' and the rings' without the spec's
 * `rings`: their offsets are 0 (they are not in the region). */
typedef struct mok_region_layout {
    /* cuda: the barrier (barrier.cu) and the workspace's creation */
    size_t flags;    /* u64 [MOK_MAX_RANKS]: barrier epoch written by each peer */
    size_t calls;    /* u64 [call slots][MOK_MAX_RANKS]: the call word of each peer's latest barriers,
                        by the epoch */
    size_t blob;     /* the rank's shape and config, read by the peers once, at workspace creation */
    /* both: what the schedule build, the dispatch and the combines read and write */
    size_t tokens;   /* i64: this rank's T for the current pass */
    size_t x;        /* bf16 [T_max, H]: this rank's x; peers pull from it. With x_codes: its E4M3
                        codes [T_max, H], quantized once when the pass stages x */
    size_t x_scale;  /* with x_codes: f32 [T_max, H / MOK_FP8_BLOCK], the scales of x's codes */
    size_t router_w; /* f32 [T_max * k] */
    size_t ids;      /* i32 [T_max * k]: read by peers' schedule builds */
    size_t comb;     /* bf16 [T_max * k, H]: expert outputs pushed in by their owners */
    size_t dy;       /* bf16 [T_max, H] */
    size_t dxbuf;    /* bf16 [T_max * k, H]: routed dx parts pushed in by the experts' owners */
    size_t drw;      /* f32 [T_max * k]: router-weight gradients pushed in likewise */
    /* With the region spec's `rings`: what peers reach when a transfer runs in other than its
       default direction (core/tasks.h), the pass's copy of the schedule, the counters and the
       rings. `turned`: the config turns a transfer (mok__config_turned). */
    int turned;
    size_t sched;    /* the rank's schedule as the pass runs it */
    size_t counters; /* 64-bit [the spec's counters]: the rank's counter block */
    size_t ring_x;   /* bf16 [ring, H]: routed x rows; with x_codes E4M3 [ring, H] */
    size_t ring_x_scale; /* with x_codes: f32 [ring, H / MOK_FP8_BLOCK] */
    size_t ring_y;   /* bf16 [ring, H]: expert outputs (forward), dx parts (backward) */
    size_t ring_dy;  /* bf16 [ring, H]: routed dy rows */
    size_t ring_dyw; /* with the spec's ring_dyw: bf16 [ring, H], the rows' bf16(w * dy) */
    size_t ring_w;   /* f32 [ring]: the rows' router weights */
    size_t ring_rdot; /* f32 [ring, rdot_cols]: partial router-weight gradients */
    /* cpu */
    size_t failed;   /* i32: set when this rank's pass stops early; peers waiting on it stop too */
    size_t bytes;
} mok_region_layout;

/* What a backend puts in its region besides the parts both have, and how it aligns them. */
typedef struct mok_region_spec {
    size_t align;             /* every part starts at a multiple of it (a power of two) */
    size_t flags_bytes, calls_bytes, blob_bytes; /* the barrier's and creation's parts; 0: none */
    int x_codes;              /* x and ring_x hold E4M3 codes, with scales (the cpu backend's FP8) */
    int rings;                /* the schedule, counters and rings are in the region */
    int ring_dyw;             /* the ring of bf16(w * dy) rows is in the region with the others */
    int64_t rdot_cols;        /* ring_rdot's columns: I / the backend's gate/up tile width */
    int64_t counters;         /* 64-bit words of the counter block */
    int failed;               /* the `failed` word */
} mok_region_spec;

/* The region's layout for a workspace's shape and config, its schedule's bytes
 * (mok_sched_layout.bytes) and the backend's spec. */
void mok__region_layout(mok_region_layout *layout, const mok_shape *shape, const mok_config *config,
                        size_t sched_bytes, const mok_region_spec *spec);

#endif
