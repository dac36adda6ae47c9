/* workspace.c — the cpu backend's memory: every rank's symmetric region (registered in the
 * domain's table so peers can reach it), its ring, the shared expert's buffers, the task list
 * and counters of a pass, and the workers' scratch. All of it is allocated here, once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"

static size_t align64(size_t v) { return (v + 63u) & ~(size_t)63u; }

/* The symmetric region (core/layout.h): every part 64-byte aligned, the rings, counters and schedule
 * always in it, FP8's x as E4M3 codes with their scales, and the `failed` word. */
static void sym_layout(mok_region_layout *L, const mok_workspace *ws, const cpu_workspace *cw) {
    const mok_plan worst = mok__plan_worst(&cw->plan);
    const mok_region_spec spec = {
        .align = 64,
        .x_codes = ws->shape.precision == MOK_PRECISION_FP8,
        .rings = 1,
        .rdot_cols = ws->shape.intermediate / CPU_N_TILE,
        .counters = mok__counters_max(&worst, ws->sched_layout.max_rows, ws->shape.max_tokens),
        .failed = 1,
    };
    mok__region_layout(L, &ws->shape, &ws->config, ws->sched_layout.bytes, &spec);
}

static void *alloc_bytes(size_t bytes, size_t *total) {
    *total += align64(bytes);
    return aligned_alloc(64, align64(bytes ? bytes : 64));
}

static void rank_free(cpu_rank *R) {
    free(R->region); /* ring_x, ring_y, ring_dy, ring_w, ring_rdot and the counters live in it */
    free(R->ring_h);
    free(R->ring_dgu);
    free(R->sh_h); free(R->sh_out); free(R->sh_dgu);
    free(R->carry); free(R->tasks); free(R->scratch); free(R->trace);
    free(R->threads); free(R->jobs);
    memset(R, 0, sizeof *R);
}

static mok_status rank_alloc(mok_workspace *ws, cpu_workspace *cw, cpu_rank *R, size_t *total) {
    const mok_shape *s = &ws->shape;
    const size_t ring = (size_t)ws->config.ring_rows, H = (size_t)s->hidden, I = (size_t)s->intermediate;
    const size_t Is = (size_t)s->shared_intermediate, T = (size_t)s->max_tokens;
    const int64_t max_rows = ws->sched_layout.max_rows;

    const mok_plan worst = mok__plan_worst(&cw->plan);
    R->tasks_cap = mok__tasks_max(&worst, max_rows, s->max_tokens);
    R->counters_cap = mok__counters_max(&worst, max_rows, s->max_tokens);
    int64_t max_macro = (max_rows + ws->config.ring_rows - 1) / ws->config.ring_rows;
    R->carry_slots = max_macro > 1 ? max_macro - 1 : 0;
    size_t kmax = H > I ? H : I;
    if (2 * I > kmax) kmax = 2 * I;
    if (2 * Is > kmax) kmax = 2 * Is;
    R->scratch_floats = (size_t)MOK_ROW_TILE * kmax + 2 * kmax * CPU_N_TILE + 3 * (size_t)MOK_ROW_TILE * CPU_N_TILE +
                        (size_t)CPU_WGRAD_TILE * CPU_WGRAD_TILE + 64;

    R->region = alloc_bytes(cw->sym.bytes, total);
    R->ring_h = alloc_bytes(ring * I * 2, total);
    R->ring_dgu = alloc_bytes(ring * 2 * I * 2, total);
    R->sh_h = alloc_bytes(T * Is * 2, total);
    R->sh_out = alloc_bytes(T * H * 2, total);
    R->sh_dgu = alloc_bytes(T * 2 * Is * 2, total);
    R->carry = alloc_bytes((size_t)R->carry_slots * 3 * I * H * 4, total);
    R->tasks = alloc_bytes((size_t)R->tasks_cap * sizeof(mok_task), total);
    R->scratch = alloc_bytes((size_t)cw->workers * R->scratch_floats * 4, total);
    R->threads = alloc_bytes((size_t)cw->workers * sizeof(pthread_t), total);
    R->jobs = alloc_bytes((size_t)cw->workers * sizeof(cpu_worker), total);
    if (ws->config.trace) {
        R->trace_cap = R->tasks_cap + 16;
        R->trace = alloc_bytes((size_t)(MOK_TRACE_PASSES * R->trace_cap) * sizeof(mok_trace_event), total);
    }
    if (!R->region || !R->ring_h || !R->ring_dgu ||
        !R->sh_h || !R->sh_out || !R->sh_dgu || !R->carry || !R->tasks || !R->scratch || !R->threads || !R->jobs ||
        (ws->config.trace && !R->trace)) {
        rank_free(R);
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory (%zu bytes per rank)", *total);
    }
    memset(R->region, 0, cw->sym.bytes);
    R->ring_y = (uint16_t *)(R->region + cw->sym.ring_y);
    R->counters = (_Atomic int64_t *)(R->region + cw->sym.counters);
    R->ring_rdot = (float *)(R->region + cw->sym.ring_rdot);
    const int fp8 = ws->shape.precision == MOK_PRECISION_FP8;
    R->ring_x = fp8 ? NULL : (uint16_t *)(R->region + cw->sym.ring_x);
    R->ring_x8 = fp8 ? (uint8_t *)(R->region + cw->sym.ring_x) : NULL;
    R->ring_x_scale = fp8 ? (float *)(R->region + cw->sym.ring_x_scale) : NULL;
    R->ring_dy = (uint16_t *)(R->region + cw->sym.ring_dy);
    R->ring_w = (float *)(R->region + cw->sym.ring_w);
    return MOK_OK;
}

