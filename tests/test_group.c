/* test_group.c — the one-process-per-rank path of the cpu backend: P threads each call
 * mok_group_create with the same unique id and drive one rank, as P processes would on GPUs.
 *
 * What must hold: the results are bitwise those of the same layer driven by one thread in local
 * mode (mok_group_create_local); a missing or silent peer is a MOK_ERR_TIMEOUT within the
 * configured time, after which the workspace refuses work (MOK_ERR_STATE); shapes that differ
 * across ranks are an argument error on every rank; a rank that rejects its own arguments
 * makes its peers fail fast with a message that says so, not wait for a timeout; and groups
 * and workspaces can be created and destroyed many times.
 *
 * The layer is tiny: H = I = I_s = 64, E = 2P (E must divide by P), k = 2, T_max = 40. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/schedule.h"
#include "mok.h"
#include "test.h"

#define GMAX 3 /* ranks at most */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- a tiny random layer for P ranks -------------------------------------------------------- */

typedef struct glayer {
    mok_shape shape;
    int P;
    int64_t T[GMAX];
    uint16_t *x[GMAX], *dy[GMAX];
    int32_t *ids[GMAX];
    float *rw[GMAX];
    uint16_t *w[3][GMAX]; /* gate, up [E_local, I, H]; down [E_local, H, I] */
    uint16_t *s[3];       /* shared, one copy for all ranks */
    float *acc_start[3][GMAX], *sacc_start[3]; /* accumulate mode: fp32 starting values */
} glayer;

/* Everything a run writes, per rank. */
typedef struct gout {
    void *sched[GMAX], *ctx[GMAX];
    uint16_t *y[GMAX], *dx[GMAX];
    float *drw[GMAX], *drw_acc[GMAX];
    uint16_t *dw[3][GMAX], *ds[3][GMAX]; /* bf16 mode */
    float *dwa[3][GMAX], *dsa[3][GMAX];  /* accumulate mode */
    uint16_t *dx_acc[GMAX];
    size_t sched_bytes, ctx_bytes;
} gout;

static uint64_t mix(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float unit(uint64_t *state) { return (float)((double)(mix(state) >> 11) / 4503599627370496.0 - 1.0); }

static void *alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded ? rounded : 64);
}

static uint16_t *random_bf16(uint64_t *st, size_t n, float scale) {
    if (n == 0) return NULL;
    uint16_t *v = alloc_aligned(n * 2);
    for (size_t i = 0; i < n; ++i) {
        float f = scale * unit(st);
        v[i] = mok_bf16_from_float(f == 0.0f ? scale / 3 : f);
    }
    return v;
}

static float *random_f32(uint64_t *st, size_t n) {
    float *v = alloc_aligned(n * 4);
    for (size_t i = 0; i < n; ++i) v[i] = unit(st);
    return v;
}

static mok_shape gshape(int P, int64_t hidden) {
    mok_shape s = {hidden, 64, 2 * P, 2, 64, 40, MOK_PRECISION_BF16};
    return s;
}

static void glayer_make(glayer *L, const mok_shape *shape, int P, const int64_t *T, uint64_t salt) {
    memset(L, 0, sizeof *L);
    uint64_t st = mok_test_seed() * 0x2545f4914f6cdd1dull + salt;
    L->shape = *shape;
    L->P = P;
    const int64_t H = shape->hidden, I = shape->intermediate, Is = shape->shared_intermediate, k = shape->topk;
    const int64_t El = shape->num_experts / P;
    for (int p = 0; p < P; ++p) {
        L->T[p] = T[p];
        L->x[p] = random_bf16(&st, (size_t)(T[p] * H), 1.0f);
        L->dy[p] = random_bf16(&st, (size_t)(T[p] * H), 1.0f);
        L->ids[p] = T[p] ? alloc_aligned(sizeof(int32_t) * (size_t)(T[p] * k)) : NULL;
        L->rw[p] = T[p] ? alloc_aligned(sizeof(float) * (size_t)(T[p] * k)) : NULL;
        for (int64_t t = 0; t < T[p]; ++t)
            for (int64_t j = 0; j < k; ++j) {
                int32_t e;
                int again;
                do {
                    e = (int32_t)(mix(&st) % (uint64_t)shape->num_experts);
                    again = 0;
                    for (int64_t q = 0; q < j; ++q) again |= L->ids[p][t * k + q] == e;
                } while (again);
                if (t % 7 == 2 && j == 0) e = -1; /* some empty slots */
                L->ids[p][t * k + j] = e;
                L->rw[p][t * k + j] = unit(&st);
            }
        L->w[0][p] = random_bf16(&st, (size_t)(El * I * H), 0.125f);
        L->w[1][p] = random_bf16(&st, (size_t)(El * I * H), 0.125f);
        L->w[2][p] = random_bf16(&st, (size_t)(El * H * I), 0.125f);
        for (int m = 0; m < 3; ++m) L->acc_start[m][p] = random_f32(&st, (size_t)(El * I * H));
    }
    L->s[0] = random_bf16(&st, (size_t)(Is * H), 0.125f);
    L->s[1] = random_bf16(&st, (size_t)(Is * H), 0.125f);
    L->s[2] = random_bf16(&st, (size_t)(H * Is), 0.125f);
    for (int m = 0; m < 3; ++m) L->sacc_start[m] = random_f32(&st, (size_t)(Is * H));
}

