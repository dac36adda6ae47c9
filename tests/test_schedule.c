/* test_schedule.c — the portable schedule and task list, checked against independent models.
 *
 * Schedules are built directly with mok__sched_build for random routings (uneven T, empty slots,
 * skew, empty experts) and compared with a simple model: which rows must appear, the padded
 * segments, and the round-robin order across source peers. Task lists built from those
 * schedules are checked for coverage (every tile exactly once), for the size bounds used at
 * workspace creation, and executed by a small simulator of comm and compute workers that must
 * always finish: one worker per role in alternating steps, and several per role in random
 * interleavings. A deliberately broken list shows that the checks can fail. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/schedule.h"
#include "core/tasks.h"
#include "mok.h"
#include "test.h"

/* ---- random numbers ---------------------------------------------------------------------- */

typedef struct rng {
    uint64_t state;
} rng;

static uint64_t rng_next(rng *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static int64_t rng_range(rng *r, int64_t lo, int64_t hi) { return lo + (int64_t)(rng_next(r) % (uint64_t)(hi - lo + 1)); }
static double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) / 9007199254740992.0; }

static rng rng_for(uint64_t salt) {
    rng r = {mok_test_seed() * 0x2545f4914f6cdd1dull ^ salt};
    rng_next(&r);
    return r;
}

static int64_t roundup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* ---- random routings --------------------------------------------------------------------- */

#define MAX_P 8

typedef struct routing {
    int P, L, k;
    int64_t E, T_max;
    int64_t T[MAX_P];
    int32_t *ids[MAX_P]; /* [T_max * k] each, valid up to T[p] * k */
} routing;

enum { ROUTE_UNIFORM, ROUTE_SKEW_EXPERT, ROUTE_SKEW_RANK, ROUTE_SPARSE_EXPERTS, ROUTE_MANY_EMPTY, ROUTE_MODES };

static void routing_free(routing *rt) {
    for (int p = 0; p < rt->P; ++p) free(rt->ids[p]);
    memset(rt, 0, sizeof *rt);
}

/* A random routing: P in 1..8, E_local 1..6, k 1..min(4, E), T per rank 0..300 (uneven, some 0),
 * some -1 slots, and one of several shapes of imbalance. Tokens usually pick distinct experts;
 * some routings allow repeats (the schedule treats every slot on its own). */
static void routing_random(routing *rt, rng *r, int P, int64_t max_T) {
    memset(rt, 0, sizeof *rt);
    rt->P = P;
    rt->L = (int)rng_range(r, 1, 6);
    rt->E = (int64_t)P * rt->L;
    int64_t kmax = rt->E < 4 ? rt->E : 4;
    rt->k = (int)rng_range(r, 1, kmax);
    int64_t biggest = 0;
    for (int p = 0; p < P; ++p) {
        int64_t t = rng_range(r, 0, max_T);
        if (rng_unit(r) < 0.15) t = 0;
        rt->T[p] = t;
        if (t > biggest) biggest = t;
    }
    rt->T_max = biggest + rng_range(r, 0, 20);
    if (rt->T_max < 1) rt->T_max = 1;
    int mode = (int)rng_range(r, 0, ROUTE_MODES - 1);
    int distinct = rng_unit(r) < 0.8;
    double p_empty = mode == ROUTE_MANY_EMPTY ? 0.6 : (rng_unit(r) < 0.5 ? 0.1 : 0.0);
    int64_t hot_expert = rng_range(r, 0, rt->E - 1);
    int hot_rank = (int)rng_range(r, 0, P - 1);
    /* ROUTE_SPARSE_EXPERTS: only every third expert receives anything, so many are empty. */
    for (int p = 0; p < P; ++p) {
        rt->ids[p] = malloc(sizeof(int32_t) * (size_t)(rt->T_max * rt->k) + 16);
        for (int64_t s = 0; s < rt->T_max * rt->k; ++s) rt->ids[p][s] = 0x7eadbeef; /* past T: never read */
        for (int64_t t = 0; t < rt->T[p]; ++t) {
            for (int j = 0; j < rt->k; ++j) {
                int32_t e = -1;
                if (rng_unit(r) >= p_empty) {
                    for (int attempt = 0; attempt < 64; ++attempt) {
                        int64_t c;
                        double u = rng_unit(r);
                        if (mode == ROUTE_SKEW_EXPERT && u < 0.7) c = hot_expert;
                        else if (mode == ROUTE_SKEW_RANK && u < 0.8) c = hot_rank * rt->L + rng_range(r, 0, rt->L - 1);
                        else if (mode == ROUTE_SPARSE_EXPERTS) c = rng_range(r, 0, (rt->E - 1) / 3) * 3;
                        else c = rng_range(r, 0, rt->E - 1);
                        int used = 0;
                        for (int q = 0; q < j && distinct; ++q) used |= rt->ids[p][t * rt->k + q] == c;
                        if (!used) {
                            e = (int32_t)c;
                            break;
                        }
                    }
                }
                rt->ids[p][t * rt->k + j] = e;
            }
        }
    }
}

static void *sched_alloc(const mok_sched_layout *lay, int poison) {
    void *buf = aligned_alloc(64, roundup((int64_t)lay->bytes, 64));
    memset(buf, poison, lay->bytes);
    return buf;
}

static int sched_build(const routing *rt, const mok_sched_layout *lay, void *buf, int rank) {
    return mok__sched_build(lay, buf, rank, rt->E, rt->T, (const int32_t *const *)rt->ids);
}

/* ---- the schedule model ------------------------------------------------------------------ */

/* Checks every invariant of rank `rank`'s schedule against the routing. Returns the number of
 * failed checks (each also reported through CHECK). */
static int check_schedule(const routing *rt, const mok_sched_layout *lay, void *buf, int rank, const char *what) {
    const int P = rt->P, L = rt->L, k = rt->k;
    const int64_t first = (int64_t)rank * L;
    int bad = 0;
#define EXPECT(cond, ...)                                                                  \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            if (bad < 4) CHECK(cond, __VA_ARGS__);                                         \
            ++bad;                                                                         \
        }                                                                                  \
    } while (0)
    mok_sched_view v = mok__sched_view(lay, buf);
    const mok_sched_header *h = v.header;
    EXPECT(h->magic == MOK_SCHED_MAGIC, "%s rank %d: magic", what, rank);
    EXPECT(h->error == 0, "%s rank %d: error %d", what, rank, h->error);
    EXPECT(h->nranks == P && h->rank == rank && h->num_local_experts == L && h->topk == k,
           "%s rank %d: header identity (%d %d %d %d)", what, rank, h->nranks, h->rank, h->num_local_experts, h->topk);
    EXPECT(h->max_rows == lay->max_rows && lay->max_rows == mok__sched_max_rows(P, L, k, rt->T_max),
           "%s rank %d: max_rows", what, rank);
    for (int p = 0; p < MOK_MAX_RANKS; ++p)
        EXPECT(h->num_tokens[p] == (p < P ? rt->T[p] : 0), "%s rank %d: num_tokens[%d] = %lld", what, rank, p,
               (long long)h->num_tokens[p]);

    /* Model: per local expert, per peer, the (token, slot) queue in increasing order. */
    int64_t *count = calloc((size_t)L * P, sizeof(int64_t));
    for (int p = 0; p < P; ++p)
        for (int64_t s = 0; s < rt->T[p] * k; ++s) {
            int32_t e = rt->ids[p][s];
            if (e >= first && e < first + L) count[(e - first) * P + p] += 1;
        }
    int64_t routed = 0, padded = 0, busiest = 0;
    for (int l = 0; l < L; ++l) {
        int64_t n = 0;
        for (int p = 0; p < P; ++p) {
            n += count[l * P + p];
            EXPECT(v.counts[l * P + p] == count[l * P + p], "%s rank %d: counts[%d][%d] = %lld, want %lld", what, rank,
                   l, p, (long long)v.counts[l * P + p], (long long)count[l * P + p]);
        }
        EXPECT(v.expert_rows[l] == n, "%s rank %d: expert_rows[%d] = %lld, want %lld", what, rank, l,
               (long long)v.expert_rows[l], (long long)n);
        EXPECT(v.expert_start[l] == padded, "%s rank %d: expert_start[%d] = %lld, want %lld", what, rank, l,
               (long long)v.expert_start[l], (long long)padded);
        EXPECT(v.expert_start[l] % MOK_ROW_TILE == 0, "%s rank %d: expert_start[%d] not tile aligned", what, rank, l);
        routed += n;
        padded += roundup(n, MOK_ROW_TILE);
        if (n > busiest) busiest = n;
    }
    EXPECT(v.expert_start[L] == padded, "%s rank %d: expert_start[L] = %lld, want %lld", what, rank,
           (long long)v.expert_start[L], (long long)padded);
    EXPECT(h->routed_rows == routed, "%s rank %d: routed_rows %lld, want %lld", what, rank, (long long)h->routed_rows,
           (long long)routed);
    EXPECT(h->padded_rows == padded, "%s rank %d: padded_rows %lld, want %lld", what, rank, (long long)h->padded_rows,
           (long long)padded);
    EXPECT(h->max_expert_rows == busiest, "%s rank %d: max_expert_rows %lld, want %lld", what, rank,
           (long long)h->max_expert_rows, (long long)busiest);
    EXPECT(padded <= lay->max_rows, "%s rank %d: padded rows %lld over capacity %lld", what, rank, (long long)padded,
           (long long)lay->max_rows);

    /* Row contents: the round-robin simulation, segment by segment. Queues are walked with a
       cursor per peer over that peer's slots in (token, slot) order. */
    if (padded == h->padded_rows && padded <= lay->max_rows) {
        int64_t *cursor = calloc((size_t)P, sizeof(int64_t));
        int64_t *taken = calloc((size_t)P, sizeof(int64_t));
        for (int l = 0; l < L; ++l) {
            const int32_t want_e = (int32_t)(first + l);
            for (int p = 0; p < P; ++p) cursor[p] = 0, taken[p] = 0;
            int64_t row = v.expert_start[l];
            for (;;) {
                int any = 0;
                for (int p = 0; p < P; ++p) {
                    if (taken[p] == count[l * P + p]) continue;
                    while (rt->ids[p][cursor[p]] != want_e) ++cursor[p];
                    EXPECT(v.row_peer[row] == p && v.row_slot[row] == cursor[p],
                           "%s rank %d: expert %d row %lld is (peer %d, slot %d), want (peer %d, slot %lld)", what,
                           rank, l, (long long)(row - v.expert_start[l]), v.row_peer[row], v.row_slot[row], p,
                           (long long)cursor[p]);
                    ++cursor[p];
                    ++taken[p];
                    ++row;
                    any = 1;
                }
                if (!any) break;
            }
            /* padding: only at the end of the segment */
            for (; row < v.expert_start[l] + roundup(v.expert_rows[l], MOK_ROW_TILE); ++row)
                EXPECT(v.row_peer[row] == -1 && v.row_slot[row] == -1,
                       "%s rank %d: expert %d padding row %lld is (peer %d, slot %d)", what, rank, l,
                       (long long)(row - v.expert_start[l]), v.row_peer[row], v.row_slot[row]);
        }
        free(cursor);
        free(taken);

        /* Independently of the order: every routed slot owned here appears exactly once, in its
           expert's segment, and nothing else appears. */
        int64_t total_slots = 0, offset[MAX_P + 1];
        for (int p = 0; p < P; ++p) offset[p] = total_slots, total_slots += rt->T[p] * k;
        offset[P] = total_slots;
        int32_t *seen = calloc((size_t)total_slots + 1, sizeof(int32_t));
        for (int64_t r = 0; r < padded; ++r) {
            int32_t p = v.row_peer[r], s = v.row_slot[r];
            int l = mok__sched_row_expert(&v, L, r);
            EXPECT(l >= 0 && l < L && v.expert_start[l] <= r && r < v.expert_start[l + 1],
                   "%s rank %d: row_expert(%lld) = %d is not the segment holding the row", what, rank, (long long)r,
                   l);
            if (p == -1) {
                EXPECT(s == -1, "%s rank %d: padding row %lld has slot %d", what, rank, (long long)r, s);
                EXPECT(l >= 0 && l < L && r >= v.expert_start[l] + v.expert_rows[l],
                       "%s rank %d: padding row %lld inside the real rows of its expert", what, rank, (long long)r);
                continue;
            }
            if (p < 0 || p >= P || s < 0 || s >= rt->T[p] * k) {
                EXPECT(0, "%s rank %d: row %lld holds (peer %d, slot %d), not a routed slot", what, rank, (long long)r,
                       p, s);
                continue;
            }
            seen[offset[p] + s] += 1;
            EXPECT(rt->ids[p][s] == first + l, "%s rank %d: row %lld (peer %d slot %d, expert %d) in expert %d's segment",
                   what, rank, (long long)r, p, s, rt->ids[p][s], (int)(first + l));
        }
        for (int p = 0; p < P; ++p)
            for (int64_t s = 0; s < rt->T[p] * k; ++s) {
                int owned = rt->ids[p][s] >= first && rt->ids[p][s] < first + L;
                EXPECT(seen[offset[p] + s] == owned, "%s rank %d: (peer %d, token %lld, slot %lld) appears %d times", what,
                       rank, p, (long long)(s / k), (long long)(s % k), seen[offset[p] + s]);
            }
        free(seen);
    }

    for (int64_t s = 0; s < rt->T_max * k; ++s) {
        int32_t want = s < rt->T[rank] * k ? rt->ids[rank][s] : -1;
        EXPECT(v.own_ids[s] == want, "%s rank %d: own_ids[%lld] = %d, want %d", what, rank, (long long)s, v.own_ids[s],
               want);
    }
    free(count);