static int shapes_equal(const mok_shape *a, const mok_shape *b) {
    return a->hidden == b->hidden && a->intermediate == b->intermediate && a->num_experts == b->num_experts &&
           a->topk == b->topk && a->shared_intermediate == b->shared_intermediate && a->max_tokens == b->max_tokens &&
           a->precision == b->precision;
}

/* Every rank's shape and protocol config (config.c's NOTE) against this rank's: 0, or the status
 * whose message names the first rank and field that differ. Every rank reads the same table, so
 * every rank decides alike. */
static mok_status compare_ranks(const mok_workspace *ws, const cpu_domain *d, const cpu_rank *R) {
    for (int p = 0; p < ws->group->nranks; ++p) {
        const mok_shape *o = &d->shapes[R->slot][p];
        if (!shapes_equal(o, &ws->shape))
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "shape: rank %d's shape (H %lld, I %lld, E %lld, k %lld, I_s %lld, T_max %lld) "
                             "differs from rank %d's (H %lld, I %lld, E %lld, k %lld, I_s %lld, T_max %lld)",
                             R->rank, (long long)ws->shape.hidden, (long long)ws->shape.intermediate,
                             (long long)ws->shape.num_experts, (long long)ws->shape.topk,
                             (long long)ws->shape.shared_intermediate, (long long)ws->shape.max_tokens, p,
                             (long long)o->hidden, (long long)o->intermediate, (long long)o->num_experts,
                             (long long)o->topk, (long long)o->shared_intermediate, (long long)o->max_tokens);
        char diff[256];
        if (mok__config_protocol_diff(&ws->config, &d->configs[R->slot][p], p, diff, sizeof diff))
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "%s (rank %d); every rank's workspace needs the same minibatch_rows, ring_rows, "
                             "context_rows, swiglu_limit and transfer directions",
                             diff, R->rank);
    }
    return MOK_OK;
}

