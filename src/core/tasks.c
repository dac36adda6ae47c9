/* tasks.c — builds the task list of a pass (see tasks.h) as groups in one global order. The
 * order interleaves the comm role's transfers with the compute role's tiles so that dispatch
 * runs up to MOK_LOOKAHEAD_MINIBATCHES ahead, bounded by the ring: a ring slot is refilled only
 * after the last reader of its previous occupant (combine in the forward; push and the
 * macrobatch's weight gradients in the backward). */
#include "tasks.h"

#include "mok.h"

static MOK_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

MOK_CORE int mok__plan_names_peers(const mok_plan *plan) {
    return plan->combine_pull || plan->dispatch_pull || plan->dispatch_push || plan->combine_push;
}

MOK_CORE int mok__comm_workers(const mok_plan *plan, int balanced, int max, int64_t own_rows, int64_t routed_rows) {
    const double S = (double)own_rows, R = (double)routed_rows;
    if (!mok__plan_names_peers(plan) || S <= 0 || R <= 0) return balanced;
    double moved, even;
    if (plan->recompute) {
        moved = R;
        even = S;
    } else if (plan->backward) {
        moved = 2 * (plan->combine_push ? S : R) + (plan->dispatch_pull ? S : R);
        even = 3 * S;
    } else {
        moved = (plan->dispatch_push ? S : R) + (plan->combine_pull ? S : R);
        even = 2 * S;
    }
    const double I = (double)plan->intermediate, shared = (double)plan->num_tokens * plan->shared_intermediate;
    const int n = (int)(balanced * (moved / even) * (S * I + shared) / (R * I + shared) + 0.5);
    return n < 1 ? 1 : n > max ? max : n;
}

MOK_CORE int mok__comm_ctas(int64_t intermediate, int64_t shared_intermediate, int topk, int nranks, int backward,
                           int direct, int num_sms) {
    const int64_t i_eff = intermediate + (topk > 0 ? shared_intermediate / topk : 0);
    /* the one-rank backward moves more per FLOP than the by-bytes term says (pull brings dy and
       x rows in, push takes dx rows out, and its dh / dx tasks are shorter than the forward's);
       a direct one-rank pass moves rows one way only */
    direct = direct && nranks == 1;
    const int64_t bytes_term = direct ? (backward ? 12288 : 6144) : nranks == 1 && backward ? 15360 : 12288;
    int comm = i_eff > 0 ? (int)ceil_div(bytes_term, i_eff) : 1;
    const int floor = direct ? (backward ? 8 : 4) : nranks == 1 ? (backward ? 12 : 8) : backward ? 16 : 10;
    if (comm < floor) comm = floor;
    const int cap = num_sms / 4 > 1 ? num_sms / 4 : 1;
    if (comm > cap) comm = cap;
    return comm < num_sms - 1 ? comm : num_sms - 1 > 1 ? num_sms - 1 : 1;
}

MOK_CORE int mok__raster(int64_t hidden) { return hidden >= 6144 ? 8 : 1; }

/* The rows the counter blocks are sized for: the rank's own, or with a pulled transfer the most
 * of any rank, so that the blocks peers address (down_tile, combined, dx_tile, pushed: every
 * block before the two token-tile blocks, which come last) sit at the same offsets on every
 * rank. */
static MOK_HD int64_t layout_rows(const mok_plan *plan) {
    int64_t rows = plan->padded_rows;
    if (mok__plan_names_peers(plan) && plan->peer_padded_rows) /* a worst-case plan has none: its own rows bound all */
        for (int r = 0; r < plan->nranks; ++r)
            if (plan->peer_padded_rows[r] > rows) rows = plan->peer_padded_rows[r];
    return rows;
}

MOK_CORE void mok__counters_layout(const mok_plan *plan, mok_counters_layout *l) {
    const int64_t rows = layout_rows(plan);
    int64_t nmb = ceil_div(rows, plan->minibatch_rows);
    int64_t nmacro = ceil_div(rows, plan->ring_rows);
    int64_t ntt = ceil_div(plan->num_tokens, MOK_ROW_TILE);
    int64_t off = 0;
    int64_t nrt = ceil_div(rows, MOK_ROW_TILE);
    l->num_minibatches = nmb;
    l->num_macrobatches = nmacro;
    l->num_token_tiles = ntt;
    l->num_row_tiles = nrt;
    l->dispatched = off; off += nmb;
    l->gateup_done = off; off += nmb;
    l->combined = off; off += nmb;
    l->gateup_tile = off; off += nrt;
    l->down_tile = off; off += nrt;
    l->pulled = off; off += nmb;
    l->pushed = off; off += nmb;
    l->dh_tile = off; off += nrt;
    l->dx_tile = off; off += nrt;
    l->wgrad_done = off; off += nmacro;
    l->dh_macro_done = off; off += nmacro;
    l->opened = off; off += nmb;
    l->shared_up_done = off; off += ntt; /* per token tile: last, as its size differs between ranks */
    l->shared_dh_all = off; off += 1;
    l->total = off;
}