#undef EXPECT
    return bad;
}

/* ---- task lists ---------------------------------------------------------------------------- */

typedef struct plan_case {
    int backward, recompute, accumulate, shared;
    int minibatch_rows, ring_rows;
    int64_t context_rows;
    int wide_h; /* H tiles of 128 columns (down, dx) where H allows */
} plan_case;

static const char *plan_name(const plan_case *c) {
    if (c->backward) return c->accumulate ? "backward(accumulate)" : "backward";
    return c->recompute ? "recompute" : "forward";
}

static mok_plan plan_from(const plan_case *c, const mok_sched_view *v, int L, int64_t T, int64_t H, int64_t I,
                          int64_t Is) {
    mok_plan p;
    memset(&p, 0, sizeof p);
    p.backward = c->backward;
    p.recompute = c->recompute;
    p.accumulate = c->accumulate;
    p.padded_rows = v->header->padded_rows;
    p.context_rows = c->context_rows;
    p.num_tokens = T;
    p.hidden = H;
    p.intermediate = I;
    p.shared_intermediate = c->shared ? Is : 0;
    p.num_local_experts = L;
    p.minibatch_rows = c->minibatch_rows;
    p.ring_rows = c->ring_rows;
    p.n_tile = 64;
    p.n_tile_h = H % 128 == 0 && c->wide_h ? 128 : 64;
    p.wgrad_tile = 64;
    p.wgrad_tile_n = c->wide_h ? 128 : 0; /* rectangular weight-gradient tiles, as the GPU's */
    p.expert_start = v->expert_start;
    p.expert_rows = v->expert_rows;
    return p;
}

/* The ring's users in a one-rank list with the default transfers, per row tile: the tasks that
 * read or write its rows (DISPATCH, GATEUP, DOWN, COMBINE, PULL, DH, DX, PUSH: row tile a; a
 * WGRAD: every row tile that its expert's rows in its macrobatch touch). A task that refills a
 * ring slot (DISPATCH or PULL into a minibatch >= ring_mbs, row tile a) overwrites the rows of
 * row tile a - shift, whose users must all be done when it starts. A WGRAD task continues the
 * sum of the same tile of its expert's weight gradients from an earlier macrobatch (through the
 * carry slot, or the caller's buffer when accumulating): that task, prior[i], must be done when
 * it starts. */
typedef struct ring_users {
    int64_t tiles, shift;  /* row tiles of the pass; ring slots in row tiles */
    int ring_mbs;
    int64_t *first, *list; /* users of tile t: list[first[t] .. first[t + 1]) */
    int64_t *prior;        /* [n]: a WGRAD task's predecessor on its output tile, -1 none */
} ring_users;

static int uses_tile(const mok_task *t, int64_t *a) {
    switch (t->kind) {
    case MOK_TASK_DISPATCH: case MOK_TASK_GATEUP: case MOK_TASK_DOWN: case MOK_TASK_COMBINE:
    case MOK_TASK_PULL: case MOK_TASK_DH: case MOK_TASK_DX: case MOK_TASK_PUSH:
        *a = t->a;
        return 1;
    default: return 0;
    }
}

/* Row tiles [*t0, *t1) that a WGRAD task's rows touch. */
static void wgrad_tiles_of(const mok_plan *p, const mok_task *t, int64_t *t0, int64_t *t1) {
    int64_t f, e;
    mok__expert_rows_in(p, t->expert, t->minibatch, &f, &e);
    *t0 = f / MOK_ROW_TILE;
    *t1 = e > f ? (e + MOK_ROW_TILE - 1) / MOK_ROW_TILE : *t0;
}

static ring_users ring_users_build(const mok_plan *p, const mok_task *tasks, int64_t n) {
    ring_users u;
    u.tiles = p->padded_rows / MOK_ROW_TILE;
    u.shift = p->ring_rows / MOK_ROW_TILE;
    u.ring_mbs = p->ring_rows / p->minibatch_rows;
    u.first = calloc((size_t)u.tiles + 2, sizeof(int64_t));
    for (int pass = 0; pass < 2; ++pass) { /* count, then place */
        int64_t *fill = pass ? calloc((size_t)u.tiles + 1, sizeof(int64_t)) : NULL;
        for (int64_t i = 0; i < n; ++i) {
            int64_t a, t0, t1;
            if (uses_tile(&tasks[i], &a)) t0 = a, t1 = a + 1;
            else if (tasks[i].kind == MOK_TASK_WGRAD) wgrad_tiles_of(p, &tasks[i], &t0, &t1);
            else continue;
            for (int64_t t = t0; t < t1 && t < u.tiles; ++t) {
                if (pass) u.list[u.first[t] + fill[t]++] = i;
                else u.first[t + 1] += 1;
            }
        }
        if (pass) {
            free(fill);
        } else {
            for (int64_t t = 0; t < u.tiles; ++t) u.first[t + 1] += u.first[t];
            u.list = malloc(sizeof(int64_t) * (size_t)(u.first[u.tiles] + 1));
        }
    }
    /* the last WGRAD task seen on each (expert, matrix, row tile, column tile), in list order */
    int64_t na = 1, nb = 1;
    for (int64_t i = 0; i < n; ++i)
        if (tasks[i].kind == MOK_TASK_WGRAD) {
            if (tasks[i].a >= na) na = tasks[i].a + 1;
            if (tasks[i].b >= nb) nb = tasks[i].b + 1;
        }
    const int64_t slots = (int64_t)p->num_local_experts * 3 * na * nb;
    int64_t *last = malloc(sizeof(int64_t) * (size_t)(slots + 1));
    for (int64_t k = 0; k < slots; ++k) last[k] = -1;
    u.prior = malloc(sizeof(int64_t) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; ++i) {
        const mok_task *t = &tasks[i];
        u.prior[i] = -1;
        if (t->kind != MOK_TASK_WGRAD) continue;
        const int64_t k = (((int64_t)t->expert * 3 + t->matrix) * na + t->a) * nb + t->b;
        u.prior[i] = last[k];
        last[k] = i;
    }
    free(last);
    return u;
}

static void ring_users_free(ring_users *u) {
    free(u->first);
    free(u->list);
    free(u->prior);
}

/* Task i (t) starting: the users of the rows it overwrites (it refills a slot) not done yet, or
 * its predecessor on its weight-gradient tile not done (a WGRAD); 0 for other tasks. */
static int64_t ring_hazards(const ring_users *u, int64_t i, const mok_task *t, const char *done) {
    if (t->kind == MOK_TASK_WGRAD) return u->prior[i] >= 0 && !done[u->prior[i]];
    if ((t->kind != MOK_TASK_DISPATCH && t->kind != MOK_TASK_PULL) || t->minibatch < u->ring_mbs) return 0;
    const int64_t prev = t->a - u->shift;
    int64_t pending = 0;
    for (int64_t j = u->first[prev]; j < u->first[prev + 1]; ++j) pending += !done[u->list[j]];
    return pending;
}

/* The sequential simulator. Workers of a role take that role's tasks in list order from a
 * shared cursor, one task at a time: claim it, wait until its counters reach their targets,
 * run it, bump its done counters. workers[role] workers per role; with r == NULL, one worker
 * per role in alternating steps, else a random worker acts at each step (a claimed task may
 * sit "running" for a while before it bumps). With ring users (may be NULL), *hazards counts
 * the tasks that start while ring_hazards finds one not done (a user of the rows a refill
 * overwrites, or a weight-gradient tile's predecessor). Returns 1 when every task ran, 0 on
 * deadlock. */