static void glayer_free(glayer *L) {
    for (int p = 0; p < L->P; ++p) {
        free(L->x[p]);
        free(L->dy[p]);
        free(L->ids[p]);
        free(L->rw[p]);
        for (int m = 0; m < 3; ++m) free(L->w[m][p]), free(L->acc_start[m][p]);
    }
    for (int m = 0; m < 3; ++m) free(L->s[m]), free(L->sacc_start[m]);
    memset(L, 0, sizeof *L);
}

/* Output buffers of rank p, poisoned (bf16 0x7fc1, fp32 NaN; schedule zeros, context 0x5a), and
 * accumulate-mode buffers holding the layer's starting values. */
static void gout_alloc_rank(gout *o, const glayer *L, int p, const mok_sizes *sz) {
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / L->P, k = L->shape.topk, T = L->T[p];
    o->sched_bytes = sz->schedule_bytes;
    o->ctx_bytes = sz->context_bytes;
    o->sched[p] = alloc_aligned(sz->schedule_bytes);
    memset(o->sched[p], 0, sz->schedule_bytes);
    o->ctx[p] = alloc_aligned(sz->context_bytes);
    memset(o->ctx[p], 0x5a, sz->context_bytes);
    o->y[p] = alloc_aligned((size_t)(T * H) * 2);
    o->dx[p] = alloc_aligned((size_t)(T * H) * 2);
    o->dx_acc[p] = alloc_aligned((size_t)(T * H) * 2);
    for (int64_t i = 0; i < T * H; ++i) o->y[p][i] = o->dx[p][i] = o->dx_acc[p][i] = 0x7fc1;
    o->drw[p] = alloc_aligned((size_t)(T * k) * 4);
    o->drw_acc[p] = alloc_aligned((size_t)(T * k) * 4);
    for (int64_t i = 0; i < T * k; ++i) o->drw[p][i] = o->drw_acc[p][i] = NAN;
    for (int m = 0; m < 3; ++m) {
        size_t nw = (size_t)(El * I * H), ns = (size_t)(Is * H);
        o->dw[m][p] = alloc_aligned(nw * 2);
        for (size_t i = 0; i < nw; ++i) o->dw[m][p][i] = 0x7fc1;
        o->ds[m][p] = alloc_aligned(ns * 2);
        for (size_t i = 0; i < ns; ++i) o->ds[m][p][i] = 0x7fc1;
        o->dwa[m][p] = alloc_aligned(nw * 4);
        memcpy(o->dwa[m][p], L->acc_start[m][p], nw * 4);
        o->dsa[m][p] = alloc_aligned(ns * 4);
        memcpy(o->dsa[m][p], L->sacc_start[m], ns * 4);
    }
}

static void gout_free(gout *o, int P) {
    for (int p = 0; p < P; ++p) {
        free(o->sched[p]);
        free(o->ctx[p]);
        free(o->y[p]);
        free(o->dx[p]);
        free(o->dx_acc[p]);
        free(o->drw[p]);
        free(o->drw_acc[p]);
        for (int m = 0; m < 3; ++m) free(o->dw[m][p]), free(o->ds[m][p]), free(o->dwa[m][p]), free(o->dsa[m][p]);
    }
    memset(o, 0, sizeof *o);
}

static mok_schedule_args sched_arg(const glayer *L, gout *o, int p) {
    return (mok_schedule_args){L->T[p], L->ids[p], o->sched[p], NULL};
}

static mok_forward_args fwd_arg(const glayer *L, gout *o, int p) {
    return (mok_forward_args){L->T[p], o->sched[p], L->x[p], L->rw[p], L->w[0][p], L->w[1][p], L->w[2][p],
                              L->s[0], L->s[1], L->s[2], o->y[p], o->ctx[p], NULL, NULL};
}

static mok_backward_args bwd_arg(const glayer *L, gout *o, int p, int accumulate) {
    mok_backward_args a;
    memset(&a, 0, sizeof a);
    a.num_tokens = L->T[p];
    a.schedule = o->sched[p];
    a.context = o->ctx[p];
    a.dy = L->dy[p];
    a.x = L->x[p];
    a.router_w = L->rw[p];
    a.w_gate = L->w[0][p];
    a.w_up = L->w[1][p];
    a.w_down = L->w[2][p];
    a.s_gate = L->s[0];
    a.s_up = L->s[1];
    a.s_down = L->s[2];
    a.accumulate = accumulate;
    a.dx = accumulate ? o->dx_acc[p] : o->dx[p];
    a.d_router_w = accumulate ? o->drw_acc[p] : o->drw[p];
    if (accumulate) {
        a.dw_gate = o->dwa[0][p], a.dw_up = o->dwa[1][p], a.dw_down = o->dwa[2][p];
        a.ds_gate = o->dsa[0][p], a.ds_up = o->dsa[1][p], a.ds_down = o->dsa[2][p];
    } else {
        a.dw_gate = o->dw[0][p], a.dw_up = o->dw[1][p], a.dw_down = o->dw[2][p];
        a.ds_gate = o->ds[0][p], a.ds_up = o->ds[1][p], a.ds_down = o->ds[2][p];
    }
    return a;
}

