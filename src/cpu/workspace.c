/* workspace.c — the cpu backend's memory: every rank's symmetric region (registered in the
 * domain's table so peers can reach it), its ring, the shared expert's buffers, the task list
 * and counters of a pass, and the workers' scratch. All of it is allocated here, once. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"

static size_t align64(size_t v) { return (v + 63u) & ~(size_t)63u; }

static mok_plan worst_plan(const mok_workspace *ws) {
    return mok__plan_worst(ws, CPU_N_TILE, CPU_N_TILE, CPU_WGRAD_TILE);
}

static void sym_layout(cpu_sym_layout *L, const mok_workspace *ws) {
    const mok_shape *s = &ws->shape;
    size_t T = (size_t)s->max_tokens, H = (size_t)s->hidden, k = (size_t)s->topk, off = 0;
    const mok_plan worst = worst_plan(ws);
    const size_t counters = (size_t)mok__counters_max(&worst, ws->sched_layout.max_rows, s->max_tokens);
    L->tokens = off; off = align64(off + sizeof(int64_t));
    L->x = off; off = align64(off + T * H * 2);
    L->router_w = off; off = align64(off + T * k * 4);
    L->ids = off; off = align64(off + T * k * 4);
    L->comb = off; off = align64(off + T * k * H * 2);
    L->dy = off; off = align64(off + T * H * 2);
    L->dxbuf = off; off = align64(off + T * k * H * 2);
    L->drw = off; off = align64(off + T * k * 4);
    L->ring_x = off; off = align64(off + (size_t)ws->config.ring_rows * H * 2);
    L->ring_y = off; off = align64(off + (size_t)ws->config.ring_rows * H * 2);
    L->ring_dy = off; off = align64(off + (size_t)ws->config.ring_rows * H * 2);
    L->ring_w = off; off = align64(off + (size_t)ws->config.ring_rows * 4);
    L->ring_rdot = off; off = align64(off + (size_t)ws->config.ring_rows * (size_t)(s->intermediate / CPU_N_TILE) * 4);
    L->counters = off; off = align64(off + counters * sizeof(int64_t));
    L->sched = off; off = align64(off + ws->sched_layout.bytes);
    L->failed = off; off = align64(off + sizeof(int32_t));
    L->bytes = off;
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
    memset(R, 0, sizeof *R);
}

static mok_status rank_alloc(mok_workspace *ws, cpu_workspace *cw, cpu_rank *R, size_t *total) {
    const mok_shape *s = &ws->shape;
    const size_t ring = (size_t)ws->config.ring_rows, H = (size_t)s->hidden, I = (size_t)s->intermediate;
    const size_t Is = (size_t)s->shared_intermediate, T = (size_t)s->max_tokens;
    const int64_t max_rows = ws->sched_layout.max_rows;

    const mok_plan worst = worst_plan(ws);
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
    if (ws->config.trace) {
        R->trace_cap = R->tasks_cap + 16;
        R->trace = alloc_bytes((size_t)(MOK_TRACE_PASSES * R->trace_cap) * sizeof(mok_trace_event), total);
    }
    if (!R->region || !R->ring_h || !R->ring_dgu ||
        !R->sh_h || !R->sh_out || !R->sh_dgu || !R->carry || !R->tasks || !R->scratch ||
        (ws->config.trace && !R->trace)) {
        rank_free(R);
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory (%zu bytes per rank)", *total);
    }
    memset(R->region, 0, cw->sym.bytes);
    R->ring_y = (uint16_t *)(R->region + cw->sym.ring_y);
    R->counters = (_Atomic int64_t *)(R->region + cw->sym.counters);
    R->ring_rdot = (float *)(R->region + cw->sym.ring_rdot);
    R->ring_x = (uint16_t *)(R->region + cw->sym.ring_x);
    R->ring_dy = (uint16_t *)(R->region + cw->sym.ring_dy);
    R->ring_w = (float *)(R->region + cw->sym.ring_w);
    return MOK_OK;
}

static int shapes_equal(const mok_shape *a, const mok_shape *b) {
    return a->hidden == b->hidden && a->intermediate == b->intermediate && a->num_experts == b->num_experts &&
           a->topk == b->topk && a->shared_intermediate == b->shared_intermediate && a->max_tokens == b->max_tokens &&
           a->precision == b->precision;
}

mok_status mok__cpu_workspace_create(mok_workspace *ws) {
    mok_group *g = ws->group;
    cpu_group *cg = g->impl;
    cpu_domain *d = cg->domain;
    cpu_workspace *cw = calloc(1, sizeof *cw);
    if (!cw) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    sym_layout(&cw->sym, ws);
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
        R->slot = cg->workspaces[lr]++ % CPU_MAX_WORKSPACES;
        if (st == MOK_OK) {
            d->shapes[R->slot][R->rank] = ws->shape;
            atomic_store(&d->regions[R->slot][R->rank], R->region);
        }
    }
    ws->sizes.symmetric_bytes = cw->sym.bytes;
    ws->sizes.workspace_bytes = total;
    /* Collective: every rank registers its region, then everyone reads the table. In local mode
       all ranks registered above, in one thread, and no barrier is needed. */
    if (g->num_local_ranks == 1 && g->nranks > 1) {
        mok_status bst = mok__cpu_barrier(g, 0, st == MOK_OK);
        if (st == MOK_OK) st = bst;
    }
    if (st == MOK_OK) {
        for (int lr = 0; lr < cw->num_local; ++lr) {
            cpu_rank *R = &cw->ranks[lr];
            for (int p = 0; p < g->nranks; ++p) {
                if (!shapes_equal(&d->shapes[R->slot][p], &ws->shape)) {
                    const mok_shape *o = &d->shapes[R->slot][p];
                    st = mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                   "shape: rank %d's shape (H %lld, I %lld, E %lld, k %lld, I_s %lld, T_max %lld) "
                                   "differs from rank %d's (H %lld, I %lld, E %lld, k %lld, I_s %lld, T_max %lld)",
                                   R->rank, (long long)ws->shape.hidden, (long long)ws->shape.intermediate,
                                   (long long)ws->shape.num_experts, (long long)ws->shape.topk,
                                   (long long)ws->shape.shared_intermediate, (long long)ws->shape.max_tokens, p,
                                   (long long)o->hidden, (long long)o->intermediate, (long long)o->num_experts,
                                   (long long)o->topk, (long long)o->shared_intermediate, (long long)o->max_tokens);
                    break;
                }
                R->peers[p] = atomic_load(&d->regions[R->slot][p]);
            }
        }
    }
    if (st != MOK_OK) {
        /* Peers may still be reading the table, not the regions: freeing is safe. */
        for (int lr = 0; lr < cw->num_local; ++lr) rank_free(&cw->ranks[lr]);
        free(cw->ranks);
        free(cw);
        ws->impl = NULL;
    }
    return st;
}

void mok__cpu_workspace_destroy(mok_workspace *ws) {
    cpu_workspace *cw = ws->impl;
    if (!cw) return;
    mok_group *g = ws->group;
    /* Peers may still pull from or push into this rank's region until they finish their last
       pass: wait for them (bounded) before freeing. */
    if (g->num_local_ranks == 1 && g->nranks > 1 && !g->failed) (void)mok__cpu_barrier(g, 0, 1);
    for (int lr = 0; lr < cw->num_local; ++lr) rank_free(&cw->ranks[lr]);
    free(cw->ranks);
    free(cw);
    ws->impl = NULL;
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