typedef struct sim_worker {
    int role;
    int64_t held; /* task index, -1 none */
    int running;  /* its waits were met; it bumps on its next step */
    int finished;
} sim_worker;

static int waits_met(const mok_task *t, const int64_t *counters) {
    for (int w = 0; w < 2; ++w)
        if (t->wait[w] >= 0 && counters[t->wait[w]] < t->target[w]) return 0;
    return 1;
}

static int simulate_ring(const mok_task *tasks, int64_t n, int64_t num_counters, const int workers[2], rng *r,
                         int64_t *executed_out, const ring_users *ru, int64_t *hazards) {
    int64_t *counters = calloc((size_t)num_counters + 1, sizeof(int64_t));
    char *done = calloc((size_t)n + 1, 1);
    sim_worker ws[16];
    int nw = 0;
    for (int role = 0; role < 2; ++role)
        for (int i = 0; i < workers[role]; ++i) ws[nw++] = (sim_worker){role, -1, 0, 0};
    int64_t cursor[2] = {0, 0}, executed = 0;
    int turn = 0, ok = 1;
    for (;;) {
        /* Deadlock / completion: nobody can act when every unfinished worker holds a task whose
           waits are unmet (an idle worker can always claim or finish; a running one can bump). */
        int alive = 0, can_act = 0;
        for (int i = 0; i < nw; ++i) {
            if (ws[i].finished) continue;
            ++alive;
            if (ws[i].held < 0 || ws[i].running || waits_met(&tasks[ws[i].held], counters)) can_act = 1;
        }
        if (!alive) break;
        if (!can_act) {
            ok = 0;
            break;
        }
        int i;
        if (r) {
            do i = (int)rng_range(r, 0, nw - 1);
            while (ws[i].finished);
        } else {
            i = turn;
            turn = (turn + 1) % nw;
            if (ws[i].finished) continue;
        }
        sim_worker *w = &ws[i];
        if (w->held < 0) {
            while (cursor[w->role] < n && tasks[cursor[w->role]].role != w->role) ++cursor[w->role];
            if (cursor[w->role] >= n) {
                w->finished = 1;
                continue;
            }
            w->held = cursor[w->role]++;
            w->running = 0;
            if (r) continue; /* claiming is a step of its own */
        }
        const mok_task *t = &tasks[w->held];
        if (!w->running) {
            if (!waits_met(t, counters)) continue;
            w->running = 1;
            if (ru) *hazards += ring_hazards(ru, w->held, t, done);
            if (r && rng_unit(r) < 0.5) continue; /* let others act while it runs */
        }
        for (int d = 0; d < 2; ++d)
            if (t->done[d] >= 0) counters[t->done[d]] += 1;
        done[w->held] = 1;
        ++executed;
        w->held = -1;
        w->running = 0;
    }
    free(counters);
    free(done);
    if (executed_out) *executed_out = executed;
    return ok && executed == n;
}

static int simulate(const mok_task *tasks, int64_t n, int64_t num_counters, const int workers[2], rng *r,
                    int64_t *executed_out) {
    return simulate_ring(tasks, n, num_counters, workers, r, executed_out, NULL, NULL);
}

/* Coverage, roles, minibatch fields and counter ranges of a list. Returns failed checks. */
static int check_coverage(const mok_plan *p, const mok_counters_layout *CL, const mok_task *tasks, int64_t n,
                          const char *what) {
    int bad = 0;
#define EXPECT(cond, ...)                                                                  \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            if (bad < 4) CHECK(cond, __VA_ARGS__);                                         \
            ++bad;                                                                         \
        }                                                                                  \
    } while (0)
    const int64_t nI = p->intermediate / p->n_tile, nH = p->hidden / p->n_tile_h;
    const int64_t nIs = p->shared_intermediate / p->n_tile;
    int64_t rows = p->padded_rows;
    if (!p->backward && p->recompute && p->context_rows < rows) rows = p->context_rows;
    const int64_t ntiles = rows / MOK_ROW_TILE;
    const int64_t ntt = (p->num_tokens + MOK_ROW_TILE - 1) / MOK_ROW_TILE;
    const int64_t nmacro = (p->padded_rows + p->ring_rows - 1) / p->ring_rows;
    /* weight-gradient tiles: rows of wgrad_tile, columns of wgrad_tile_n (the last ones narrower) */
    const int64_t w = p->wgrad_tile, wn = p->wgrad_tile_n ? p->wgrad_tile_n : w;
    const int64_t wI = p->intermediate / w, wH = p->hidden / w, wIs = p->shared_intermediate / w;
    const int64_t cI = (p->intermediate + wn - 1) / wn, cH = (p->hidden + wn - 1) / wn;
    const int64_t cIs = (p->shared_intermediate + wn - 1) / wn;
    const int L = p->num_local_experts;
    /* in place, the down (dx) tiles bump their minibatch's combined (pushed) counter, which the
       COMBINE (PUSH) tasks they replace would */
    const int in_place = mok__plan_in_place(p);

    /* counts[kind][...]: flat arrays sized per kind */
    int64_t *per_tile[MOK_TASK_NUM_KINDS] = {0};
    int64_t width[MOK_TASK_NUM_KINDS] = {0}, height[MOK_TASK_NUM_KINDS] = {0};
    int expected[MOK_TASK_NUM_KINDS] = {0};
    if (!p->backward) {
        expected[MOK_TASK_DISPATCH] = 1, height[MOK_TASK_DISPATCH] = ntiles, width[MOK_TASK_DISPATCH] = 1;
        expected[MOK_TASK_GATEUP] = 1, height[MOK_TASK_GATEUP] = ntiles, width[MOK_TASK_GATEUP] = nI;
        if (!p->recompute) {
            expected[MOK_TASK_DOWN] = 1, height[MOK_TASK_DOWN] = ntiles, width[MOK_TASK_DOWN] = nH;
            if (!in_place)
                expected[MOK_TASK_COMBINE] = 1, height[MOK_TASK_COMBINE] = ntiles, width[MOK_TASK_COMBINE] = 1;
        }
        if (nIs > 0) {
            expected[MOK_TASK_SHARED_UP] = 1, height[MOK_TASK_SHARED_UP] = ntt, width[MOK_TASK_SHARED_UP] = nIs;
            if (!p->recompute)
                expected[MOK_TASK_SHARED_DOWN] = 1, height[MOK_TASK_SHARED_DOWN] = ntt, width[MOK_TASK_SHARED_DOWN] = nH;
        }
    } else {
        expected[MOK_TASK_PULL] = 1, height[MOK_TASK_PULL] = ntiles, width[MOK_TASK_PULL] = 1;
        expected[MOK_TASK_DH] = 1, height[MOK_TASK_DH] = ntiles, width[MOK_TASK_DH] = nI;
        expected[MOK_TASK_DX] = 1, height[MOK_TASK_DX] = ntiles, width[MOK_TASK_DX] = nH;
        if (!in_place) expected[MOK_TASK_PUSH] = 1, height[MOK_TASK_PUSH] = ntiles, width[MOK_TASK_PUSH] = 1;
        if (nIs > 0) {
            expected[MOK_TASK_SHARED_DH] = 1, height[MOK_TASK_SHARED_DH] = ntt, width[MOK_TASK_SHARED_DH] = nIs;
            expected[MOK_TASK_SHARED_DX] = 1, height[MOK_TASK_SHARED_DX] = ntt, width[MOK_TASK_SHARED_DX] = nH;
        }
    }
    for (int kind = 0; kind < MOK_TASK_NUM_KINDS; ++kind)
        if (expected[kind]) per_tile[kind] = calloc((size_t)(height[kind] * width[kind]) + 1, sizeof(int64_t));
    /* WGRAD: [macro][expert][matrix][i][j] with i, j < max(wI, wH); SHARED_WGRAD: [matrix][i][j] */
    const int64_t wmax = wI > wH ? wI : wH, wsmax = wIs > wH ? wIs : wH;
    int64_t *wgrad = calloc((size_t)(nmacro * L * 3 * wmax * wmax) + 1, sizeof(int64_t));
    int64_t *swgrad = calloc((size_t)(3 * wsmax * wsmax) + 1, sizeof(int64_t));
    int64_t *zero = calloc((size_t)L, sizeof(int64_t));

    for (int64_t i = 0; i < n; ++i) {
        const mok_task *t = &tasks[i];
        for (int d = 0; d < 2; ++d) {
            EXPECT(t->done[d] >= -1 && t->done[d] < CL->total, "%s: task %lld done[%d] = %d outside [0, %lld)", what,
                   (long long)i, d, t->done[d], (long long)CL->total);
            EXPECT(t->wait[d] >= -1 && t->wait[d] < CL->total, "%s: task %lld wait[%d] = %d outside [0, %lld)", what,
                   (long long)i, d, t->wait[d], (long long)CL->total);
        }
        int kind = t->kind;
        if (kind < 0 || kind >= MOK_TASK_NUM_KINDS) {
            EXPECT(0, "%s: task %lld has kind %d", what, (long long)i, kind);
            continue;
        }
        int comm = kind == MOK_TASK_DISPATCH || kind == MOK_TASK_COMBINE || kind == MOK_TASK_PULL ||
                   kind == MOK_TASK_PUSH;
        EXPECT(t->role == (comm ? MOK_ROLE_COMM : MOK_ROLE_COMPUTE), "%s: task %lld kind %d has role %d", what,
               (long long)i, kind, t->role);
        if (kind == MOK_TASK_WGRAD) {
            int64_t m = t->minibatch, e = t->expert, mat = t->matrix;
            int64_t R = mat == MOK_WGRAD_DOWN ? wH : wI, C = mat == MOK_WGRAD_DOWN ? wI : wH;
            if (!p->backward || m < 0 || m >= nmacro || e < 0 || e >= L || mat < 0 || mat > 2 || t->a < 0 ||
                t->a >= R || t->b < 0 || t->b >= C) {
                EXPECT(0, "%s: WGRAD task %lld (macro %lld expert %lld matrix %lld tile %d,%d) out of range", what,
                       (long long)i, (long long)m, (long long)e, (long long)mat, t->a, t->b);
                continue;
            }
            wgrad[(((m * L + e) * 3 + mat) * wmax + t->a) * wmax + t->b] += 1;
            continue;
        }
        if (kind == MOK_TASK_SHARED_WGRAD) {
            int64_t mat = t->matrix;
            int64_t R = mat == MOK_WGRAD_DOWN ? wH : wIs, C = mat == MOK_WGRAD_DOWN ? wIs : wH;
            if (!p->backward || nIs == 0 || mat < 0 || mat > 2 || t->a < 0 || t->a >= R || t->b < 0 || t->b >= C) {
                EXPECT(0, "%s: SHARED_WGRAD task %lld (matrix %lld tile %d,%d) unexpected", what, (long long)i,
                       (long long)mat, t->a, t->b);
                continue;
            }
            swgrad[(mat * wsmax + t->a) * wsmax + t->b] += 1;
            continue;
        }
        if (kind == MOK_TASK_WGRAD_ZERO) {
            if (!p->backward || t->expert < 0 || t->expert >= L) {
                EXPECT(0, "%s: WGRAD_ZERO task %lld (expert %d) unexpected", what, (long long)i, t->expert);
                continue;
            }
            zero[t->expert] += 1;
            continue;
        }
        if (!expected[kind]) {
            EXPECT(0, "%s: task %lld has kind %d, which this pass must not contain", what, (long long)i, kind);
            continue;
        }
        int64_t a = t->a, b = width[kind] == 1 ? 0 : t->b;
        if (a < 0 || a >= height[kind] || b < 0 || b >= width[kind]) {
            EXPECT(0, "%s: task %lld kind %d tile (%d, %d) outside [%lld x %lld]", what, (long long)i, kind, t->a, t->b,
                   (long long)height[kind], (long long)width[kind]);
            continue;
        }
        per_tile[kind][a * width[kind] + b] += 1;
        /* a dh tile waits for its own row tile's pull (every sender's), which bumps that tile's counter */
        if (kind == MOK_TASK_DH)
            EXPECT(t->wait[0] == CL->pulled + a && t->target[0] == (p->combine_push ? p->nranks : 1),
                   "%s: DH task %lld of row tile %lld waits on counter %d for %d", what, (long long)i, (long long)a,
                   t->wait[0], t->target[0]);
        if (kind == MOK_TASK_PULL)
            EXPECT(t->done[0] == CL->pulled + a, "%s: PULL task %lld of row tile %lld bumps counter %d", what,
                   (long long)i, (long long)a, t->done[0]);
        /* a gate/up tile waits for its own row tile's dispatch (every sender's) */
        if (kind == MOK_TASK_GATEUP)
            EXPECT(t->wait[0] == CL->dispatched + a &&
                       t->target[0] == (p->dispatch_push && !p->recompute ? p->nranks : 1),
                   "%s: GATEUP task %lld of row tile %lld waits on counter %d for %d", what, (long long)i,
                   (long long)a, t->wait[0], t->target[0]);
        if (kind == MOK_TASK_DISPATCH)
            EXPECT(t->done[0] == CL->dispatched + a, "%s: DISPATCH task %lld of row tile %lld bumps counter %d",
                   what, (long long)i, (long long)a, t->done[0]);
        if (kind == MOK_TASK_DOWN || kind == MOK_TASK_DX) {
            const int64_t own = (kind == MOK_TASK_DOWN ? CL->combined : CL->pushed) + t->minibatch;
            EXPECT(t->done[1] == (in_place ? own : -1),
                   "%s: %s task %lld of minibatch %d bumps counter %d (in place %d)", what, mok__task_kind_name(kind),
                   (long long)i, t->minibatch, t->done[1], in_place);
        }
        int shared_kind = kind == MOK_TASK_SHARED_UP || kind == MOK_TASK_SHARED_DOWN || kind == MOK_TASK_SHARED_DH ||
                          kind == MOK_TASK_SHARED_DX;
        if (!shared_kind)
            EXPECT(t->minibatch == a * MOK_ROW_TILE / p->minibatch_rows,
                   "%s: task %lld kind %d of row tile %lld says minibatch %d", what, (long long)i, kind, (long long)a,
                   t->minibatch);
    }
    for (int kind = 0; kind < MOK_TASK_NUM_KINDS; ++kind) {
        if (!expected[kind]) continue;
        for (int64_t a = 0; a < height[kind]; ++a)
            for (int64_t b = 0; b < width[kind]; ++b)
                EXPECT(per_tile[kind][a * width[kind] + b] == 1, "%s: kind %d tile (%lld, %lld) appears %lld times",
                       what, kind, (long long)a, (long long)b, (long long)per_tile[kind][a * width[kind] + b]);
        free(per_tile[kind]);
    }
    if (p->backward) {
        for (int64_t m = 0; m < nmacro; ++m)
            for (int e = 0; e < L; ++e) {
                /* has rows: the expert's real rows meet macrobatch m's row range */
                int64_t s = p->expert_start[e], end = s + p->expert_rows[e];
                int64_t lo = m * p->ring_rows, hi = lo + p->ring_rows;
                int has = (s > lo ? s : lo) < (end < hi ? end : hi);
                for (int mat = 0; mat < 3; ++mat) {
                    int64_t R = mat == MOK_WGRAD_DOWN ? wH : wI, C = mat == MOK_WGRAD_DOWN ? cI : cH;
                    for (int64_t i = 0; i < wmax; ++i) /* every tile of the matrix once, none outside it */
                        for (int64_t j = 0; j < wmax; ++j) {
                            int64_t got = wgrad[(((m * L + e) * 3 + mat) * wmax + i) * wmax + j];
                            int want = i < R && j < C ? has : 0;
                            EXPECT(got == want, "%s: WGRAD macro %lld expert %d matrix %d tile (%lld, %lld): %lld times, want %d",
                                   what, (long long)m, e, mat, (long long)i, (long long)j, (long long)got, want);
                        }
                }
            }
        if (nIs > 0)
            for (int mat = 0; mat < 3; ++mat) {
                int64_t R = mat == MOK_WGRAD_DOWN ? wH : wIs, C = mat == MOK_WGRAD_DOWN ? cIs : cH;
                for (int64_t i = 0; i < wsmax; ++i)
                    for (int64_t j = 0; j < wsmax; ++j)
                        EXPECT(swgrad[(mat * wsmax + i) * wsmax + j] == (i < R && j < C),
                               "%s: SHARED_WGRAD matrix %d tile (%lld, %lld): %lld times", what, mat, (long long)i,
                               (long long)j, (long long)swgrad[(mat * wsmax + i) * wsmax + j]);
            }
        for (int e = 0; e < L; ++e) {
            int want = !p->accumulate && p->expert_rows[e] == 0;
            EXPECT(zero[e] == want, "%s: WGRAD_ZERO of expert %d (rows %lld): %lld times, want %d", what, e,
                   (long long)p->expert_rows[e], (long long)zero[e], want);
        }
    }
    free(wgrad);
    free(swgrad);
    free(zero);