static mok_config gconfig(double timeout_ms) {
    mok_config c = MOK_CONFIG_INIT;
    c.minibatch_rows = 128;
    c.ring_rows = 128;
    c.cpu_threads = 2;
    c.cpu_comm_threads = 1;
    c.peer_timeout_ms = timeout_ms;
    return c;
}

/* ---- local mode: the expected results -------------------------------------------------------- */

static int run_local(const glayer *L, const mok_config *cfg, gout *o) {
    const int P = L->P;
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    mok_status st = mok_group_create_local(&g, MOK_BACKEND_CPU, P, NULL, cfg);
    CHECK(st == MOK_OK, "local group: %s", mok_last_error());
    if (st == MOK_OK) st = mok_workspace_create(&ws, g, &L->shape, NULL);
    CHECK(st == MOK_OK, "local workspace: %s", mok_last_error());
    if (st != MOK_OK) {
        mok_group_destroy(g);
        return 0;
    }
    mok_sizes sz;
    mok_workspace_sizes(ws, &sz);
    for (int p = 0; p < P; ++p) gout_alloc_rank(o, L, p, &sz);
    mok_schedule_args sa[GMAX];
    mok_forward_args fa[GMAX];
    mok_backward_args ba[GMAX], bacc[GMAX];
    for (int p = 0; p < P; ++p) {
        sa[p] = sched_arg(L, o, p);
        fa[p] = fwd_arg(L, o, p);
        ba[p] = bwd_arg(L, o, p, 0);
        bacc[p] = bwd_arg(L, o, p, 1);
    }
    int ok = 1;
    st = mok_schedule_build(ws, sa);
    CHECK(st == MOK_OK, "local schedule: %s", mok_last_error());
    if (st == MOK_OK) {
        st = mok_forward(ws, fa);
        CHECK(st == MOK_OK, "local forward: %s", mok_last_error());
    }
    if (st == MOK_OK) {
        st = mok_backward(ws, ba);
        CHECK(st == MOK_OK, "local backward: %s", mok_last_error());
    }
    if (st == MOK_OK) {
        st = mok_backward(ws, bacc);
        CHECK(st == MOK_OK, "local backward (accumulate): %s", mok_last_error());
    }
    ok = st == MOK_OK;
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
    return ok;
}

/* ---- per-rank mode: one thread per rank -------------------------------------------------------- */

typedef struct rank_ctx {
    int rank, P;
    const mok_unique_id *id;
    mok_config cfg;
    mok_shape shape; /* this rank's shape (may differ from the layer's on purpose) */
    const glayer *L;
    gout *o;
    pthread_barrier_t *barrier; /* the test's own rendezvous between phases */
    int scenario;
    /* results */
    mok_status status[8];
    char message[8][512];
    double seconds[8];
    pthread_mutex_t *alloc_lock;
    struct rank_ctx *all; /* every rank's context (read only after a test barrier) */
} rank_ctx;

enum {
    SCENARIO_FULL = 0,     /* schedule, forward, backward, backward (accumulate) */
    SCENARIO_SILENT_PEER,  /* rank 1 never calls forward */
    SCENARIO_SHAPES,       /* workspaces with different shapes, then a good one */
    SCENARIO_BAD_FORWARD,  /* rank 1: forward with T > T_max; rank 0: good; then both good */
    SCENARIO_BAD_SCHEDULE, /* the same with mok_schedule_build */
    SCENARIO_LATE_REJECT,  /* rank 1: forward with a T other than its schedule's (within T_max) */
    SCENARIO_BAD_IDS       /* rank 1: an expert id >= E in its topk_ids */
};