MOK_CORE void mok__expert_rows_in(const mok_plan *plan, int e, int64_t m, int64_t *first, int64_t *end) {
    int64_t s = plan->expert_start[e], n = plan->expert_rows[e];
    int64_t lo = m * plan->ring_rows, hi = lo + plan->ring_rows;
    int64_t f = s > lo ? s : lo, t = s + n < hi ? s + n : hi;
    if (t < f) t = f;
    *first = f;
    *end = t;
}

MOK_CORE const char *mok__task_kind_name(int kind) {
    switch (kind) {
    case MOK_TASK_SHARED_UP: return "shared_up";
    case MOK_TASK_SHARED_DOWN: return "shared_down";
    case MOK_TASK_DISPATCH: return "dispatch";
    case MOK_TASK_GATEUP: return "gateup";
    case MOK_TASK_DOWN: return "down";
    case MOK_TASK_COMBINE: return "combine";
    case MOK_TASK_SHARED_DH: return "shared_dh";
    case MOK_TASK_SHARED_DX: return "shared_dx";
    case MOK_TASK_PULL: return "pull";
    case MOK_TASK_DH: return "dh";
    case MOK_TASK_DX: return "dx";
    case MOK_TASK_PUSH: return "push";
    case MOK_TASK_WGRAD: return "wgrad";
    case MOK_TASK_SHARED_WGRAD: return "shared_wgrad";
    case MOK_TASK_WGRAD_ZERO: return "wgrad_zero";
    case MOK_TASK_GATHER: return "gather";
    case MOK_TASK_SCATTER: return "scatter";
    case MOK_TASK_OPEN: return "open";
    }
    return "?";
}

static MOK_HD void wgrad_dims(const mok_plan *p, int matrix, int64_t inter, int64_t *rows, int64_t *cols) {
    int64_t w = p->wgrad_tile, wn = p->wgrad_tile_n ? p->wgrad_tile_n : p->wgrad_tile;
    if (matrix == MOK_WGRAD_DOWN) {
        *rows = ceil_div(p->hidden, w);
        *cols = ceil_div(inter, wn);
    } else {
        *rows = ceil_div(inter, w);
        *cols = ceil_div(p->hidden, wn);
    }
}

MOK_CORE int64_t mok__wgrad_tiles(const mok_plan *p, int64_t inter) {
    int64_t total = 0;
    for (int m = 0; m < 3; ++m) {
        int64_t r, c;
        wgrad_dims(p, m, inter, &r, &c);
        total += r * c;
    }
    return total;
}

MOK_CORE void mok__wgrad_tile(const mok_plan *p, int64_t inter, int64_t t, int *matrix, int64_t *row_tile,
                              int64_t *col_tile) {
    for (int m = 0; m < 3; ++m) {
        int64_t r, c;
        wgrad_dims(p, m, inter, &r, &c);
        if (t < r * c || m == 2) {
            *matrix = m;
            if (p->raster <= 1) {
                *row_tile = t / c;
                *col_tile = t % c;
                return;
            }
            /* rows of tiles in runs of `raster`, as mok__group_tile walks row tiles */
            const int64_t run = t / ((int64_t)p->raster * c), in = t % ((int64_t)p->raster * c);
            const int64_t left = r - run * p->raster, rows = left < p->raster ? left : p->raster;
            *row_tile = run * p->raster + in % rows;
            *col_tile = in / rows;
            return;
        }
        t -= r * c;
    }
}

/* The emitter writes groups, or expands them into tasks, in emission order. */
typedef struct emitter {
    const mok_plan *plan;
    mok_task_group *groups;
    mok_task *tasks;
    int64_t cap, count;
} emitter;