#undef EXPECT
    return bad;
}

static int task_cmp(const void *a, const void *b) { return memcmp(a, b, sizeof(mok_task)); }

/* With raster > 1 the list must hold the same tasks as the tile-major one, each group's tasks in
 * the same group positions (only their order inside a group differs). */
static int check_raster_permutes(const mok_plan *p, const mok_task *tasks, int64_t n, const char *what) {
    mok_plan flat = *p;
    flat.raster = 1;
    mok_task *ref = malloc(sizeof(mok_task) * (size_t)(n + 1));
    int bad = mok__tasks_build(&flat, ref, n + 1) != n;
    CHECK(!bad, "%s: the tile-major list has another length", what);
    int64_t g0 = 0;
    while (!bad && g0 < n) { /* a group: a run of tasks of one kind and minibatch */
        int64_t g1 = g0 + 1;
        while (g1 < n && ref[g1].kind == ref[g0].kind && ref[g1].minibatch == ref[g0].minibatch) ++g1;
        mok_task *x = malloc(sizeof(mok_task) * (size_t)(g1 - g0)), *y = malloc(sizeof(mok_task) * (size_t)(g1 - g0));
        memcpy(x, tasks + g0, sizeof(mok_task) * (size_t)(g1 - g0));
        memcpy(y, ref + g0, sizeof(mok_task) * (size_t)(g1 - g0));
        qsort(x, (size_t)(g1 - g0), sizeof(mok_task), task_cmp);
        qsort(y, (size_t)(g1 - g0), sizeof(mok_task), task_cmp);
        bad = memcmp(x, y, sizeof(mok_task) * (size_t)(g1 - g0)) != 0;
        CHECK(!bad, "%s: raster %d: tasks %lld..%lld are not a reordering of the tile-major group", what, p->raster,
              (long long)g0, (long long)g1 - 1);
        free(x);
        free(y);
        g0 = g1;
    }
    free(ref);
    return bad;
}

/* Builds the list of one plan and runs every check on it; returns 0 when all pass. */
static int same_task(const mok_task *a, const mok_task *b) {
    return a->kind == b->kind && a->role == b->role && a->minibatch == b->minibatch && a->a == b->a && a->b == b->b &&
           a->expert == b->expert && a->matrix == b->matrix && a->done[0] == b->done[0] && a->done[1] == b->done[1] &&
           a->wait[0] == b->wait[0] && a->wait[1] == b->wait[1] && a->target[0] == b->target[0] &&
           a->target[1] == b->target[1] && a->peer == b->peer && a->wait_peer == b->wait_peer &&
           a->done_peer == b->done_peer;
}

/* The span list the GPU walks: within mok__spans_max, its spans expanded in order are the flat list
 * (n tasks), and a build that publishes as it goes leaves count << 1 in the word (the complete
 * bit is the caller's), only the spans that fit when the capacity is one short. */
static int check_spans(const mok_plan *p, int64_t max_rows, int64_t T_max, const mok_task *tasks, int64_t n,
                       const char *what) {
    const int64_t cap = mok__spans_max(p, max_rows, T_max), room = cap * 2 + 64;
    mok_task_span *spans = malloc(sizeof(mok_task_span) * (size_t)room);
    uint64_t word = 12345;
    const int64_t ns = mok__spans_build_published(p, spans, room, &word);
    int bad = !(ns >= 0 && ns <= cap);
    CHECK(!bad, "%s: %lld spans, bound %lld", what, (long long)ns, (long long)cap);
    if (bad) {
        free(spans);
        return 1;
    }
    const uint64_t want = ns > 0 ? (uint64_t)ns << 1 : 12345; /* an empty list publishes nothing */
    CHECK(word == want, "%s: published word %llu after %lld spans", what, (unsigned long long)word, (long long)ns);
    bad += word != want;
    int64_t t = 0, first_bad = -1;
    for (int64_t g = 0; g < ns; ++g)
        for (int64_t i = 0; i < (int64_t)spans[g].num_tiles * spans[g].n_tiles; ++i, ++t) {
            mok_task task;
            mok__span_task(p, &spans[g], i, &task);
            if (first_bad < 0 && (t >= n || !same_task(&task, &tasks[t]))) first_bad = t;
        }
    CHECK(first_bad < 0 && t == n, "%s: spans expand to %lld tasks of %lld, first differing %lld", what, (long long)t,
          (long long)n, (long long)first_bad);
    bad += !(first_bad < 0 && t == n);
    if (ns > 0) {
        word = 0;
        CHECK(mok__spans_build_published(p, spans, ns - 1, &word) == -1 && word == (uint64_t)(ns - 1) << 1,
              "%s: cap one short: word %llu, want %lld << 1", what, (unsigned long long)word, (long long)(ns - 1));
        bad += word != (uint64_t)(ns - 1) << 1;
    }
    free(spans);
    return bad;
}