static void record(rank_ctx *c, int step, mok_status st, double start) {
    c->status[step] = st;
    c->seconds[step] = now_s() - start;
    snprintf(c->message[step], sizeof c->message[step], "%s", st == MOK_OK ? "" : mok_last_error());
}

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    const glayer *L = c->L;
    const int r = c->rank;
    for (int i = 0; i < 8; ++i) c->status[i] = (mok_status)-1;
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    double t0 = now_s();
    mok_status st = mok_group_create(&g, MOK_BACKEND_CPU, c->P, r, c->id, 0, &c->cfg);
    record(c, 0, st, t0);
    if (st != MOK_OK) return NULL;
    t0 = now_s();
    st = mok_workspace_create(&ws, g, &c->shape, NULL);
    record(c, 1, st, t0);
    if (c->scenario == SCENARIO_SHAPES) {
        /* after the mismatch, a workspace of the common shape must still work */
        if (st == MOK_OK) mok_workspace_destroy(ws);
        ws = NULL;
        t0 = now_s();
        st = mok_workspace_create(&ws, g, &L->shape, NULL);
        record(c, 2, st, t0);
        if (st == MOK_OK) {
            mok_sizes sz;
            mok_workspace_sizes(ws, &sz);
            pthread_mutex_lock(c->alloc_lock);
            gout_alloc_rank(c->o, L, r, &sz);
            pthread_mutex_unlock(c->alloc_lock);
            mok_schedule_args sa = sched_arg(L, c->o, r);
            mok_forward_args fa = fwd_arg(L, c->o, r);
            t0 = now_s();
            st = mok_schedule_build(ws, &sa);
            if (st == MOK_OK) st = mok_forward(ws, &fa);
            record(c, 3, st, t0);
        }
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
        return NULL;
    }
    if (st != MOK_OK) {
        mok_group_destroy(g);
        return NULL;
    }
    mok_sizes sz;
    mok_workspace_sizes(ws, &sz);
    pthread_mutex_lock(c->alloc_lock);
    gout_alloc_rank(c->o, L, r, &sz);
    pthread_mutex_unlock(c->alloc_lock);
    mok_schedule_args sa = sched_arg(L, c->o, r);
    mok_forward_args fa = fwd_arg(L, c->o, r);
    mok_backward_args ba = bwd_arg(L, c->o, r, 0), bacc = bwd_arg(L, c->o, r, 1);

    switch (c->scenario) {
    case SCENARIO_FULL:
        t0 = now_s();
        record(c, 2, mok_schedule_build(ws, &sa), t0);
        t0 = now_s();
        if (c->status[2] == MOK_OK) record(c, 3, mok_forward(ws, &fa), t0);
        t0 = now_s();
        if (c->status[3] == MOK_OK) record(c, 4, mok_backward(ws, &ba), t0);
        t0 = now_s();
        if (c->status[4] == MOK_OK) record(c, 5, mok_backward(ws, &bacc), t0);
        break;
    case SCENARIO_SILENT_PEER:
        t0 = now_s();
        record(c, 2, mok_schedule_build(ws, &sa), t0);
        if (r == 0 && c->status[2] == MOK_OK) {
            t0 = now_s();
            record(c, 3, mok_forward(ws, &fa), t0);
            /* unusable from now on */
            t0 = now_s();
            record(c, 4, mok_forward(ws, &fa), t0);
            record(c, 5, mok_schedule_build(ws, &sa), t0);
            record(c, 6, mok_backward(ws, &ba), t0);
            mok_workspace *ws2 = NULL;
            record(c, 7, mok_workspace_create(&ws2, g, &L->shape, NULL), t0);
            if (ws2) mok_workspace_destroy(ws2);
        }
        pthread_barrier_wait(c->barrier); /* rank 1 stays silent until rank 0 is done */
        break;
    case SCENARIO_BAD_FORWARD:
    case SCENARIO_BAD_SCHEDULE:
    case SCENARIO_LATE_REJECT:
    case SCENARIO_BAD_IDS: {
        const int schedule_call = c->scenario == SCENARIO_BAD_SCHEDULE || c->scenario == SCENARIO_BAD_IDS;
        t0 = now_s();
        if (!schedule_call) record(c, 2, mok_schedule_build(ws, &sa), t0);
        else c->status[2] = MOK_OK;
        if (c->status[2] != MOK_OK) break;
        mok_schedule_args bad_sa = sa;
        mok_forward_args bad_fa = fa;
        int32_t *bad_ids = NULL;
        if (r == 1) {
            bad_sa.num_tokens = L->shape.max_tokens + 1;
            bad_fa.num_tokens = c->scenario == SCENARIO_LATE_REJECT ? L->T[r] - 1 : L->shape.max_tokens + 1;
            if (c->scenario == SCENARIO_BAD_IDS) {
                const size_t n = (size_t)(L->T[r] * L->shape.topk);
                bad_ids = malloc(n * sizeof(int32_t) + 64);
                memcpy(bad_ids, L->ids[r], n * sizeof(int32_t));
                bad_ids[5 * L->shape.topk + 1] = (int32_t)L->shape.num_experts;
                bad_sa = sa;
                bad_sa.topk_ids = bad_ids;
            }
        }
        t0 = now_s();
        if (schedule_call) record(c, 3, mok_schedule_build(ws, &bad_sa), t0);
        else record(c, 3, mok_forward(ws, &bad_fa), t0);
        free(bad_ids);
        /* both ranks know the outcome before deciding whether to go on */
        pthread_barrier_wait(c->barrier);
        int timed_out = 0;
        for (int p = 0; p < c->P; ++p) timed_out |= c->all[p].status[3] == MOK_ERR_TIMEOUT;
        if (!timed_out) {
            t0 = now_s();
            mok_status s4 = mok_schedule_build(ws, &sa);
            if (s4 == MOK_OK) s4 = mok_forward(ws, &fa);
            if (s4 == MOK_OK) s4 = mok_backward(ws, &ba);
            record(c, 4, s4, t0);
        }
        pthread_barrier_wait(c->barrier);
        break;
    }
    }
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
    return NULL;
}