mok_status mok__cpu_workspace_create(mok_workspace *ws) {
    mok_group *g = ws->group;
    cpu_group *cg = g->impl;
    cpu_domain *d = cg->domain;
    cpu_workspace *cw = calloc(1, sizeof *cw);
    if (!cw) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    const mok_plan_tiles tiles = {.n_tile = CPU_N_TILE, .n_tile_h = CPU_N_TILE, .wgrad_tile = CPU_WGRAD_TILE};
    cw->plan = mok__plan_workspace(ws, tiles);
    sym_layout(&cw->sym, ws, cw);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    /* Auto: every core computes; the movers come on top (they sleep in memcpy-sized bursts). */
    cw->workers = ws->config.cpu_threads ? ws->config.cpu_threads
                                         : (int)(cores < 1 ? 1 : cores) + ws->config.cpu_comm_threads;
    cw->comm_workers = ws->config.cpu_comm_threads < cw->workers ? ws->config.cpu_comm_threads : cw->workers - 1;
    cw->num_local = g->num_local_ranks;
    cw->ranks = calloc((size_t)cw->num_local, sizeof(cpu_rank));
    if (!cw->ranks) {
        free(cw);
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    }
    ws->impl = cw;
    size_t total = 0;
    mok_status st = MOK_OK;
    for (int lr = 0; lr < cw->num_local && st == MOK_OK; ++lr) {
        size_t mine = 0;
        st = rank_alloc(ws, cw, &cw->ranks[lr], &mine);
        total = mine;
        cpu_rank *R = &cw->ranks[lr];
        R->rank = g->first_rank + lr;
        /* NOTE: a slot is reused by the workspace CPU_MAX_WORKSPACES creations later; the table is
           read only here, after the creation barrier, and that later creation cannot begin on any
           rank before every rank has passed this one's barrier. */
        R->slot = (int)(ws->index % CPU_MAX_WORKSPACES);
        if (st == MOK_OK) {
            d->shapes[R->slot][R->rank] = ws->shape;
            d->configs[R->slot][R->rank] = ws->config;
            atomic_store(&d->regions[R->slot][R->rank], R->region);
        }
    }
    ws->sizes.symmetric_bytes = cw->sym.bytes;
    ws->sizes.workspace_bytes = total;
    /* Collective: every rank registers its region, then everyone reads the table. In local mode
       all ranks registered above, in one thread, and no barrier is needed. */
    if (g->num_local_ranks == 1 && g->nranks > 1) {
        char message[1024] = "";
        if (st != MOK_OK) snprintf(message, sizeof message, "%s", mok_last_error());
        const mok_call call = {MOK_CALL_WORKSPACE_CREATE, 0, ws->index, 0, 0, 0};
        mok_status bst = mok__cpu_barrier(g, 0, &call, st == MOK_OK);
        st = st != MOK_OK ? mok__cpu_settle(st, message, bst) : bst;
    }
    for (int lr = 0; lr < cw->num_local && st == MOK_OK; ++lr) {
        cpu_rank *R = &cw->ranks[lr];
        st = compare_ranks(ws, d, R);
        for (int p = 0; p < g->nranks && st == MOK_OK; ++p) R->peers[p] = atomic_load(&d->regions[R->slot][p]);
    }
    if (st != MOK_OK) {
        /* No peer got this rank's region (they read it only when every rank agrees): freeing is safe. */
        for (int lr = 0; lr < cw->num_local; ++lr) rank_free(&cw->ranks[lr]);
        free(cw->ranks);
        free(cw);
        ws->impl = NULL;
    }
    return st;
}

/* Per-rank mode: a barrier whose call every rank agrees on (each destroys this workspace), after
 * which no peer touches this rank's region again: it is freed. If the group is poisoned, or this
 * barrier fails (a peer timed out, or is in another call), a peer may still be inside a pass that
 * touches the region: it is kept until the group's last handle goes (cpu.h's NOTE), and the group
 * is poisoned so that the peers' next calls fail at once. In local mode every rank's thread has
 * returned before any call returns: nothing touches the regions. */
mok_status mok__cpu_workspace_destroy(mok_workspace *ws) {
    cpu_workspace *cw = ws->impl;
    if (!cw) return MOK_OK;
    mok_group *g = ws->group;
    const int per_rank = g->num_local_ranks == 1 && g->nranks > 1;
    mok_status st = MOK_OK;
    if (per_rank && !mok__cpu_poisoned(g)) {
        const mok_call call = {MOK_CALL_WORKSPACE_DESTROY, 0, ws->index, 0, ws->digest, 0};
        st = mok__cpu_barrier(g, 0, &call, 1);
        if (st != MOK_OK && !mok__cpu_poisoned(g)) mok__cpu_poison(g, g->first_rank, CPU_POISON_DESTROY);
        if (st == MOK_ERR_STATE) st = MOK_OK; /* poisoned by a peer before: the rule below, not an error */
    }
    const int keep = per_rank && mok__cpu_poisoned(g);
    for (int lr = 0; lr < cw->num_local; ++lr) {
        if (keep) {
            mok__cpu_bury(g, cw->ranks[lr].region);
            cw->ranks[lr].region = NULL;
        }
        rank_free(&cw->ranks[lr]);
    }
    free(cw->ranks);
    free(cw);
    ws->impl = NULL;
    return st;
}

/* ---- memory for callers: plain host memory ------------------------------------------------ */
mok_status mok__cpu_memory_alloc(mok_group *g, int local_rank, size_t bytes, void **ptr) {
    (void)g;
    (void)local_rank;
    *ptr = aligned_alloc(64, align64(bytes ? bytes : 64));
    if (!*ptr) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "bytes: %zu of host memory are not available", bytes);
    return MOK_OK;
}

mok_status mok__cpu_memory_free(mok_group *g, int local_rank, void *ptr) {
    (void)g;
    (void)local_rank;
    free(ptr);
    return MOK_OK;
}

mok_status mok__cpu_memory_copy(mok_group *g, int local_rank, void *dst, const void *src, size_t bytes,
                                mok_copy_kind kind) {
    (void)g;
    (void)local_rank;
    (void)kind;
    memmove(dst, src, bytes);
    return MOK_OK;
}

mok_status mok__cpu_synchronize(mok_workspace *ws) {
    return ws->failed ? mok__fail(MOK_ERR_STATE, "workspace: unusable after an earlier timeout") : MOK_OK;
}