static int check_plan(const mok_plan *p, int64_t max_rows, int64_t T_max, rng *r, int random_sims, const char *what) {
    int bad = 0;
    int64_t cap = mok__tasks_max(p, max_rows, T_max);
    int64_t counters_cap = mok__counters_max(p, max_rows, T_max);
    mok_counters_layout CL;
    mok__counters_layout(p, &CL);
    CHECK(CL.total <= counters_cap, "%s: %lld counters, bound %lld", what, (long long)CL.total,
          (long long)counters_cap);
    bad += CL.total > counters_cap;
    /* Build with room to spare, so that a list over the bound is measured, not cut. */
    int64_t room = cap * 2 + 1024;
    mok_task *tasks = malloc(sizeof(mok_task) * (size_t)room);
    int64_t n = mok__tasks_build(p, tasks, room);
    CHECK(n >= 0 && n <= cap, "%s: %lld tasks, bound %lld", what, (long long)n, (long long)cap);
    if (n < 0 || n > cap) {
        free(tasks);
        return bad + 1;
    }
    /* The exact bound must also be accepted, one less must not (when the list is not empty). */
    CHECK(mok__tasks_build(p, tasks, n) == n, "%s: build with cap = count fails", what);
    if (n > 0) CHECK(mok__tasks_build(p, tasks, n - 1) == -1, "%s: build with cap = count - 1 does not fail", what);
    mok__tasks_build(p, tasks, n);
    bad += check_spans(p, max_rows, T_max, tasks, n, what);

    int64_t *scratch = malloc(sizeof(int64_t) * (size_t)(CL.total + 1));
    int64_t first_bad = mok__tasks_check(tasks, n, CL.total, scratch);
    CHECK(first_bad == 0, "%s: task %lld waits on a later task", what, (long long)first_bad - 1);
    bad += first_bad != 0;
    free(scratch);
    bad += check_coverage(p, &CL, tasks, n, what);
    if (p->raster > 1) bad += check_raster_permutes(p, tasks, n, what);

    const int one[2] = {1, 1};
    int64_t executed = 0;
    int ok = simulate(tasks, n, CL.total, one, NULL, &executed);
    CHECK(ok, "%s: one worker per role deadlocks after %lld of %lld tasks", what, (long long)executed, (long long)n);
    bad += !ok;
    ring_users ru = ring_users_build(p, tasks, n);
    for (int s = 0; s < random_sims; ++s) {
        int workers[2] = {(int)rng_range(r, 2, 3), (int)rng_range(r, 2, 3)};
        int64_t hazards = 0;
        ok = simulate_ring(tasks, n, CL.total, workers, r, &executed, &ru, &hazards);
        CHECK(ok, "%s: %d comm + %d compute workers deadlock after %lld of %lld tasks", what, workers[0], workers[1],
              (long long)executed, (long long)n);
        CHECK(hazards == 0, "%s: %lld refills start while rows they overwrite are in use, or weight-gradient tiles "
              "before their previous macrobatch's", what, (long long)hazards);
        bad += !ok + (hazards != 0);
    }
    ring_users_free(&ru);
    free(tasks);
    return bad;
}

/* Every pass kind x ring size (1, 2, 4 minibatches, more than all rows) x shared expert on/off,
 * for rank `rank`'s schedule. */
static int check_all_plans(const routing *rt, const mok_sched_layout *lay, void *buf, int rank, rng *r,
                           int random_sims) {
    mok_sched_view v = mok__sched_view(lay, buf);
    static const int64_t dims[] = {64, 128, 192};
    int64_t H = dims[rng_range(r, 0, 2)], I = dims[rng_range(r, 0, 2)], Is = dims[rng_range(r, 0, 2)];
    int mb = (int)rng_range(r, 1, 3) * MOK_ROW_TILE;
    int bad = 0;
    for (int kind = 0; kind < 4; ++kind)
        for (int ring = 0; ring < 4; ++ring)
            for (int shared = 0; shared < 2; ++shared) {
                plan_case c = {0};
                c.backward = kind >= 2;
                c.recompute = kind == 1;
                c.accumulate = kind == 3;
                c.shared = shared;
                c.minibatch_rows = mb;
                c.wide_h = rng_unit(r) < 0.5;
                c.ring_rows = ring == 3 ? (int)roundup(lay->max_rows + 1, mb) : mb * (1 << ring);
                /* the workspace keeps context_rows a multiple of the row tile, at most max_rows */
                c.context_rows = rng_unit(r) < 0.4 ? lay->max_rows
                                                   : rng_range(r, 1, lay->max_rows / MOK_ROW_TILE) * MOK_ROW_TILE;
                mok_plan p = plan_from(&c, &v, rt->L, rt->T[rank], H, I, Is);
                p.nranks = rt->P; /* one rank: the down and dx tiles write in place (mok__plan_in_place) */
                p.rank = rank;
                static const int rasters[] = {1, 2, 3, 8};
                p.raster = rasters[rng_range(r, 0, 3)];
                char what[256];
                snprintf(what, sizeof what,
                         "P %d rank %d E_local %d k %d T %lld padded %lld: %s mb %d ring %d shared %d (H %lld/%d I %lld "
                         "I_s %lld ctx %lld raster %d)",
                         rt->P, rank, rt->L, rt->k, (long long)rt->T[rank], (long long)p.padded_rows, plan_name(&c), mb,
                         c.ring_rows, shared, (long long)H, p.n_tile_h, (long long)I, (long long)Is,
                         (long long)c.context_rows, p.raster);
                bad += check_plan(&p, lay->max_rows, rt->T_max, r, random_sims, what);
                if (bad > 8) return bad;
            }
    return bad;
}

/* ---- tests -------------------------------------------------------------------------------- */

MOK_TEST(schedule_random_routings) {
    rng r = rng_for(1);
    const int cases = mok_test_quick() ? 120 : 240;
    int failures = 0;
    for (int c = 0; c < cases && failures < 8; ++c) {
        routing rt;
        routing_random(&rt, &r, 1 + c % MAX_P, 300);
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        for (int rank = 0; rank < rt.P; ++rank) {
            void *buf = sched_alloc(&lay, 0xA5);
            int err = sched_build(&rt, &lay, buf, rank);
            CHECK(err == 0, "case %d rank %d: build returned %d", c, rank, err);
            char what[96];
            snprintf(what, sizeof what, "case %d (P %d E_local %d k %d T_max %lld)", c, rt.P, rt.L, rt.k,
                     (long long)rt.T_max);
            failures += check_schedule(&rt, &lay, buf, rank, what);
            free(buf);
        }
        routing_free(&rt);
    }
}

MOK_TEST(schedule_edge_routings) {
    /* Hand-picked corners: every token of every rank to one expert (the worst case), all slots
       empty, exactly one tile of rows, one row past a tile, T = 0 everywhere, one rank only. */
    rng r = rng_for(2);
    for (int shape = 0; shape < 7; ++shape) {
        routing rt;
        memset(&rt, 0, sizeof rt);
        rt.P = shape == 5 ? 1 : 4;
        rt.L = shape == 6 ? 1 : 3;
        rt.E = (int64_t)rt.P * rt.L;
        rt.k = shape == 6 ? 4 : 2;
        rt.T_max = 300;
        for (int p = 0; p < rt.P; ++p) {
            rt.T[p] = shape == 4 ? 0 : (shape == 2 ? 32 : (shape == 3 ? (p == 0 ? 129 : 0) : 300 - 37 * p));
            rt.ids[p] = malloc(sizeof(int32_t) * (size_t)(rt.T_max * rt.k));
            for (int64_t s = 0; s < rt.T_max * rt.k; ++s) {
                int32_t e;
                switch (shape) {
                case 0: e = 5; break;                              /* one expert takes everything */
                case 1: e = -1; break;                             /* nothing routed */
                case 2: e = (int32_t)(s % rt.k == 0 ? 1 : -1); break; /* 32 rows per rank: 128 in total */
                case 3: e = (int32_t)(s % 2 == 0 ? 7 : -1); break; /* 129 rows: one past a tile */
                case 6: e = (int32_t)(s % rt.E); break;            /* k = E: every expert, every token */
                default: e = (int32_t)rng_range(&r, -1, rt.E - 1); break;
                }
                rt.ids[p][s] = e;
            }
        }
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        for (int rank = 0; rank < rt.P; ++rank) {
            void *buf = sched_alloc(&lay, 0x5A);
            int err = sched_build(&rt, &lay, buf, rank);
            CHECK(err == 0, "shape %d rank %d: build returned %d", shape, rank, err);
            char what[64];
            snprintf(what, sizeof what, "edge shape %d", shape);
            check_schedule(&rt, &lay, buf, rank, what);
            mok_sched_view v = mok__sched_view(&lay, buf);
            if (shape == 0 && rank == 1)
                CHECK(v.expert_rows[2] == 2 * (300 + 263 + 226 + 189) && v.header->max_expert_rows == v.expert_rows[2],
                      "worst case: expert 5 has %lld rows", (long long)v.expert_rows[2]);
            if (shape == 1 || shape == 4) CHECK(v.header->padded_rows == 0, "shape %d: rows without routing", shape);
            if (shape == 2 && rank == 0)
                CHECK(v.header->padded_rows == 128 && v.expert_rows[1] == 128, "one full tile: padded %lld",
                      (long long)v.header->padded_rows);
            /* the task lists of these corners too: the worst case sits near the size bounds */
            if (shape == 0 || shape == 6 || (shape == 3 && rank == 2) || (shape == 4 && rank == 0))
                check_all_plans(&rt, &lay, buf, rank, &r, 2);
            if (shape == 3 && rank == 2)
                CHECK(v.header->padded_rows == 256 && v.expert_rows[1] == 129, "129 rows: padded %lld",
                      (long long)v.header->padded_rows);
            free(buf);
        }
        routing_free(&rt);
    }
}