/* Runs P rank threads of one scenario. shapes: per-rank shapes, or NULL for the layer's. */
static void run_ranks(rank_ctx *ctx, int P, int scenario, const glayer *L, gout *o, const mok_config *cfg,
                      const mok_shape *shapes) {
    mok_unique_id id;
    CHECK(mok_unique_id_create(MOK_BACKEND_CPU, &id) == MOK_OK, "unique id: %s", mok_last_error());
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)P);
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_t threads[GMAX];
    for (int r = 0; r < P; ++r) {
        memset(&ctx[r], 0, sizeof ctx[r]);
        ctx[r].rank = r;
        ctx[r].P = P;
        ctx[r].id = &id;
        ctx[r].cfg = *cfg;
        ctx[r].shape = shapes ? shapes[r] : L->shape;
        ctx[r].L = L;
        ctx[r].o = o;
        ctx[r].barrier = &barrier;
        ctx[r].scenario = scenario;
        ctx[r].alloc_lock = &lock;
        ctx[r].all = ctx;
    }
    for (int r = 0; r < P; ++r) pthread_create(&threads[r], NULL, rank_main, &ctx[r]);
    for (int r = 0; r < P; ++r) pthread_join(threads[r], NULL);
    pthread_barrier_destroy(&barrier);
}

/* ---- tests ------------------------------------------------------------------------------------ */

/* The bytes of a and b but the 8 at `skip` (SIZE_MAX: none). */
static int compare_bytes_but(const void *a, const void *b, size_t bytes, size_t skip, const char *what, int rank) {
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < bytes; ++i) {
        if (x[i] == y[i] || (i >= skip && i - skip < 8)) continue;
        CHECK(0, "rank %d: %s differs from local mode (first at byte %zu of %zu)", rank, what, i, bytes);
        return 0;
    }
    return 1;
}

static int compare_bytes(const void *a, const void *b, size_t bytes, const char *what, int rank) {
    return compare_bytes_but(a, b, bytes, SIZE_MAX, what, rank);
}

static void per_rank_equals_local(int P, const int64_t *T) {
    mok_shape shape = gshape(P, 64);
    glayer L;
    glayer_make(&L, &shape, P, T, (uint64_t)P);
    mok_config cfg = gconfig(20000);
    gout local, dist;
    memset(&local, 0, sizeof local);
    memset(&dist, 0, sizeof dist);
    if (!run_local(&L, &cfg, &local)) {
        gout_free(&local, P);
        glayer_free(&L);
        return;
    }
    rank_ctx ctx[GMAX];
    run_ranks(ctx, P, SCENARIO_FULL, &L, &dist, &cfg, NULL);
    int ok = 1;
    for (int r = 0; r < P; ++r)
        for (int step = 0; step < 6; ++step)
            if (ctx[r].status[step] != MOK_OK) {
                CHECK(0, "P %d rank %d step %d: status %d: %s", P, r, step, (int)ctx[r].status[step],
                      ctx[r].message[step]);
                ok = 0;
                break;
            }
    if (ok) {
        const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate, k = shape.topk;
        const int64_t El = shape.num_experts / P;
        for (int r = 0; r < P; ++r) {
            const size_t ny = (size_t)(T[r] * H) * 2, nk = (size_t)(T[r] * k) * 4;
            const size_t nw = (size_t)(El * I * H), ns = (size_t)(Is * H);
            /* every byte but the tag of the workspace that wrote them (core/schedule.h): the two
               modes ran on two workspaces */
            compare_bytes_but(dist.sched[r], local.sched[r], local.sched_bytes, offsetof(mok_sched_header, workspace),
                              "schedule buffer", r);
            compare_bytes_but(dist.ctx[r], local.ctx[r], local.ctx_bytes, offsetof(mok_context_tag, workspace),
                              "forward context", r);
            compare_bytes(dist.y[r], local.y[r], ny, "y", r);
            compare_bytes(dist.dx[r], local.dx[r], ny, "dx", r);
            compare_bytes(dist.dx_acc[r], local.dx_acc[r], ny, "dx (accumulate pass)", r);
            compare_bytes(dist.drw[r], local.drw[r], nk, "d_router_w", r);
            compare_bytes(dist.drw_acc[r], local.drw_acc[r], nk, "d_router_w (accumulate pass)", r);
            static const char *names[3] = {"gate", "up", "down"};
            for (int m = 0; m < 3; ++m) {
                char what[64];
                snprintf(what, sizeof what, "dw_%s (bf16)", names[m]);
                compare_bytes(dist.dw[m][r], local.dw[m][r], nw * 2, what, r);
                snprintf(what, sizeof what, "ds_%s (bf16)", names[m]);
                compare_bytes(dist.ds[m][r], local.ds[m][r], ns * 2, what, r);
                snprintf(what, sizeof what, "dw_%s (fp32 accumulate)", names[m]);
                compare_bytes(dist.dwa[m][r], local.dwa[m][r], nw * 4, what, r);
                snprintf(what, sizeof what, "ds_%s (fp32 accumulate)", names[m]);
                compare_bytes(dist.dsa[m][r], local.dsa[m][r], ns * 4, what, r);
            }
            /* and the run computed something: every y written, no poison */
            int poison = 0;
            for (int64_t i = 0; i < T[r] * H; ++i) poison += dist.y[r][i] == 0x7fc1 || dist.dx[r][i] == 0x7fc1;
            CHECK(poison == 0, "rank %d: %d y/dx elements unwritten", r, poison);
        }
    }
    gout_free(&local, P);
    gout_free(&dist, P);
    glayer_free(&L);
}