/* A group whose waits and bumps may be on a peer's counters (wait[0] and done[0] only). */
static MOK_HD void emit_peer(emitter *em, int kind, int role, int64_t minibatch, int64_t first_tile,
                             int64_t num_tiles, int64_t n_tiles, int64_t done0, int done_per_tile, int64_t done1,
                             int64_t wait0, int64_t target0, int wait_per_tile, int64_t wait1, int64_t target1,
                             int peer, int wait_peer, int done_peer) {
    mok_task_group g;
    g.kind = (int16_t)kind;
    g.role = (int16_t)role;
    g.minibatch = (int32_t)minibatch;
    g.first_tile = (int32_t)first_tile;
    g.num_tiles = (int32_t)num_tiles;
    g.n_tiles = (int32_t)n_tiles;
    g.wait[0] = (int32_t)wait0;
    g.target[0] = (int32_t)target0;
    g.wait[1] = (int32_t)wait1;
    g.target[1] = (int32_t)target1;
    g.done[0] = (int32_t)done0;
    g.done[1] = (int32_t)done1;
    g.wait_per_tile = (int8_t)wait_per_tile;
    g.done_per_tile = (int8_t)done_per_tile;
    g.peer = (int8_t)peer;
    g.wait_peer = (int8_t)wait_peer;
    g.done_peer = (int8_t)done_peer;
    g.reserved = 0;
    /* runs only pay for GEMMs with several sub-tiles per tile (compute role, not weight gradients) */
    g.raster = (int16_t)(role == MOK_ROLE_COMPUTE && n_tiles > 1 && num_tiles > 1 && kind != MOK_TASK_WGRAD &&
                                 kind != MOK_TASK_SHARED_WGRAD && em->plan->raster > 1
                             ? em->plan->raster
                             : 0);
    if (num_tiles * n_tiles == 0) return;
    if (em->groups) {
        if (em->count < em->cap) em->groups[em->count] = g;
        em->count++;
        return;
    }
    for (int64_t t = 0; t < num_tiles * n_tiles; ++t, ++em->count)
        if (em->count < em->cap) mok__group_task(em->plan, &g, t, &em->tasks[em->count]);
}

/* A group on this rank's counters only. */
static MOK_HD void emit(emitter *em, int kind, int role, int64_t minibatch, int64_t first_tile, int64_t num_tiles,
                        int64_t n_tiles, int64_t done0, int done_per_tile, int64_t done1, int64_t wait0,
                        int64_t target0, int wait_per_tile, int64_t wait1, int64_t target1) {
    emit_peer(em, kind, role, minibatch, first_tile, num_tiles, n_tiles, done0, done_per_tile, done1, wait0, target0,
              wait_per_tile, wait1, target1, -1, -1, -1);
}

MOK_CORE void mok__group_task(const mok_plan *plan, const mok_task_group *g, int64_t t, mok_task *task) {
    int64_t tile, sub;
    mok__group_tile(g, t, &tile, &sub);
    task->kind = g->kind;
    task->role = g->role;
    task->minibatch = g->minibatch;
    task->a = (int32_t)tile;
    task->b = (int32_t)sub;
    task->expert = -1;
    task->matrix = -1;
    if (g->kind == MOK_TASK_WGRAD || g->kind == MOK_TASK_SHARED_WGRAD) {
        int m;
        int64_t i, j;
        mok__wgrad_tile(plan, g->kind == MOK_TASK_WGRAD ? plan->intermediate : plan->shared_intermediate, sub, &m, &i,
                        &j);
        task->matrix = m;
        task->a = (int32_t)i;
        task->b = (int32_t)j;
        if (g->kind == MOK_TASK_WGRAD) task->expert = (int32_t)tile;
    } else if (g->kind == MOK_TASK_WGRAD_ZERO) {
        task->expert = (int32_t)tile;
        task->a = task->b = -1;
    }
    task->wait[0] = g->wait[0] < 0 ? -1 : g->wait[0] + (g->wait_per_tile ? (int32_t)(tile - g->first_tile) : 0);
    task->target[0] = g->target[0];
    task->wait[1] = g->wait[1];
    task->target[1] = g->target[1];
    task->done[0] = g->done[0] < 0 ? -1 : g->done[0] + (g->done_per_tile ? (int32_t)(tile - g->first_tile) : 0);
    task->done[1] = g->done[1];
    task->peer = g->peer;
    task->wait_peer = g->wait_peer;
    task->done_peer = g->done_peer;
}