MOK_TEST(schedule_bad_ids) {
    /* An id >= E or < -1 anywhere (any rank, any token, any slot) makes every rank's build
       report MOK_SCHED_ERR_EXPERT_ID; a peer's T outside [0, T_max] gives MOK_SCHED_ERR_TOKENS. */
    rng r = rng_for(3);
    const int cases = mok_test_quick() ? 10 : 40;
    for (int c = 0; c < cases; ++c) {
        routing rt;
        routing_random(&rt, &r, 1 + c % MAX_P, 120);
        int victim = -1;
        for (int p = 0; p < rt.P; ++p)
            if (rt.T[p] > 0) victim = p;
        if (victim < 0) {
            rt.T[0] = 1;
            rt.ids[0][0] = -1;
            for (int j = 1; j < rt.k; ++j) rt.ids[0][j] = -1;
            victim = 0;
        }
        int64_t s = rng_range(&r, 0, rt.T[victim] * rt.k - 1);
        int32_t saved = rt.ids[victim][s];
        static const int32_t bad_values[] = {0, -2, INT32_MIN, INT32_MAX};
        int32_t bad = bad_values[c % 4];
        if (bad == 0) bad = (int32_t)rt.E; /* the first id past the range */
        rt.ids[victim][s] = bad;
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        for (int rank = 0; rank < rt.P; ++rank) {
            void *buf = sched_alloc(&lay, 0);
            int err = sched_build(&rt, &lay, buf, rank);
            mok_sched_view v = mok__sched_view(&lay, buf);
            CHECK(err == MOK_SCHED_ERR_EXPERT_ID && v.header->error == MOK_SCHED_ERR_EXPERT_ID,
                  "case %d: id %d at rank %d slot %lld: rank %d's build returned %d (header %d)", c, bad, victim,
                  (long long)s, rank, err, v.header->error);
            /* The bad id is never placed: every row still holds a valid routed slot or padding. */
            for (int64_t row = 0; row < v.header->padded_rows && row < lay.max_rows; ++row)
                CHECK(v.row_peer[row] != victim || v.row_slot[row] != s, "case %d: the bad slot was placed", c);
            free(buf);
        }
        rt.ids[victim][s] = saved;
        /* T out of range */
        int64_t saved_T = rt.T[victim];
        rt.T[victim] = c % 2 ? rt.T_max + 1 : -1;
        for (int rank = 0; rank < rt.P; ++rank) {
            void *buf = sched_alloc(&lay, 0);
            int err = sched_build(&rt, &lay, buf, rank);
            CHECK(err == MOK_SCHED_ERR_TOKENS, "case %d: T = %lld on rank %d: rank %d's build returned %d", c,
                  (long long)rt.T[victim], victim, rank, err);
            free(buf);
        }
        rt.T[victim] = saved_T;
        routing_free(&rt);
    }
}

MOK_TEST(schedule_deterministic) {
    /* Same input, same bytes: twice into buffers with the same poison (every byte), and into
       buffers with different poison (every byte the build defines). */
    rng r = rng_for(4);
    const int cases = mok_test_quick() ? 10 : 40;
    for (int c = 0; c < cases; ++c) {
        routing rt;
        routing_random(&rt, &r, 1 + c % MAX_P, 300);
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        for (int rank = 0; rank < rt.P; ++rank) {
            void *a = sched_alloc(&lay, 0x11), *b = sched_alloc(&lay, 0x11), *d = sched_alloc(&lay, 0xEE);
            sched_build(&rt, &lay, a, rank);
            sched_build(&rt, &lay, b, rank);
            sched_build(&rt, &lay, d, rank);
            CHECK(memcmp(a, b, lay.bytes) == 0, "case %d rank %d: two builds differ", c, rank);
            mok_sched_view va = mok__sched_view(&lay, a), vd = mok__sched_view(&lay, d);
            const mok_sched_header *ha = va.header, *hd = vd.header;
            int same = ha->magic == hd->magic && ha->nranks == hd->nranks && ha->rank == hd->rank &&
                       ha->num_local_experts == hd->num_local_experts && ha->topk == hd->topk &&
                       ha->max_rows == hd->max_rows && ha->routed_rows == hd->routed_rows &&
                       ha->padded_rows == hd->padded_rows && ha->max_expert_rows == hd->max_expert_rows &&
                       ha->error == hd->error && memcmp(ha->num_tokens, hd->num_tokens, sizeof ha->num_tokens) == 0;
            int64_t rows = ha->padded_rows;
            same = same && memcmp(va.expert_start, vd.expert_start, sizeof(int64_t) * (size_t)(rt.L + 1)) == 0 &&
                   memcmp(va.expert_rows, vd.expert_rows, sizeof(int64_t) * (size_t)rt.L) == 0 &&
                   memcmp(va.counts, vd.counts, sizeof(int64_t) * (size_t)(rt.L * rt.P)) == 0 &&
                   memcmp(va.row_peer, vd.row_peer, sizeof(int32_t) * (size_t)rows) == 0 &&
                   memcmp(va.row_slot, vd.row_slot, sizeof(int32_t) * (size_t)rows) == 0 &&
                   memcmp(va.own_ids, vd.own_ids, sizeof(int32_t) * (size_t)(rt.T_max * rt.k)) == 0;
            CHECK(same, "case %d rank %d: the build depends on the buffer's previous contents", c, rank);
            free(a);
            free(b);
            free(d);
        }
        routing_free(&rt);
    }
}

MOK_TEST(schedule_row_expert_empty_experts) {
    /* mok__sched_row_expert on every row where many experts are empty: leading, trailing and
       runs of empty segments. */
    rng r = rng_for(5);
    const int cases = mok_test_quick() ? 20 : 100;
    for (int c = 0; c < cases; ++c) {
        routing rt;
        memset(&rt, 0, sizeof rt);
        rt.P = (int)rng_range(&r, 1, 4);
        rt.L = (int)rng_range(&r, 1, 6);
        rt.E = (int64_t)rt.P * rt.L;
        rt.k = 1;
        rt.T_max = 260;
        /* each local expert of rank 0 is empty or gets 1..260 rows from rank 0 */
        int64_t want[6] = {0};
        rt.T[0] = rt.T_max;
        for (int p = 0; p < rt.P; ++p) {
            rt.ids[p] = malloc(sizeof(int32_t) * (size_t)rt.T_max);
            for (int64_t t = 0; t < rt.T_max; ++t) rt.ids[p][t] = -1;
        }
        int64_t t = 0;
        for (int l = 0; l < rt.L; ++l) {
            int64_t n = rng_unit(&r) < 0.5 ? 0 : rng_range(&r, 1, 60);
            if (t + n > rt.T_max) n = rt.T_max - t;
            for (int64_t i = 0; i < n; ++i) rt.ids[0][t++] = l;
            want[l] = n;
        }
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        void *buf = sched_alloc(&lay, 0);
        CHECK(sched_build(&rt, &lay, buf, 0) == 0, "case %d: build failed", c);
        mok_sched_view v = mok__sched_view(&lay, buf);
        int64_t row = 0;
        for (int l = 0; l < rt.L; ++l) {
            CHECK(v.expert_rows[l] == want[l], "case %d: expert %d rows %lld, want %lld", c, l,
                  (long long)v.expert_rows[l], (long long)want[l]);
            for (int64_t i = 0; i < roundup(want[l], MOK_ROW_TILE); ++i, ++row) {
                int got = mok__sched_row_expert(&v, rt.L, row);
                CHECK(got == l, "case %d: row %lld belongs to expert %d, row_expert says %d", c, (long long)row, l, got);
                if (got != l) break;
            }
        }
        CHECK(row == v.header->padded_rows, "case %d: padded rows %lld, want %lld", c, (long long)v.header->padded_rows,
              (long long)row);
        check_schedule(&rt, &lay, buf, 0, "row_expert case");
        free(buf);
        routing_free(&rt);
    }
}

MOK_TEST(schedule_tasks_random_plans) {
    /* Every kind of pass, ring of 1, 2, 4 minibatches and more than all rows, with and without
       the shared expert, on schedules of random routings. */
    rng r = rng_for(6);
    const int cases = mok_test_quick() ? 80 : 200;
    int bad = 0;
    for (int c = 0; c < cases && bad < 8; ++c) {
        routing rt;
        routing_random(&rt, &r, 1 + c % MAX_P, 300);
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        int rank = (int)rng_range(&r, 0, rt.P - 1);
        void *buf = sched_alloc(&lay, 0);
        CHECK(sched_build(&rt, &lay, buf, rank) == 0, "case %d: build failed", c);
        bad += check_all_plans(&rt, &lay, buf, rank, &r, mok_test_quick() ? 1 : 3);
        free(buf);
        routing_free(&rt);
    }
}

MOK_TEST(schedule_tasks_zero_tokens) {
    /* T = 0 on this rank (only routed rows from peers; no shared tiles) and T = 0 everywhere (an
       empty pass: no routed tasks, only zeroing in bf16 mode). */
    rng r = rng_for(7);
    for (int all = 0; all < 2; ++all) {
        routing rt;
        routing_random(&rt, &r, 3, 200);
        for (int p = 0; p < rt.P; ++p)
            if (all || p == 1) rt.T[p] = 0;
        if (!all && rt.T[0] == 0) {
            rt.T[0] = rt.T_max;
            for (int64_t s = 0; s < rt.T_max * rt.k; ++s) rt.ids[0][s] = (int32_t)(s % rt.E);
        }
        mok_sched_layout lay;
        mok__sched_layout(&lay, rt.P, rt.L, rt.k, rt.T_max);
        void *buf = sched_alloc(&lay, 0);
        CHECK(sched_build(&rt, &lay, buf, 1) == 0, "build failed");
        check_schedule(&rt, &lay, buf, 1, all ? "T = 0 everywhere" : "T = 0 on rank 1");
        mok_sched_view v = mok__sched_view(&lay, buf);
        if (all) CHECK(v.header->padded_rows == 0, "T = 0 everywhere: %lld rows", (long long)v.header->padded_rows);
        check_all_plans(&rt, &lay, buf, 1, &r, 2);
        if (all) {
            /* the forward of an empty pass has nothing at all to do */
            plan_case fc = {0, 0, 0, 1, 256, 512, lay.max_rows, 0};
            mok_plan p = plan_from(&fc, &v, rt.L, 0, 128, 128, 128);
            mok_task tasks[4];
            CHECK(mok__tasks_build(&p, tasks, 4) == 0, "empty forward has tasks");
            plan_case bc = {1, 0, 0, 1, 256, 512, lay.max_rows, 0};
            p = plan_from(&bc, &v, rt.L, 0, 128, 128, 128);
            mok_task *bt = malloc(sizeof(mok_task) * 4096);
            int64_t n = mok__tasks_build(&p, bt, 4096);
            int zeros = 0, others = 0;
            for (int64_t i = 0; i < n; ++i) {
                if (bt[i].kind == MOK_TASK_WGRAD_ZERO) ++zeros;
                else if (bt[i].kind != MOK_TASK_SHARED_WGRAD) ++others;
            }
            CHECK(zeros == rt.L && others == 0, "empty backward: %d zeroing tasks (want %d), %d others", zeros, rt.L,
                  others);
            free(bt);
        }
        free(buf);
        routing_free(&rt);
    }
}