MOK_TEST(group_per_rank_equals_local_p2) {
    const int64_t T[2] = {40, 31};
    per_rank_equals_local(2, T);
}

MOK_TEST(group_per_rank_equals_local_p3) {
    const int64_t T[3] = {40, 0, 23}; /* a rank without tokens too */
    per_rank_equals_local(3, T);
}

MOK_TEST(group_peer_never_joins) {
    mok_config cfg = gconfig(200);
    mok_unique_id id;
    CHECK(mok_unique_id_create(MOK_BACKEND_CPU, &id) == MOK_OK, "unique id");
    mok_group *g = (mok_group *)&id;
    double t0 = now_s();
    mok_status st = mok_group_create(&g, MOK_BACKEND_CPU, 2, 0, &id, 0, &cfg);
    double secs = now_s() - t0;
    CHECK(st == MOK_ERR_TIMEOUT, "status %d (%s): %s", (int)st, mok_status_string(st), mok_last_error());
    CHECK(secs >= 0.19 && secs <= 2.0, "gave up after %.3f s with peer_timeout_ms = 200", secs);
    CHECK(mok_last_error()[0] != 0 && strstr(mok_last_error(), "join"), "message '%s'", mok_last_error());
    CHECK(g == NULL, "output handle not NULL after a timeout");
    if (st == MOK_OK) mok_group_destroy(g);

    /* the same rank position with a fresh id and a partner works */
    const int64_t T[2] = {40, 31};
    mok_shape shape = gshape(2, 64);
    glayer L;
    glayer_make(&L, &shape, 2, T, 11);
    gout o;
    memset(&o, 0, sizeof o);
    rank_ctx ctx[2];
    mok_config good = gconfig(20000);
    run_ranks(ctx, 2, SCENARIO_FULL, &L, &o, &good, NULL);
    for (int r = 0; r < 2; ++r)
        CHECK(ctx[r].status[5] == MOK_OK, "rank %d: a good run after the timeout failed: %s", r, ctx[r].message[5]);
    gout_free(&o, 2);
    glayer_free(&L);
}

MOK_TEST(group_peer_never_calls_forward) {
    const int64_t T[2] = {40, 31};
    mok_shape shape = gshape(2, 64);
    glayer L;
    glayer_make(&L, &shape, 2, T, 12);
    gout o;
    memset(&o, 0, sizeof o);
    rank_ctx ctx[2];
    mok_config cfg = gconfig(300);
    run_ranks(ctx, 2, SCENARIO_SILENT_PEER, &L, &o, &cfg, NULL);
    for (int r = 0; r < 2; ++r)
        for (int step = 0; step < 3; ++step)
            CHECK(ctx[r].status[step] == MOK_OK, "rank %d setup step %d: %s", r, step, ctx[r].message[step]);
    const rank_ctx *c = &ctx[0];
    CHECK(c->status[3] == MOK_ERR_TIMEOUT, "forward with a silent peer: status %d: %s", (int)c->status[3],
          c->message[3]);
    CHECK(c->seconds[3] >= 0.28 && c->seconds[3] <= 2.0, "gave up after %.3f s with peer_timeout_ms = 300",
          c->seconds[3]);
    CHECK(c->message[3][0] != 0 && strstr(c->message[3], "rank 1"), "timeout message '%s' does not name rank 1",
          c->message[3]);
    static const char *after[4] = {"forward", "schedule_build", "backward", "workspace_create"};
    for (int i = 0; i < 4; ++i)
        CHECK(c->status[4 + i] == MOK_ERR_STATE && c->message[4 + i][0],
              "%s after the timeout: status %d (want MOK_ERR_STATE): %s", after[i], (int)c->status[4 + i],
              c->message[4 + i]);
    CHECK(c->seconds[7] < 0.2, "the calls after the timeout took %.3f s (they must not wait)", c->seconds[7]);
    gout_free(&o, 2);
    glayer_free(&L);
}

MOK_TEST(group_shapes_differ) {
    const int64_t T[2] = {40, 31};
    mok_shape shape = gshape(2, 64);
    glayer L;
    glayer_make(&L, &shape, 2, T, 13);
    gout o;
    memset(&o, 0, sizeof o);
    rank_ctx ctx[2];
    mok_config cfg = gconfig(5000);
    mok_shape shapes[2] = {gshape(2, 64), gshape(2, 128)};
    double t0 = now_s();
    run_ranks(ctx, 2, SCENARIO_SHAPES, &L, &o, &cfg, shapes);
    double secs = now_s() - t0;
    for (int r = 0; r < 2; ++r) {
        CHECK(ctx[r].status[0] == MOK_OK, "rank %d: group: %s", r, ctx[r].message[0]);
        CHECK(ctx[r].status[1] == MOK_ERR_INVALID_ARGUMENT, "rank %d: workspace with H %lld: status %d: %s", r,
              (long long)shapes[r].hidden, (int)ctx[r].status[1], ctx[r].message[1]);
        CHECK(strstr(ctx[r].message[1], "shape") && strstr(ctx[r].message[1], "H"),
              "rank %d: message '%s' does not name the shape", r, ctx[r].message[1]);
        CHECK(ctx[r].seconds[1] < 2.0, "rank %d: the mismatch took %.3f s to report", r, ctx[r].seconds[1]);
        CHECK(ctx[r].status[2] == MOK_OK, "rank %d: a matching workspace afterwards: %s", r, ctx[r].message[2]);
        CHECK(ctx[r].status[3] == MOK_OK, "rank %d: a pass afterwards: %s", r, ctx[r].message[3]);
    }
    CHECK(secs < 4.0, "the scenario took %.3f s", secs);
    gout_free(&o, 2);
    glayer_free(&L);
}