/* Row tiles [first, end) of minibatch b. */
static MOK_HD void mb_tiles(const mok_plan *p, int64_t rows, int64_t b, int64_t *first, int64_t *end) {
    int64_t lo = b * p->minibatch_rows, hi = lo + p->minibatch_rows;
    if (hi > rows) hi = rows;
    *first = lo / MOK_ROW_TILE;
    *end = hi / MOK_ROW_TILE;
}

/* Rank r's row tiles [first, end) of minibatch b (lists that name peers); 0 when r has no
 * minibatch b. */
static MOK_HD int peer_mb_tiles(const mok_plan *p, int r, int64_t b, int64_t *first, int64_t *end) {
    const int64_t rows = p->peer_padded_rows[r];
    if (b >= ceil_div(rows, p->minibatch_rows)) return 0;
    mb_tiles(p, rows, b, first, end);
    return 1;
}

static MOK_HD int64_t lookahead(const mok_plan *p) {
    int64_t ring_mbs = p->ring_rows / p->minibatch_rows;
    return ring_mbs - 1 < MOK_LOOKAHEAD_MINIBATCHES ? ring_mbs - 1 : MOK_LOOKAHEAD_MINIBATCHES;
}

static MOK_HD void build_forward(const mok_plan *p, const mok_counters_layout *L, emitter *em) {
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile, ntt = L->num_token_tiles;
    if (p->shared_intermediate > 0) {
        emit(em, MOK_TASK_SHARED_UP, MOK_ROLE_COMPUTE, -1, 0, ntt, nIs, L->shared_up_done, 1, -1, -1, 0, 0, -1, 0);
        if (!p->recompute)
            emit(em, MOK_TASK_SHARED_DOWN, MOK_ROLE_COMPUTE, -1, 0, ntt, nH, -1, 0, -1, L->shared_up_done, nIs, 1, -1,
                 0);
    }
    /* recompute only needs the rows the context keeps */
    int64_t rows = p->padded_rows;
    if (p->recompute && p->context_rows < rows) rows = p->context_rows;
    const int64_t nmb = ceil_div(rows, p->minibatch_rows);
    const int64_t ring_mbs = p->ring_rows / p->minibatch_rows, ahead = lookahead(p);
    /* combine_pull: a ring slot is free once every rank has gathered from its tile, and the
       list runs over the minibatches of every rank (it gathers from peers with more) */
    const int pull = p->combine_pull && !p->recompute, push = p->dispatch_push && !p->recompute;
    const int64_t gatherers = pull ? p->nranks : 1, senders = push ? p->nranks : 1;
    const int64_t nmb_all = pull || push ? ceil_div(layout_rows(p), p->minibatch_rows) : nmb;
    /* lag: a minibatch's down tiles (and its combine or gathers) come after the next minibatch's
       gate/up tiles in the order, so that the compute CTAs that take them find their row tiles'
       gate/up done instead of waiting for them (the idle before the down tiles of a minibatch that
       the CTAs take at once). A dispatch that refills a ring slot then waits for a combine
       emitted one minibatch later: it needs a ring of two minibatches or more. */
    const int64_t lag = !p->recompute && ring_mbs >= 2 ? 1 : 0;
    int64_t next = 0;
    for (int64_t b = 0; b < nmb_all + lag; ++b) {
        /* dispatch_push: this rank's rows into every rank's tiles of the minibatches in reach,
           each after the slot's previous occupant was combined on that rank */
        while (push && next < nmb_all && next <= b + ahead && next - ring_mbs <= b - 1 - lag) {
            for (int r = 0; r < p->nranks; ++r) {
                int64_t t0, t1, wait = -1, target = 0;
                if (!peer_mb_tiles(p, r, next, &t0, &t1)) continue;
                if (next >= ring_mbs) {
                    int64_t q0 = 0, q1 = 0; /* r has minibatch next, so it has this earlier one */
                    peer_mb_tiles(p, r, next - ring_mbs, &q0, &q1);
                    wait = L->combined + next - ring_mbs;
                    target = (q1 - q0) * gatherers;
                }
                emit_peer(em, MOK_TASK_SCATTER, MOK_ROLE_COMM, next, t0, t1 - t0, 1, L->dispatched + next, 0, -1, wait,
                          target, 0, -1, 0, r, r, r);
            }
            ++next;
        }
        while (!push && next < nmb && next <= b + ahead && next - ring_mbs <= b - 1 - lag) {
            int64_t t0, t1, wait = -1, target = 0;
            mb_tiles(p, rows, next, &t0, &t1);
            if (next >= ring_mbs) {
                int64_t prev = next - ring_mbs, q0, q1;
                mb_tiles(p, rows, prev, &q0, &q1);
                wait = p->recompute ? L->gateup_done + prev : L->combined + prev;
                target = p->recompute ? (q1 - q0) * nI : (q1 - q0) * gatherers;
            }
            emit(em, MOK_TASK_DISPATCH, MOK_ROLE_COMM, next, t0, t1 - t0, 1, L->dispatched + next, 0, -1, wait, target,
                 0, -1, 0);
            ++next;
        }
        if (b < nmb) {
            int64_t t0, t1;
            mb_tiles(p, rows, b, &t0, &t1);
            const int64_t tiles = t1 - t0;
            /* gate/up bumps its row tile's counter (down waits on it) and the minibatch's (a
               recompute pass refills the ring slot after it) */
            emit(em, MOK_TASK_GATEUP, MOK_ROLE_COMPUTE, b, t0, tiles, nI, L->gateup_tile + t0, 1, L->gateup_done + b,
                 L->dispatched + b, tiles * senders, 0, -1, 0);
        }
        const int64_t d = b - lag; /* the minibatch whose down tiles and combine follow */
        if (p->recompute || d < 0) continue;
        if (d < nmb) {
            int64_t t0, t1;
            mb_tiles(p, rows, d, &t0, &t1);
            const int64_t tiles = t1 - t0;
            /* down and combine hand over per row tile */
            emit(em, MOK_TASK_DOWN, MOK_ROLE_COMPUTE, d, t0, tiles, nH, L->down_tile + t0, 1, -1, L->gateup_tile + t0,
                 nI, 1, -1, 0);
            if (!pull)
                emit(em, MOK_TASK_COMBINE, MOK_ROLE_COMM, d, t0, tiles, 1, L->combined + d, 0, -1, L->down_tile + t0, nH,
                     1, -1, 0);
        }
        /* each rank's row tiles of minibatch d, in rank order: the counter offsets are the same
           on every rank (mok__counters_layout) */
        for (int r = 0; pull && r < p->nranks; ++r) {
            int64_t t0, t1;
            if (!peer_mb_tiles(p, r, d, &t0, &t1)) continue;
            emit_peer(em, MOK_TASK_GATHER, MOK_ROLE_COMM, d, t0, t1 - t0, 1, L->combined + d, 0, -1, L->down_tile + t0,
                      nH, 1, -1, 0, r, r, r);
        }
    }
}