/* Index of the first task matching (kind, minibatch or macrobatch); from the end if last. */
static int64_t find_task(const mok_task *tasks, int64_t n, int kind, int minibatch, int last) {
    if (last) {
        for (int64_t i = n - 1; i >= 0; --i)
            if (tasks[i].kind == kind && tasks[i].minibatch == minibatch) return i;
    } else {
        for (int64_t i = 0; i < n; ++i)
            if (tasks[i].kind == kind && tasks[i].minibatch == minibatch) return i;
    }
    return -1;
}

/* The last task of `kind` for row tile `a`, or -1. */
static int64_t find_last_of_tile(const mok_task *tasks, int64_t n, int kind, int a) {
    for (int64_t i = n - 1; i >= 0; --i)
        if (tasks[i].kind == kind && tasks[i].a == a) return i;
    return -1;
}

static void swap_tasks(mok_task *tasks, int64_t i, int64_t j) {
    mok_task t = tasks[i];
    tasks[i] = tasks[j];
    tasks[j] = t;
}

MOK_TEST(schedule_tasks_broken_list) {
    /* A list with two dependent tasks swapped must be flagged by mok__tasks_check at the first
       task that now waits on a later one; a compute task moved ahead of the compute task it
       needs must also deadlock the one-worker simulator. */
    routing rt;
    memset(&rt, 0, sizeof rt);
    rt.P = 2;
    rt.L = 2;
    rt.E = 4;
    rt.k = 2;
    rt.T_max = 300;
    for (int p = 0; p < 2; ++p) {
        rt.T[p] = 300;
        rt.ids[p] = malloc(sizeof(int32_t) * 600);
        for (int s = 0; s < 600; ++s) rt.ids[p][s] = s % 4; /* 150 rows per expert per peer */
    }
    mok_sched_layout lay;
    mok__sched_layout(&lay, 2, 2, 2, 300);
    void *buf = sched_alloc(&lay, 0);
    CHECK(sched_build(&rt, &lay, buf, 0) == 0, "build failed");
    mok_sched_view v = mok__sched_view(&lay, buf);
    CHECK(v.header->padded_rows == 768, "padded rows %lld", (long long)v.header->padded_rows);

    plan_case fc = {0, 0, 0, 0, 256, 512, lay.max_rows, 0};
    mok_plan p = plan_from(&fc, &v, 2, 300, 128, 128, 0);
    mok_counters_layout CL;
    mok__counters_layout(&p, &CL);
    int64_t cap = mok__tasks_max(&p, lay.max_rows, 300);
    mok_task *tasks = malloc(sizeof(mok_task) * (size_t)cap);
    int64_t n = mok__tasks_build(&p, tasks, cap);
    int64_t *scratch = malloc(sizeof(int64_t) * (size_t)CL.total);
    CHECK(n > 0 && mok__tasks_check(tasks, n, CL.total, scratch) == 0, "the good list is flagged");
    const int one[2] = {1, 1};
    CHECK(simulate(tasks, n, CL.total, one, NULL, NULL), "the good list deadlocks");

    /* 1. the first GATEUP of minibatch 0 ahead of the DISPATCH it waits for (two roles) */
    int64_t d = find_task(tasks, n, MOK_TASK_DISPATCH, 0, 0), g = find_task(tasks, n, MOK_TASK_GATEUP, 0, 0);
    CHECK(d >= 0 && g > d, "dispatch %lld, gateup %lld", (long long)d, (long long)g);
    swap_tasks(tasks, d, g);
    int64_t got = mok__tasks_check(tasks, n, CL.total, scratch);
    CHECK(got == d + 1, "GATEUP moved to %lld: check says %lld", (long long)d, (long long)got - 1);
    swap_tasks(tasks, d, g);

    /* 2. the first DOWN of minibatch 0 ahead of the last GATEUP of its row tile (one role). A down
       tile waits only for its own rows' gate/up tiles: moving it ahead of the last GATEUP of the
       minibatch, another row tile here, breaks nothing. */
    int64_t fd = find_task(tasks, n, MOK_TASK_DOWN, 0, 0);
    int64_t lg = find_last_of_tile(tasks, n, MOK_TASK_GATEUP, tasks[fd].a);
    int64_t lgm = find_task(tasks, n, MOK_TASK_GATEUP, 0, 1);
    CHECK(lg >= 0 && fd > lg, "last gateup of the tile %lld, first down %lld", (long long)lg, (long long)fd);
    CHECK(lgm > lg && tasks[lgm].a != tasks[fd].a, "minibatch 0 has one row tile only");
    swap_tasks(tasks, lgm, fd);
    CHECK(mok__tasks_check(tasks, n, CL.total, scratch) == 0, "a DOWN waits on another row tile's GATEUP");
    swap_tasks(tasks, lgm, fd);
    swap_tasks(tasks, lg, fd);
    got = mok__tasks_check(tasks, n, CL.total, scratch);
    CHECK(got == lg + 1, "DOWN moved to %lld: check says %lld", (long long)lg, (long long)got - 1);
    int64_t executed = 0;
    CHECK(!simulate(tasks, n, CL.total, one, NULL, &executed),
          "a compute task waiting on a later compute task does not deadlock one compute worker");
    CHECK(executed < n, "executed %lld of %lld", (long long)executed, (long long)n);
    swap_tasks(tasks, lg, fd);

    /* 3. the first COMBINE of minibatch 0 ahead of the last DOWN of its row tile */
    int64_t fc0 = find_task(tasks, n, MOK_TASK_COMBINE, 0, 0);
    int64_t ld = find_last_of_tile(tasks, n, MOK_TASK_DOWN, tasks[fc0].a);
    swap_tasks(tasks, ld, fc0);
    CHECK(mok__tasks_check(tasks, n, CL.total, scratch) == ld + 1, "COMBINE ahead of DOWN not flagged at %lld",
          (long long)ld);
    swap_tasks(tasks, ld, fc0);
    /* 4. a wait on a counter that does not exist */
    tasks[n - 1].wait[1] = (int32_t)CL.total;
    tasks[n - 1].target[1] = 0;
    CHECK(mok__tasks_check(tasks, n, CL.total, scratch) == n, "wait on counter %lld not flagged", (long long)CL.total);
    free(tasks);
    free(scratch);

    /* backward: a WGRAD of macrobatch 0 ahead of the last DH of macrobatch 0 */
    plan_case bc = {1, 0, 0, 0, 256, 512, lay.max_rows, 0};
    p = plan_from(&bc, &v, 2, 300, 128, 128, 0);
    mok__counters_layout(&p, &CL);
    cap = mok__tasks_max(&p, lay.max_rows, 300);
    tasks = malloc(sizeof(mok_task) * (size_t)cap);
    scratch = malloc(sizeof(int64_t) * (size_t)CL.total);
    n = mok__tasks_build(&p, tasks, cap);
    CHECK(n > 0 && mok__tasks_check(tasks, n, CL.total, scratch) == 0, "the good backward list is flagged");
    int64_t w = find_task(tasks, n, MOK_TASK_WGRAD, 0, 0), dh = find_task(tasks, n, MOK_TASK_DH, 1, 1);
    CHECK(w > dh && dh >= 0, "wgrad %lld, last dh of macrobatch 0 %lld", (long long)w, (long long)dh);
    swap_tasks(tasks, w, dh);
    CHECK(mok__tasks_check(tasks, n, CL.total, scratch) == dh + 1, "WGRAD ahead of DH not flagged at %lld",
          (long long)dh);
    CHECK(!simulate(tasks, n, CL.total, one, NULL, NULL), "WGRAD ahead of its DH does not deadlock one compute worker");
    swap_tasks(tasks, w, dh);
    /* a PULL of macrobatch 1 ahead of the macrobatch 0 weight gradients it waits for */
    int64_t pull1 = find_task(tasks, n, MOK_TASK_PULL, 2, 0);
    CHECK(pull1 > w, "pull of minibatch 2 at %lld, first wgrad at %lld", (long long)pull1, (long long)w);
    mok_task moved = tasks[pull1];
    memmove(tasks + w + 1, tasks + w, sizeof(mok_task) * (size_t)(pull1 - w));
    tasks[w] = moved;
    CHECK(mok__tasks_check(tasks, n, CL.total, scratch) == w + 1, "PULL ahead of WGRAD not flagged at %lld",
          (long long)w);
    free(tasks);
    free(scratch);
    free(buf);
    routing_free(&rt);
}

/* ---- transfer directions: lists that name peers ------------------------------------------- */

/* Lists that name peers, built on every rank of a routing: the forward with combine_pull and/or
 * dispatch_push, or the backward with dispatch_pull. Each list holds one GATHER (SCATTER) per row
 * tile of every rank, its own included, and none of the tasks they replace (COMBINE, PUSH,
 * DISPATCH); the lists run together to the end with one worker per role per rank. Moving one
 * rank's first GATHER or SCATTER of its own tiles behind all its other tasks must deadlock (a
 * refill, or its own gate/up, waits on it). Returns failed checks. */
enum { LISTS_FWD_GATHER = 1, LISTS_FWD_SCATTER = 2, LISTS_BWD_GATHER = 4, LISTS_BWD_SCATTER = 8, LISTS_BWD = 16 };

static int count_peer_tasks(const mok_task *tasks, int64_t n, int kind, int q, int64_t tile) {
    int seen = 0;
    for (int64_t i = 0; i < n; ++i) seen += tasks[i].kind == kind && tasks[i].peer == q && tasks[i].a == tile;
    return seen;
}

/* Whether task t (of rank `owner`) reads or writes the ring of rank `ring_rank` for minibatch mb,
 * whose row tile `tile` a refill overwrites (a weight-gradient task reads its expert's rows of its
 * macrobatch: start and rows are the owner's expert_start and expert_rows). */