/* Rank 1 breaks a rule of `scenario`'s call; rank 0 passes good arguments. */
static void one_rank_rejects(int scenario, const char *needle) {
    const int64_t T[2] = {40, 31};
    mok_shape shape = gshape(2, 64);
    glayer L;
    glayer_make(&L, &shape, 2, T, 14);
    gout o;
    memset(&o, 0, sizeof o);
    rank_ctx ctx[2];
    mok_config cfg = gconfig(2000);
    run_ranks(ctx, 2, scenario, &L, &o, &cfg, NULL);
    for (int r = 0; r < 2; ++r)
        for (int step = 0; step < 3; ++step)
            CHECK(ctx[r].status[step] == MOK_OK, "rank %d setup step %d: %s", r, step, ctx[r].message[step]);
    const rank_ctx *bad = &ctx[1], *good = &ctx[0];
    CHECK(bad->status[3] == MOK_ERR_INVALID_ARGUMENT && strstr(bad->message[3], needle),
          "rank 1 (bad arguments): status %d, message '%s' (want INVALID_ARGUMENT naming '%s')", (int)bad->status[3],
          bad->message[3], needle);
    CHECK(bad->seconds[3] < 1.0, "rank 1 took %.3f s to reject its own arguments", bad->seconds[3]);
    CHECK(good->status[3] != MOK_OK && good->status[3] != MOK_ERR_TIMEOUT,
          "rank 0 (good arguments, peer rejected): status %d (%s), want an error that is not a timeout; message '%s'",
          (int)good->status[3], mok_status_string(good->status[3]), good->message[3]);
    CHECK(strstr(good->message[3], "reject") != NULL, "rank 0: message '%s' does not say a peer rejected its arguments",
          good->message[3]);
    CHECK(good->seconds[3] < 1.0, "rank 0 took %.3f s to learn of the rejection (peer_timeout_ms = 2000)",
          good->seconds[3]);
    /* both go on with good arguments (skipped when rank 0 timed out: the group is then dead) */
    if (good->status[3] != MOK_ERR_TIMEOUT)
        for (int r = 0; r < 2; ++r)
            CHECK(ctx[r].status[4] == MOK_OK, "rank %d: good passes after the rejection: %s", r, ctx[r].message[4]);
    gout_free(&o, 2);
    glayer_free(&L);
}

MOK_TEST(group_one_rank_bad_forward_args) { one_rank_rejects(SCENARIO_BAD_FORWARD, "num_tokens"); }

MOK_TEST(group_one_rank_bad_schedule_args) { one_rank_rejects(SCENARIO_BAD_SCHEDULE, "num_tokens"); }

MOK_TEST(group_one_rank_tokens_differ_from_schedule) { one_rank_rejects(SCENARIO_LATE_REJECT, "num_tokens"); }

MOK_TEST(group_one_rank_bad_expert_id) {
    /* Every rank reads every rank's ids, so every rank reports the same bad id, fast. */
    const int64_t T[2] = {40, 31};
    mok_shape shape = gshape(2, 64);
    glayer L;
    glayer_make(&L, &shape, 2, T, 16);
    gout o;
    memset(&o, 0, sizeof o);
    rank_ctx ctx[2];
    mok_config cfg = gconfig(2000);
    run_ranks(ctx, 2, SCENARIO_BAD_IDS, &L, &o, &cfg, NULL);
    for (int r = 0; r < 2; ++r) {
        CHECK(ctx[r].status[3] == MOK_ERR_INVALID_ARGUMENT && strstr(ctx[r].message[3], "rank 1") &&
                  strstr(ctx[r].message[3], "token 5") && strstr(ctx[r].message[3], "slot 1"),
              "rank %d: status %d, message '%s' (want INVALID_ARGUMENT naming rank 1, token 5, slot 1)", r,
              (int)ctx[r].status[3], ctx[r].message[3]);
        CHECK(ctx[r].seconds[3] < 1.0, "rank %d took %.3f s", r, ctx[r].seconds[3]);
        CHECK(ctx[r].status[4] == MOK_OK, "rank %d: good passes afterwards: %s", r, ctx[r].message[4]);
    }
    gout_free(&o, 2);
    glayer_free(&L);
}

typedef struct nranks_job {
    const mok_unique_id *id;
    mok_config cfg;
    mok_status status;
    char message[512];
} nranks_job;