/* The experts with rows in macrobatch m form one run [*lo, *hi) of expert indices (their segments
 * are laid out in expert order, so segment ends never decrease): *lo only moves forward, so calls
 * with non-decreasing m walk the experts once in all. The run may hold experts with no rows. */
static MOK_HD void experts_in(const mok_plan *p, int64_t m, int *lo, int *hi) {
    const int64_t first = m * p->ring_rows, end = first + p->ring_rows;
    while (*lo < p->num_local_experts && p->expert_start[*lo] + p->expert_rows[*lo] <= first) ++*lo;
    *hi = *lo;
    while (*hi < p->num_local_experts && p->expert_start[*hi] < end) ++*hi;
}

/* Weight-gradient tasks of macrobatch m (experts with rows in it), for non-decreasing m. */
static MOK_HD int64_t wgrad_tasks_in(const mok_plan *p, int64_t m, int *lo) {
    int hi, n = 0;
    experts_in(p, m, lo, &hi);
    for (int e = *lo; e < hi; ++e) {
        int64_t f, t;
        mok__expert_rows_in(p, e, m, &f, &t);
        n += t > f;
    }
    return n * mok__wgrad_tiles(p, p->intermediate);
}

static MOK_HD int64_t dh_tasks_in(const mok_plan *p, int64_t m) {
    int64_t lo = m * p->ring_rows, hi = lo + p->ring_rows;
    if (hi > p->padded_rows) hi = p->padded_rows;
    return (hi - lo) / MOK_ROW_TILE * (p->intermediate / p->n_tile);
}