static int uses_ring(const mok_task *t, int owner, int ring_rank, int64_t mb, int ring_mbs, int64_t tile,
                     const int64_t *start, const int64_t *rows) {
    int64_t a;
    if (uses_tile(t, &a)) return owner == ring_rank && t->minibatch == mb; /* minibatch granularity */
    switch (t->kind) {
    case MOK_TASK_WGRAD:
        return owner == ring_rank && t->minibatch == mb / ring_mbs &&
               start[t->expert] < (tile + 1) * MOK_ROW_TILE && start[t->expert] + rows[t->expert] > tile * MOK_ROW_TILE;
    case MOK_TASK_GATHER: case MOK_TASK_SCATTER: return t->peer == ring_rank && t->minibatch == mb;
    default: return 0;
    }
}

/* on_run of mok__tasks_check_ranks: every task that writes a ring slot (DISPATCH, PULL, SCATTER
 * into minibatch mb >= ring_mbs) must find every task that uses the slot's previous occupant
 * (minibatch mb - ring_mbs, on that ring's rank) done; counts the writes that would overwrite
 * rows still in use. */
typedef struct ring_watch {
    int P, ring_mbs;
    int64_t ring_tiles;
    const mok_sched_view *v;
    mok_task *const *tasks;
    const int64_t *counts;
    char *done[MAX_P];
    int64_t overwrites;
} ring_watch;

static void watch_ring(void *ctx, int r, int64_t index) {
    ring_watch *w = ctx;
    const mok_task *t = &w->tasks[r][index];
    const int writes = t->kind == MOK_TASK_DISPATCH || t->kind == MOK_TASK_PULL || t->kind == MOK_TASK_SCATTER;
    if (writes && t->minibatch >= w->ring_mbs) {
        const int ring_rank = t->kind == MOK_TASK_SCATTER ? t->peer : r;
        int in_use = 0;
        for (int q = 0; q < w->P && !in_use; ++q)
            for (int64_t j = 0; j < w->counts[q] && !in_use; ++j)
                in_use = !w->done[q][j] &&
                         uses_ring(&w->tasks[q][j], q, ring_rank, t->minibatch - w->ring_mbs, w->ring_mbs,
                                   t->a - w->ring_tiles, w->v[q].expert_start, w->v[q].expert_rows);
        w->overwrites += in_use;
    }
    w->done[r][index] = 1;
}

static int check_peer_lists(const routing *rt, int mode, int mb_tiles_per_mb, int ring_mbs, const char *what) {
    const int P = rt->P, backward = (mode & (LISTS_BWD_GATHER | LISTS_BWD_SCATTER | LISTS_BWD)) != 0;
    mok_sched_layout lay;
    mok__sched_layout(&lay, P, rt->L, rt->k, rt->T_max);
    void *buf[MAX_P];
    mok_sched_view v[MAX_P];
    int64_t padded[MAX_P];
    for (int r = 0; r < P; ++r) {
        buf[r] = sched_alloc(&lay, 0xA5);
        sched_build(rt, &lay, buf[r], r);
        v[r] = mok__sched_view(&lay, buf[r]);
        padded[r] = v[r].header->padded_rows;
    }
    plan_case c = {0};
    c.minibatch_rows = mb_tiles_per_mb * MOK_ROW_TILE;
    c.ring_rows = c.minibatch_rows * ring_mbs;
    c.context_rows = lay.max_rows;
    c.shared = 1;
    c.backward = backward;
    const int gathers = mode & (LISTS_FWD_GATHER | LISTS_BWD_GATHER), scatters = mode & (LISTS_FWD_SCATTER | LISTS_BWD_SCATTER);
    mok_task *tasks[MAX_P];
    int64_t counts[MAX_P], ncounters[MAX_P], *counters[MAX_P], total = 0;
    int bad = 0, in_place = 0;
    for (int r = 0; r < P; ++r) {
        mok_plan p = plan_from(&c, &v[r], rt->L, rt->T[r], 128, 128, 128);
        p.combine_pull = (mode & LISTS_FWD_GATHER) != 0;
        p.dispatch_push = (mode & LISTS_FWD_SCATTER) != 0;
        p.dispatch_pull = (mode & LISTS_BWD_GATHER) != 0;
        p.combine_push = (mode & LISTS_BWD_SCATTER) != 0;
        p.nranks = P;
        p.rank = r;
        p.peer_padded_rows = padded;
        in_place = mok__plan_in_place(&p); /* one rank: no combine (push) after the down (dx) tiles */
        mok_counters_layout CL;
        mok__counters_layout(&p, &CL);
        const int64_t cap = mok__tasks_max(&p, lay.max_rows, rt->T_max);
        tasks[r] = malloc(sizeof(mok_task) * (size_t)(cap + 1));
        counts[r] = mok__tasks_build(&p, tasks[r], cap);
        CHECK(counts[r] >= 0, "%s: rank %d: the list exceeds its bound %lld", what, r, (long long)cap);
        if (counts[r] < 0) counts[r] = 0;
        CHECK(CL.total <= mok__counters_max(&p, lay.max_rows, rt->T_max), "%s: rank %d: counters over the bound",
              what, r);
        ncounters[r] = CL.total;
        counters[r] = malloc(sizeof(int64_t) * (size_t)(CL.total + 1));
        total += counts[r];
        for (int q = 0; q < P; ++q)
            for (int64_t t = 0; t < padded[q] / MOK_ROW_TILE; ++t) {
                const int g = count_peer_tasks(tasks[r], counts[r], MOK_TASK_GATHER, q, t);
                const int sc = count_peer_tasks(tasks[r], counts[r], MOK_TASK_SCATTER, q, t);
                CHECK(g == (gathers != 0) && sc == (scatters != 0),
                      "%s: rank %d: rank %d's tile %lld gathered %d and scattered %d times", what, r, q, (long long)t, g,
                      sc);
                bad += g != (gathers != 0) || sc != (scatters != 0);
            }
        for (int64_t i = 0; i < counts[r]; ++i) {
            const int kind = tasks[r][i].kind;
            const int replaced = (kind == MOK_TASK_COMBINE && (mode & LISTS_FWD_GATHER)) ||
                                 (kind == MOK_TASK_PUSH && (mode & LISTS_BWD_GATHER)) ||
                                 (kind == MOK_TASK_DISPATCH && (mode & LISTS_FWD_SCATTER)) ||
                                 (kind == MOK_TASK_PULL && (mode & LISTS_BWD_SCATTER));
            CHECK(!replaced, "%s: rank %d: a %s in a list that replaces it", what, r, mok__task_kind_name(kind));
            bad += replaced;
        }
    }
    ring_watch watch = {P, ring_mbs, (int64_t)c.ring_rows / MOK_ROW_TILE, v, tasks, counts, {0}, 0};
    for (int r = 0; r < P; ++r) watch.done[r] = calloc((size_t)counts[r] + 1, 1);
    int64_t ran = mok__tasks_check_ranks(P, (const mok_task *const *)tasks, counts, ncounters, counters, watch_ring,
                                         &watch);
    CHECK(ran == total, "%s: the ranks' lists deadlock after %lld of %lld tasks", what, (long long)ran, (long long)total);
    bad += ran != total;
    CHECK(watch.overwrites == 0, "%s: %lld ring writes overwrite rows still in use", what, (long long)watch.overwrites);
    bad += watch.overwrites != 0;
    for (int r = 0; r < P; ++r) free(watch.done[r]);
    /* rank 0's first GATHER (or SCATTER) of its own tiles moved last: a refill (or its gate/up)
       that waits on it then blocks the comm tasks before it; in place with no refill, no comm task
       waits on it (nor on what waits on it) */
    const int moved_kind = scatters ? MOK_TASK_SCATTER : MOK_TASK_GATHER, refill = backward ? MOK_TASK_PULL : MOK_TASK_DISPATCH;
    int64_t first = -1, refills = 0;
    for (int64_t i = 0; i < counts[0]; ++i) {
        if (tasks[0][i].kind == moved_kind && first < 0 && tasks[0][i].peer == 0) first = i;
        const int kind = tasks[0][i].kind; /* a backward's scatters wait on their OPEN, the refill */
        refills += (kind == refill || kind == MOK_TASK_OPEN || (kind == MOK_TASK_SCATTER && !backward)) &&
                   tasks[0][i].wait[0] >= 0;
    }
    if (first >= 0 && ((scatters && !in_place) || refills > 0)) {
        mok_task moved = tasks[0][first];
        memmove(&tasks[0][first], &tasks[0][first + 1], sizeof(mok_task) * (size_t)(counts[0] - first - 1));
        tasks[0][counts[0] - 1] = moved;
        ran = mok__tasks_check_ranks(P, (const mok_task *const *)tasks, counts, ncounters, counters, NULL, NULL);
        CHECK(ran < total, "%s: rank 0's first %s of its own tiles, moved last, is not a deadlock", what,
              mok__task_kind_name(moved_kind));
        bad += ran >= total;
    }
    for (int r = 0; r < P; ++r) {
        free(tasks[r]);
        free(counters[r]);
        free(buf[r]);
    }
    return bad;
}

MOK_TEST(schedule_peer_lists_ranks) {
    rng r = rng_for(7);
    const int cases = mok_test_quick() ? 40 : 120;
    int failures = 0;
    for (int c = 0; c < cases && failures < 8; ++c) {
        routing rt;
        routing_random(&rt, &r, 1 + c % MAX_P, 700);
        char what[128];
        const int mb = (int)rng_range(&r, 1, 2), ring = (int)rng_range(&r, 1, 3);
        snprintf(what, sizeof what, "case %d (P %d E_local %d k %d T_max %lld mb %d ring %d)", c, rt.P, rt.L, rt.k,
                 (long long)rt.T_max, mb * MOK_ROW_TILE, ring);
        static const struct {
            int mode;
            const char *name;
        } modes[] = {{0, "forward, default transfers"},
                     {LISTS_BWD, "backward, default transfers"},
                     {LISTS_FWD_GATHER, "forward, pulled combine"},
                     {LISTS_FWD_SCATTER, "forward, pushed dispatch"},
                     {LISTS_FWD_GATHER | LISTS_FWD_SCATTER, "forward, both"},
                     {LISTS_BWD_GATHER, "backward, pulled reverse-dispatch"},
                     {LISTS_BWD_SCATTER, "backward, pushed reverse-combine"},
                     {LISTS_BWD_GATHER | LISTS_BWD_SCATTER, "backward, both"}};
        for (size_t m = 0; m < sizeof modes / sizeof modes[0]; ++m) {
            char tag[192];
            snprintf(tag, sizeof tag, "%s: %s", what, modes[m].name);
            failures += check_peer_lists(&rt, modes[m].mode, mb, ring, tag);
        }
        routing_free(&rt);
    }
}