static void *join_as_rank0_of_2(void *arg) {
    nranks_job *j = arg;
    mok_group *g = NULL;
    j->status = mok_group_create(&g, MOK_BACKEND_CPU, 2, 0, j->id, 0, &j->cfg);
    snprintf(j->message, sizeof j->message, "%s", mok_last_error());
    if (g) mok_group_destroy(g);
    return NULL;
}

MOK_TEST(group_nranks_differ) {
    /* Same id, different nranks: one side is told that nranks differs (whoever came second),
       the other times out waiting for a partner that will never match. */
    mok_unique_id id;
    CHECK(mok_unique_id_create(MOK_BACKEND_CPU, &id) == MOK_OK, "unique id");
    nranks_job j = {&id, gconfig(300), (mok_status)-1, ""};
    pthread_t thread;
    pthread_create(&thread, NULL, join_as_rank0_of_2, &j);
    mok_config cfg = gconfig(300);
    mok_group *g = NULL;
    mok_status st = mok_group_create(&g, MOK_BACKEND_CPU, 3, 1, &id, 0, &cfg);
    char message[512];
    snprintf(message, sizeof message, "%s", mok_last_error());
    if (g) mok_group_destroy(g);
    pthread_join(thread, NULL);
    int a_invalid = j.status == MOK_ERR_INVALID_ARGUMENT && strstr(j.message, "nranks");
    int b_invalid = st == MOK_ERR_INVALID_ARGUMENT && strstr(message, "nranks");
    CHECK((a_invalid && st == MOK_ERR_TIMEOUT) || (b_invalid && j.status == MOK_ERR_TIMEOUT),
          "nranks 2 vs 3: statuses %d ('%s') and %d ('%s')", (int)j.status, j.message, (int)st, message);
}

MOK_TEST(group_create_destroy_many) {
    /* 100 groups and workspaces in local mode (the sanitizer run checks for leaks), then 10 in
       per-rank mode (the registry of unique ids must drop every domain). */
    mok_config cfg = gconfig(10000);
    mok_shape shape = gshape(2, 64);
    double t0 = now_s();
    int failures = 0;
    for (int i = 0; i < 100 && failures < 3; ++i) {
        mok_group *g = NULL;
        mok_workspace *ws = NULL;
        mok_status st = mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &cfg);
        if (st == MOK_OK) st = mok_workspace_create(&ws, g, &shape, NULL);
        if (st != MOK_OK) {
            CHECK(0, "iteration %d: %s", i, mok_last_error());
            ++failures;
        }
        if (ws) CHECK(mok_workspace_destroy(ws) == MOK_OK, "iteration %d: workspace destroy", i);
        if (g) CHECK(mok_group_destroy(g) == MOK_OK, "iteration %d: group destroy", i);
    }
    double secs = now_s() - t0;
    CHECK(secs < (mok_test_quick() ? 20.0 : 5.0), "100 create/destroy cycles took %.2f s", secs);

    /* 70 live workspaces in one group (more than the backend's table of 64 slots), then a pass
       on the first and on the last */
    const int64_t T[2] = {40, 31};
    glayer L;
    glayer_make(&L, &shape, 2, T, 15);
    {
        enum { LIVE = 70 };
        mok_group *g = NULL;
        mok_workspace *live[LIVE] = {0};
        CHECK(mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &cfg) == MOK_OK, "group: %s", mok_last_error());
        for (int i = 0; i < LIVE && g; ++i)
            CHECK(mok_workspace_create(&live[i], g, &shape, NULL) == MOK_OK, "live workspace %d: %s", i,
                  mok_last_error());
        for (int which = 0; which < 2; ++which) {
            mok_workspace *ws = live[which ? LIVE - 1 : 0];
            if (!ws) continue;
            gout o;
            memset(&o, 0, sizeof o);
            mok_sizes sz;
            mok_workspace_sizes(ws, &sz);
            mok_schedule_args sa[2];
            mok_forward_args fa[2];
            for (int p = 0; p < 2; ++p) {
                gout_alloc_rank(&o, &L, p, &sz);
                sa[p] = sched_arg(&L, &o, p);
                fa[p] = fwd_arg(&L, &o, p);
            }
            mok_status st = mok_schedule_build(ws, sa);
            if (st == MOK_OK) st = mok_forward(ws, fa);
            CHECK(st == MOK_OK, "a pass on live workspace %d: %s", which ? LIVE - 1 : 0, mok_last_error());
            gout_free(&o, 2);
        }
        for (int i = 0; i < LIVE; ++i) mok_workspace_destroy(live[i]);
        mok_group_destroy(g);
    }
    for (int i = 0; i < 10; ++i) {
        gout o;
        memset(&o, 0, sizeof o);
        rank_ctx ctx[2];
        run_ranks(ctx, 2, SCENARIO_SHAPES, &L, &o, &cfg, NULL); /* same shapes: workspace twice, one pass */
        for (int r = 0; r < 2; ++r)
            CHECK(ctx[r].status[1] == MOK_OK && ctx[r].status[3] == MOK_OK, "per-rank cycle %d rank %d: %s %s", i, r,
                  ctx[r].message[1], ctx[r].message[3]);
        gout_free(&o, 2);
    }
    glayer_free(&L);
}