/* A minibatch's dx tiles and, unless its dx parts are gathered by their owners, its push. */
static MOK_HD void emit_dx(const mok_plan *p, const mok_counters_layout *L, emitter *em, int64_t b, int64_t nI,
                           int64_t nH, int gather) {
    int64_t t0, t1;
    mb_tiles(p, p->padded_rows, b, &t0, &t1);
    const int64_t tiles = t1 - t0;
    emit(em, MOK_TASK_DX, MOK_ROLE_COMPUTE, b, t0, tiles, nH, L->dx_tile + t0, 1, -1, L->dh_tile + t0, nI, 1, -1, 0);
    if (!gather)
        emit(em, MOK_TASK_PUSH, MOK_ROLE_COMM, b, t0, tiles, 1, L->pushed + b, 0, -1, L->dx_tile + t0, nH, 1, -1, 0);
}

static MOK_HD void build_backward(const mok_plan *p, const mok_counters_layout *L, emitter *em) {
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile, ntt = L->num_token_tiles;
    if (p->shared_intermediate > 0) {
        emit(em, MOK_TASK_SHARED_DH, MOK_ROLE_COMPUTE, -1, 0, ntt, nIs, L->shared_up_done, 1, -1, -1, 0, 0, -1, 0);
        emit(em, MOK_TASK_SHARED_DX, MOK_ROLE_COMPUTE, -1, 0, ntt, nH, -1, 0, L->shared_dh_all, L->shared_up_done, nIs,
             1, -1, 0);
    }
    const int64_t rows = p->padded_rows;
    const int64_t nmb = ceil_div(rows, p->minibatch_rows);
    const int64_t ring_mbs = p->ring_rows / p->minibatch_rows, ahead = lookahead(p);
    /* dispatch_pull: a ring slot is refilled once every rank has gathered from its tile, and the
       list runs over the minibatches of every rank (as build_forward's combine_pull) */
    const int gather = p->dispatch_pull, scatter = p->combine_push;
    const int64_t gatherers = gather ? p->nranks : 1, senders = scatter ? p->nranks : 1;
    const int64_t nmb_all = gather || scatter ? ceil_div(layout_rows(p), p->minibatch_rows) : nmb;
    int64_t next = 0, counted_m = -1, counted = 0;
    int pull_lo = 0, wgrad_lo = 0; /* experts_in cursors */
    /* lag: inside a macrobatch, a minibatch's dx tiles (and its push) come after the next
       minibatch's dh tiles in the order, so that the compute CTAs that take them find their row
       tiles' dh done instead of waiting for them; a macrobatch's last minibatch takes its dx tiles
       before the weight gradients. A pull that refills a ring slot then waits for a push emitted
       up to one minibatch later. Not with pulled reverse-dispatch: a rank's gathers of minibatch
       b would wait, ahead of its pulls, for peers' dx tiles that wait for those pulls. */
    const int64_t lag = ring_mbs >= 2 && !gather ? 1 : 0;
    int64_t deferred = -1; /* the minibatch whose dx tiles and push are still to be emitted */
    for (int64_t b = 0; b < nmb_all; ++b) {
        /* A pull into macrobatch M waits for macrobatch M-1's weight gradients, emitted after
           M-1's last minibatch: only pull minibatches whose macrobatch has started. */
        while (next < (scatter ? nmb_all : nmb) && next <= b + ahead && next - ring_mbs <= b - 1 - lag &&
               (next / ring_mbs) * ring_mbs <= b) {
            int64_t t0, t1, w0 = -1, g0 = 0, w1 = -1, g1 = 0;
            mb_tiles(p, rows, next, &t0, &t1);
            if (next >= ring_mbs && next < nmb) {
                int64_t prev = next - ring_mbs, q0, q1, m = next / ring_mbs - 1;
                mb_tiles(p, rows, prev, &q0, &q1);
                w0 = L->pushed + prev;
                g0 = (q1 - q0) * gatherers;
                w1 = L->wgrad_done + m;
                if (m != counted_m) {
                    counted = wgrad_tasks_in(p, m, &pull_lo);
                    counted_m = m;
                }
                g1 = counted;
            }
            if (!scatter) {
                emit(em, MOK_TASK_PULL, MOK_ROLE_COMM, next, t0, t1 - t0, 1, L->pulled + next, 0, -1, w0, g0, 0, w1, g1);
                ++next;
                continue;
            }
            /* combine_push: open this rank's slots of minibatch next (the refill waits a pull would
               have), then write this rank's rows into every rank's tiles of it */
            if (next < nmb)
                emit(em, MOK_TASK_OPEN, MOK_ROLE_COMM, next, 0, 1, 1, L->opened + next, 0, -1, w0, g0, 0, w1, g1);
            for (int r = 0; r < p->nranks; ++r) {
                int64_t s0, s1;
                if (!peer_mb_tiles(p, r, next, &s0, &s1)) continue;
                emit_peer(em, MOK_TASK_SCATTER, MOK_ROLE_COMM, next, s0, s1 - s0, 1, L->pulled + next, 0, -1,
                          L->opened + next, 1, 0, -1, 0, r, r, r);
            }
            ++next;
        }
        for (int r = 0; gather && r < p->nranks; ++r) { /* the peers' tiles of minibatch b (see build_forward) */
            int64_t g0, g1;
            if (!peer_mb_tiles(p, r, b, &g0, &g1)) continue;
            emit_peer(em, MOK_TASK_GATHER, MOK_ROLE_COMM, b, g0, g1 - g0, 1, L->pushed + b, 0, -1, L->dx_tile + g0, nH,
                      1, -1, 0, r, r, r);
        }
        if (b >= nmb) continue;
        int64_t t0, t1, m = b / ring_mbs;
        mb_tiles(p, rows, b, &t0, &t1);
        const int64_t tiles = t1 - t0;
        emit(em, MOK_TASK_DH, MOK_ROLE_COMPUTE, b, t0, tiles, nI, L->dh_tile + t0, 1, L->dh_macro_done + m,
             L->pulled + b, tiles * senders, 0, -1, 0);
        const int last = (b + 1) % ring_mbs == 0 || b == nmb - 1; /* of its macrobatch */
        if (deferred >= 0) emit_dx(p, L, em, deferred, nI, nH, gather);
        deferred = lag && !last ? b : -1;
        if (deferred != b) emit_dx(p, L, em, b, nI, nH, gather);
        if (last) {
            const int64_t per_expert = mok__wgrad_tiles(p, p->intermediate);
            int hi;
            experts_in(p, m, &wgrad_lo, &hi);
            for (int e = wgrad_lo; e < hi; ++e) {
                int64_t f, t;
                mok__expert_rows_in(p, e, m, &f, &t);
                if (t > f)
                    emit(em, MOK_TASK_WGRAD, MOK_ROLE_COMPUTE, m, e, 1, per_expert, L->wgrad_done + m, 0, -1,
                         L->dh_macro_done + m, dh_tasks_in(p, m), 0, -1, 0);
            }
        }
    }
    if (p->shared_intermediate > 0)
        emit(em, MOK_TASK_SHARED_WGRAD, MOK_ROLE_COMPUTE, -1, 0, 1, mok__wgrad_tiles(p, p->shared_intermediate), -1, 0,
             -1, L->shared_dh_all, ntt * nH, 0, -1, 0);
    if (!p->accumulate)
        for (int e = 0; e < p->num_local_experts; ++e)
            if (p->expert_rows[e] == 0)
                emit(em, MOK_TASK_WGRAD_ZERO, MOK_ROLE_COMPUTE, -1, e, 1, 1, -1, 0, -1, -1, 0, 0, -1, 0);
}

