/* tasks.c — builds the task list of a pass (see tasks.h). The order interleaves the comm role's
 * transfers with the compute role's tiles so that dispatch runs up to MOK_LOOKAHEAD_MINIBATCHES
 * ahead, bounded by the ring: a ring slot is refilled only after the last reader of its previous
 * occupant (combine in the forward; push and the macrobatch's weight gradients in the backward). */
#include "tasks.h"

#include "mok.h"

static MOK_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

MOK_CORE void mok__counters_layout(const mok_plan *plan, mok_counters_layout *l) {
    int64_t nmb = ceil_div(plan->padded_rows, plan->minibatch_rows);
    int64_t nmacro = ceil_div(plan->padded_rows, plan->ring_rows);
    int64_t ntt = ceil_div(plan->num_tokens, MOK_ROW_TILE);
    int64_t off = 0;
    l->num_minibatches = nmb;
    l->num_macrobatches = nmacro;
    l->num_token_tiles = ntt;
    l->dispatched = off; off += nmb;
    l->gateup_done = off; off += nmb;
    l->down_done = off; off += nmb;
    l->combined = off; off += nmb;
    l->shared_up_done = off; off += ntt;
    l->pulled = off; off += nmb;
    l->dh_done = off; off += nmb;
    l->dx_done = off; off += nmb;
    l->pushed = off; off += nmb;
    l->wgrad_done = off; off += nmacro;
    l->dh_macro_done = off; off += nmacro;
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

typedef struct emitter {
    mok_task *tasks;
    int64_t cap, count;
} emitter;

static MOK_HD void emit(emitter *em, int kind, int role, int64_t minibatch, int64_t a, int64_t b, int64_t expert,
                        int64_t matrix, int64_t done0, int64_t done1, int64_t wait0, int64_t target0, int64_t wait1,
                        int64_t target1) {
    if (em->count < em->cap) {
        mok_task *t = &em->tasks[em->count];
        t->kind = (int16_t)kind;
        t->role = (int16_t)role;
        t->minibatch = (int32_t)minibatch;
        t->a = (int32_t)a;
        t->b = (int32_t)b;
        t->expert = (int32_t)expert;
        t->matrix = (int32_t)matrix;
        t->done[0] = (int32_t)done0;
        t->done[1] = (int32_t)done1;
        t->wait[0] = (int32_t)wait0;
        t->target[0] = (int32_t)target0;
        t->wait[1] = (int32_t)wait1;
        t->target[1] = (int32_t)target1;
    }
    em->count++;
}

/* Row tiles [first, end) of minibatch b. */
static MOK_HD void mb_tiles(const mok_plan *p, int64_t rows, int64_t b, int64_t *first, int64_t *end) {
    int64_t lo = b * p->minibatch_rows, hi = lo + p->minibatch_rows;
    if (hi > rows) hi = rows;
    *first = lo / MOK_ROW_TILE;
    *end = hi / MOK_ROW_TILE;
}

static MOK_HD void wgrad_dims(const mok_plan *p, int matrix, int64_t inter, int64_t *rows, int64_t *cols) {
    int64_t w = p->wgrad_tile;
    if (matrix == MOK_WGRAD_DOWN) {
        *rows = p->hidden / w;
        *cols = inter / w;
    } else {
        *rows = inter / w;
        *cols = p->hidden / w;
    }
}

static MOK_HD int64_t wgrad_tiles_per_expert(const mok_plan *p, int64_t inter) {
    int64_t total = 0;
    for (int m = 0; m < 3; ++m) {
        int64_t r, c;
        wgrad_dims(p, m, inter, &r, &c);
        total += r * c;
    }
    return total;
}

static MOK_HD void build_forward(const mok_plan *p, const mok_counters_layout *L, emitter *em) {
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile;
    if (p->shared_intermediate > 0) {
        for (int64_t mt = 0; mt < L->num_token_tiles; ++mt)
            for (int64_t nt = 0; nt < nIs; ++nt)
                emit(em, MOK_TASK_SHARED_UP, MOK_ROLE_COMPUTE, -1, mt, nt, -1, -1, L->shared_up_done + mt, -1, -1,
                     0, -1, 0);
        if (!p->recompute)
            for (int64_t mt = 0; mt < L->num_token_tiles; ++mt)
                for (int64_t nt = 0; nt < nH; ++nt)
                    emit(em, MOK_TASK_SHARED_DOWN, MOK_ROLE_COMPUTE, -1, mt, nt, -1, -1, -1, -1,
                         L->shared_up_done + mt, nIs, -1, 0);
    }
    /* recompute only needs the rows the context keeps */
    int64_t rows = p->padded_rows;
    if (p->recompute && p->context_rows < rows) rows = p->context_rows;
    const int64_t nmb = ceil_div(rows, p->minibatch_rows);
    const int64_t ring_mbs = p->ring_rows / p->minibatch_rows;
    int64_t ahead = ring_mbs - 1 < MOK_LOOKAHEAD_MINIBATCHES ? ring_mbs - 1 : MOK_LOOKAHEAD_MINIBATCHES;
    int64_t next = 0;
    for (int64_t b = 0; b < nmb; ++b) {
        while (next < nmb && next <= b + ahead && next - ring_mbs <= b - 1) {
            int64_t t0, t1;
            mb_tiles(p, rows, next, &t0, &t1);
            int64_t wait = -1, target = 0;
            if (next >= ring_mbs) {
                int64_t prev = next - ring_mbs, q0, q1;
                mb_tiles(p, rows, prev, &q0, &q1);
                wait = p->recompute ? L->gateup_done + prev : L->combined + prev;
                target = p->recompute ? (q1 - q0) * nI : (q1 - q0);
            }
            for (int64_t rt = t0; rt < t1; ++rt)
                emit(em, MOK_TASK_DISPATCH, MOK_ROLE_COMM, next, rt, -1, -1, -1, L->dispatched + next, -1, wait, target,
                     -1, 0);
            ++next;
        }
        int64_t t0, t1;
        mb_tiles(p, rows, b, &t0, &t1);
        int64_t tiles = t1 - t0;
        for (int64_t rt = t0; rt < t1; ++rt)
            for (int64_t nt = 0; nt < nI; ++nt)
                emit(em, MOK_TASK_GATEUP, MOK_ROLE_COMPUTE, b, rt, nt, -1, -1, L->gateup_done + b, -1,
                     L->dispatched + b, tiles, -1, 0);
        if (p->recompute) continue;
        for (int64_t rt = t0; rt < t1; ++rt)
            for (int64_t nt = 0; nt < nH; ++nt)
                emit(em, MOK_TASK_DOWN, MOK_ROLE_COMPUTE, b, rt, nt, -1, -1, L->down_done + b, -1, L->gateup_done + b,
                     tiles * nI, -1, 0);
        for (int64_t rt = t0; rt < t1; ++rt)
            emit(em, MOK_TASK_COMBINE, MOK_ROLE_COMM, b, rt, -1, -1, -1, L->combined + b, -1, L->down_done + b,
                 tiles * nH, -1, 0);
    }
}

static MOK_HD int64_t wgrad_tasks_in(const mok_plan *p, int64_t m) {
    int64_t n = 0;
    for (int e = 0; e < p->num_local_experts; ++e) {
        int64_t f, t;
        mok__expert_rows_in(p, e, m, &f, &t);
        if (t > f) n += wgrad_tiles_per_expert(p, p->intermediate);
    }
    return n;
}

static MOK_HD int64_t dh_tasks_in(const mok_plan *p, int64_t m) {
    int64_t lo = m * p->ring_rows, hi = lo + p->ring_rows;
    if (hi > p->padded_rows) hi = p->padded_rows;
    return (hi - lo) / MOK_ROW_TILE * (p->intermediate / p->n_tile);
}

static MOK_HD void build_backward(const mok_plan *p, const mok_counters_layout *L, emitter *em) {
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile;
    int64_t shared_dx_tasks = 0;
    if (p->shared_intermediate > 0) {
        for (int64_t mt = 0; mt < L->num_token_tiles; ++mt)
            for (int64_t nt = 0; nt < nIs; ++nt)
                emit(em, MOK_TASK_SHARED_DH, MOK_ROLE_COMPUTE, -1, mt, nt, -1, -1, L->shared_up_done + mt, -1, -1, 0,
                     -1, 0);
        for (int64_t mt = 0; mt < L->num_token_tiles; ++mt)
            for (int64_t nt = 0; nt < nH; ++nt, ++shared_dx_tasks)
                emit(em, MOK_TASK_SHARED_DX, MOK_ROLE_COMPUTE, -1, mt, nt, -1, -1, L->shared_dh_all, -1,
                     L->shared_up_done + mt, nIs, -1, 0);
    }
    const int64_t rows = p->padded_rows;
    const int64_t nmb = ceil_div(rows, p->minibatch_rows);
    const int64_t ring_mbs = p->ring_rows / p->minibatch_rows;
    int64_t ahead = ring_mbs - 1 < MOK_LOOKAHEAD_MINIBATCHES ? ring_mbs - 1 : MOK_LOOKAHEAD_MINIBATCHES;
    int64_t next = 0;
    for (int64_t b = 0; b < nmb; ++b) {
        /* A pull into macrobatch M waits for macrobatch M-1's weight gradients, emitted after
           M-1's last minibatch: only pull minibatches whose macrobatch has started. */
        while (next < nmb && next <= b + ahead && next - ring_mbs <= b - 1 && (next / ring_mbs) * ring_mbs <= b) {
            int64_t t0, t1;
            mb_tiles(p, rows, next, &t0, &t1);
            int64_t w0 = -1, g0 = 0, w1 = -1, g1 = 0;
            if (next >= ring_mbs) {
                int64_t prev = next - ring_mbs, q0, q1, m = next / ring_mbs - 1;
                mb_tiles(p, rows, prev, &q0, &q1);
                w0 = L->pushed + prev;
                g0 = q1 - q0;
                w1 = L->wgrad_done + m;
                g1 = wgrad_tasks_in(p, m);
            }
            for (int64_t rt = t0; rt < t1; ++rt)
                emit(em, MOK_TASK_PULL, MOK_ROLE_COMM, next, rt, -1, -1, -1, L->pulled + next, -1, w0, g0, w1, g1);
            ++next;
        }
        int64_t t0, t1, m = b / ring_mbs;
        mb_tiles(p, rows, b, &t0, &t1);
        int64_t tiles = t1 - t0;
        for (int64_t rt = t0; rt < t1; ++rt)
            for (int64_t nt = 0; nt < nI; ++nt)
                emit(em, MOK_TASK_DH, MOK_ROLE_COMPUTE, b, rt, nt, -1, -1, L->dh_done + b, L->dh_macro_done + m,
                     L->pulled + b, tiles, -1, 0);
        for (int64_t rt = t0; rt < t1; ++rt)
            for (int64_t nt = 0; nt < nH; ++nt)
                emit(em, MOK_TASK_DX, MOK_ROLE_COMPUTE, b, rt, nt, -1, -1, L->dx_done + b, -1, L->dh_done + b,
                     tiles * nI, -1, 0);
        for (int64_t rt = t0; rt < t1; ++rt)
            emit(em, MOK_TASK_PUSH, MOK_ROLE_COMM, b, rt, -1, -1, -1, L->pushed + b, -1, L->dx_done + b, tiles * nH,
                 -1, 0);
        if ((b + 1) % ring_mbs == 0 || b == nmb - 1) {
            for (int e = 0; e < p->num_local_experts; ++e) {
                int64_t f, t;
                mok__expert_rows_in(p, e, m, &f, &t);
                if (t <= f) continue;
                for (int mat = 0; mat < 3; ++mat) {
                    int64_t R, C;
                    wgrad_dims(p, mat, p->intermediate, &R, &C);
                    for (int64_t i = 0; i < R; ++i)
                        for (int64_t j = 0; j < C; ++j)
                            emit(em, MOK_TASK_WGRAD, MOK_ROLE_COMPUTE, m, i, j, e, mat, L->wgrad_done + m, -1,
                                 L->dh_macro_done + m, dh_tasks_in(p, m), -1, 0);
                }
            }
        }
    }
    if (p->shared_intermediate > 0) {
        for (int mat = 0; mat < 3; ++mat) {
            int64_t R, C;
            wgrad_dims(p, mat, p->shared_intermediate, &R, &C);
            for (int64_t i = 0; i < R; ++i)
                for (int64_t j = 0; j < C; ++j)
                    emit(em, MOK_TASK_SHARED_WGRAD, MOK_ROLE_COMPUTE, -1, i, j, -1, mat, -1, -1, L->shared_dh_all,
                         shared_dx_tasks, -1, 0);
        }
    }
    if (!p->accumulate)
        for (int e = 0; e < p->num_local_experts; ++e)
            if (p->expert_rows[e] == 0)
                emit(em, MOK_TASK_WGRAD_ZERO, MOK_ROLE_COMPUTE, -1, -1, -1, e, -1, -1, -1, -1, 0, -1, 0);
}

static MOK_HD void group_set(mok_task_group *g, int kind, int64_t mb, int64_t first, int64_t num, int64_t n_tiles,
                              int64_t wait, int64_t target, int wait_per_tile, int64_t done, int done_per_tile) {
    g->kind = kind;
    g->minibatch = mb;
    g->first_tile = first;
    g->num_tiles = num;
    g->n_tiles = n_tiles;
    g->wait = wait;
    g->target = target;
    g->wait_per_tile = wait_per_tile;
    g->done = done;
    g->done_per_tile = done_per_tile;
}

MOK_CORE int mok__forward_group(const mok_plan *p, const mok_counters_layout *L, int role, int64_t g,
                              mok_task_group *out) {
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile;
    int64_t rows = p->padded_rows;
    if (p->recompute && p->context_rows < rows) rows = p->context_rows;
    const int64_t nmb = ceil_div(rows, p->minibatch_rows);
    const int64_t ring_mbs = p->ring_rows / p->minibatch_rows;
    const int64_t ahead = ring_mbs - 1 < MOK_LOOKAHEAD_MINIBATCHES ? ring_mbs - 1 : MOK_LOOKAHEAD_MINIBATCHES;
    if (role == MOK_ROLE_COMPUTE) {
        const int has_shared = p->shared_intermediate > 0 && L->num_token_tiles > 0;
        const int64_t shared_groups = has_shared ? (p->recompute ? 1 : 2) : 0;
        if (g < shared_groups) {
            if (g == 0)
                group_set(out, MOK_TASK_SHARED_UP, -1, 0, L->num_token_tiles, nIs, -1, 0, 0, L->shared_up_done, 1);
            else
                group_set(out, MOK_TASK_SHARED_DOWN, -1, 0, L->num_token_tiles, nH, L->shared_up_done, nIs, 1, -1, 0);
            return 1;
        }
        g -= shared_groups;
        const int64_t per_mb = p->recompute ? 1 : 2;
        int64_t b = g / per_mb;
        if (b >= nmb) return 0;
        int64_t t0, t1;
        mb_tiles(p, rows, b, &t0, &t1);
        if (g % per_mb == 0)
            group_set(out, MOK_TASK_GATEUP, b, t0, t1 - t0, nI, L->dispatched + b, t1 - t0, 0, L->gateup_done + b, 0);
        else
            group_set(out, MOK_TASK_DOWN, b, t0, t1 - t0, nH, L->gateup_done + b, (t1 - t0) * nI, 0, L->down_done + b,
                      0);
        return 1;
    }
    /* comm: D(0 .. A-1), then C(b) followed by D(b + A) while there is one (A = dispatches
       ahead of the first combine); recompute has no combines, so just D(0 ..). */
    const int64_t A = nmb < ahead + 1 ? nmb : ahead + 1;
    int64_t kind_is_dispatch, b;
    if (p->recompute) {
        if (g >= nmb) return 0;
        kind_is_dispatch = 1;
        b = g;
    } else if (g < A) {
        kind_is_dispatch = 1;
        b = g;
    } else {
        int64_t h = g - A, pairs = nmb - A;
        if (h < 2 * pairs) {
            kind_is_dispatch = h % 2;
            b = h / 2 + (kind_is_dispatch ? A : 0);
        } else {
            kind_is_dispatch = 0;
            b = pairs + (h - 2 * pairs);
            if (b >= nmb) return 0;
        }
    }
    int64_t t0, t1;
    mb_tiles(p, rows, b, &t0, &t1);
    if (kind_is_dispatch) {
        int64_t wait = -1, target = 0;
        if (b >= ring_mbs) {
            int64_t prev = b - ring_mbs, q0, q1;
            mb_tiles(p, rows, prev, &q0, &q1);
            wait = p->recompute ? L->gateup_done + prev : L->combined + prev;
            target = p->recompute ? (q1 - q0) * nI : (q1 - q0);
        }
        group_set(out, MOK_TASK_DISPATCH, b, t0, t1 - t0, 1, wait, target, 0, L->dispatched + b, 0);
    } else {
        group_set(out, MOK_TASK_COMBINE, b, t0, t1 - t0, 1, L->down_done + b, (t1 - t0) * nH, 0, L->combined + b, 0);
    }
    return 1;
}

MOK_CORE int64_t mok__tasks_build(const mok_plan *plan, mok_task *tasks, int64_t cap) {
    mok_counters_layout L;
    mok__counters_layout(plan, &L);
    emitter em = {tasks, cap, 0};
    if (plan->backward) build_backward(plan, &L, &em);
    else build_forward(plan, &L, &em);
    return em.count <= cap ? em.count : -1;
}

MOK_CORE int64_t mok__tasks_max(const mok_plan *p, int64_t max_rows, int64_t max_tokens) {
    const int64_t w = p->wgrad_tile;
    int64_t tiles = max_rows / MOK_ROW_TILE;
    int64_t ntt = ceil_div(max_tokens, MOK_ROW_TILE);
    int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h, nIs = p->shared_intermediate / p->n_tile;
    int64_t per_tile = 2 + nI + nH;
    int64_t max_macro = ceil_div(max_rows, p->ring_rows);
    int64_t wg = (p->num_local_experts + max_macro) * 3 * (p->intermediate / w) * (p->hidden / w);
    int64_t shared = ntt * (nIs + nH) + 3 * (p->shared_intermediate / w) * (p->hidden / w);
    return tiles * per_tile + wg + shared + p->num_local_experts;
}

MOK_CORE int64_t mok__counters_max(const mok_plan *p, int64_t max_rows, int64_t max_tokens) {
    mok_plan worst = *p;
    worst.padded_rows = max_rows;
    worst.num_tokens = max_tokens;
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
#endif