static MOK_HD int64_t build(const mok_plan *plan, emitter *em) {
    mok_counters_layout L;
    mok__counters_layout(plan, &L);
    if (plan->backward) build_backward(plan, &L, em);
    else build_forward(plan, &L, em);
    return em->count <= em->cap ? em->count : -1;
}

MOK_CORE int64_t mok__groups_build(const mok_plan *plan, mok_task_group *groups, int64_t cap) {
    emitter em = {plan, groups, 0, cap, 0};
    return build(plan, &em);
}

MOK_CORE int64_t mok__tasks_build(const mok_plan *plan, mok_task *tasks, int64_t cap) {
    emitter em = {plan, 0, tasks, cap, 0};
    return build(plan, &em);
}

MOK_CORE int64_t mok__tasks_max(const mok_plan *p, int64_t max_rows, int64_t max_tokens) {
    int64_t tiles = max_rows / MOK_ROW_TILE;
    int64_t ntt = ceil_div(max_tokens, MOK_ROW_TILE);
    int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h, nIs = p->shared_intermediate / p->n_tile;
    int64_t per_tile = 2 + nI + nH;
    int64_t max_macro = ceil_div(max_rows, p->ring_rows);
    int64_t wg = (p->num_local_experts + max_macro) * mok__wgrad_tiles(p, p->intermediate);
    int64_t shared = ntt * (nIs + nH) + mok__wgrad_tiles(p, p->shared_intermediate);
    int64_t gathers = mok__plan_names_peers(p) ? (int64_t)p->nranks * tiles * 2 + ceil_div(max_rows, p->minibatch_rows) : 0;
    /* gathers and scatters, and the OPEN tasks */
    return tiles * per_tile + wg + shared + p->num_local_experts + gathers;
}

MOK_CORE int64_t mok__groups_max(const mok_plan *p, int64_t max_rows, int64_t max_tokens) {
    (void)max_tokens;
    int64_t nmb = ceil_div(max_rows, p->minibatch_rows);
    int64_t max_macro = ceil_div(max_rows, p->ring_rows);
    /* per minibatch at most 4 groups (forward) or 4 (backward); weight gradients one group per
       (expert, macrobatch it has rows in); the shared expert 3; zeroing one per expert */
    return 4 * nmb + (p->num_local_experts + max_macro) + 3 + p->num_local_experts +
           (mok__plan_names_peers(p) ? (int64_t)(2 * p->nranks + 1) * nmb : 0);
}

MOK_CORE int64_t mok__counters_max(const mok_plan *p, int64_t max_rows, int64_t max_tokens) {
    mok_plan worst = *p;
    worst.padded_rows = max_rows;
    worst.num_tokens = max_tokens;
    worst.peer_padded_rows = 0; /* max_rows bounds every rank's */
    mok_counters_layout L;
    mok__counters_layout(&worst, &L);
    return L.total;
}

#ifndef __CUDACC__
int64_t mok__tasks_check(const mok_task *tasks, int64_t count, int64_t num_counters, int64_t *scratch) {
    /* Replays the list in order with counters that only grow: a wait whose target is not met by
       the tasks before it would wait on a later task (or forever). */
    for (int64_t c = 0; c < num_counters; ++c) scratch[c] = 0;
    for (int64_t i = 0; i < count; ++i) {
        for (int w = 0; w < 2; ++w) {
            int32_t c = tasks[i].wait[w];
            if (c < 0) continue;
            if (c >= num_counters || scratch[c] < tasks[i].target[w]) return i + 1;
        }
        for (int d = 0; d < 2; ++d) {
            int32_t c = tasks[i].done[d];
            if (c >= num_counters) return i + 1;
            if (c >= 0) scratch[c] += 1;
        }
    }
    return 0;
}

/* One worker per (rank, role): the head of each role's subsequence runs when its waits are met.
 * Rounds over all heads until a round makes no progress. */
int64_t mok__tasks_check_ranks(int nranks, const mok_task *const *tasks, const int64_t *counts,
                               const int64_t *num_counters, int64_t *const *counters,
                               void (*on_run)(void *ctx, int rank, int64_t index), void *ctx) {
    int64_t cursor[MOK_MAX_RANKS][2], done = 0;
    for (int r = 0; r < nranks; ++r) {
        cursor[r][0] = cursor[r][1] = 0;
        for (int64_t c = 0; c < num_counters[r]; ++c) counters[r][c] = 0;
    }
    for (int progress = 1; progress;) {
        progress = 0;
        for (int r = 0; r < nranks; ++r)
            for (int role = 0; role < 2; ++role) {
                for (;;) {
                    int64_t *i = &cursor[r][role];
                    while (*i < counts[r] && tasks[r][*i].role != role) ++*i;
                    if (*i >= counts[r]) break;
                    const mok_task *t = &tasks[r][*i];
                    int ready = 1;
                    for (int w = 0; w < 2 && ready; ++w) {
                        if (t->wait[w] < 0) continue;
                        const int q = w == 0 && t->wait_peer >= 0 ? t->wait_peer : r;
                        ready = q < nranks && t->wait[w] < num_counters[q] && counters[q][t->wait[w]] >= t->target[w];
                    }
                    if (!ready) break;
                    if (on_run) on_run(ctx, r, *i);
                    for (int d = 0; d < 2; ++d) {
                        if (t->done[d] < 0) continue;
                        const int q = d == 0 && t->done_peer >= 0 ? t->done_peer : r;
                        if (q < nranks && t->done[d] < num_counters[q]) counters[q][t->done[d]] += 1;
                    }
                    ++*i;
                    ++done;
                    progress = 1;
                }
            }
    }
    return done;
}
#endif
