/* test_protocol.c — the per-rank protocol of the cpu backend under misuse and faults: P threads
 * each drive one rank (mok_group_create), as P processes would on GPUs, and follow a script of
 * calls per rank, so that a test can put the ranks out of step on purpose.
 *
 * What must hold, whatever the ranks do: every call returns within the timeout (a rank that meets
 * a peer in another call, workspace, schedule build or config fails at once with a message that
 * names both sides); no rank touches freed memory (the sanitizer run is the judge); after a
 * timeout the group fails fast on every rank; and calls that agree still compute the reference's
 * result (tests/layer.c's tolerance table). The layers are small (H = I = 64 unless a test needs a
 * pass that takes long), with uneven tokens, empty slots and a shared expert. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/schedule.h"
#include "layer.h"
#include "mok.h"
#include "test.h"

#define PMAX 3     /* rank threads at most */
#define STEPS 16   /* script steps at most */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void *alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded ? rounded : 64);
}

static void fill_u16(uint16_t *p, size_t n, uint16_t v) {
    for (size_t i = 0; i < n; ++i) p[i] = v;
}

/* ---- scripts -------------------------------------------------------------------------------- */

typedef enum {
    OP_END = 0,
    OP_GROUP,             /* mok_group_create as rank `arg` (-1: the thread's own rank) */
    OP_WORKSPACE,         /* mok_workspace_create with the thread's workspace config */
    OP_SCHEDULE,          /* build schedule buffer `arg` (0: the layer's routing, 1: the other layer's) */
    OP_FORWARD,           /* mok_forward with schedule buffer `arg` */
    OP_BACKWARD,          /* mok_backward with schedule buffer `arg` */
    OP_DESTROY_WORKSPACE,
    OP_DESTROY_GROUP,
    OP_SYNC,              /* the test's own rendezvous of every thread (not the library's) */
    OP_SLEEP              /* `arg` milliseconds */
} op_kind;

typedef struct op {
    op_kind kind;
    int arg;
} op;

typedef struct scenario scenario;

/* One rank thread: its script and what each step returned. */
typedef struct rank_thread {
    scenario *sc;
    int index;      /* thread index; also its rank unless OP_GROUP says otherwise */
    int rank;       /* the rank it joined as */
    mok_config group_config, workspace_config;
    const op *script;
    mok_group *group;
    mok_workspace *workspace;
    void *schedule2; /* the second schedule buffer */
    mok_status status[STEPS];
    char message[STEPS][640];
    double seconds[STEPS];
} rank_thread;

struct scenario {
    int threads, nranks;
    mok_unique_id id;
    const layer *L, *L2; /* L2: the same shape and tokens, another routing (OP_SCHEDULE 1) */
    layer_result got;    /* every rank's buffers, index = rank */
    pthread_barrier_t sync;
    rank_thread t[PMAX];
};

/* The rank's buffers, poisoned, sized by its workspace (each thread writes its own index). */
static void alloc_rank_buffers(rank_thread *c) {
    scenario *sc = c->sc;
    const layer *L = sc->L;
    const int p = c->rank;
    mok_sizes sz;
    mok_workspace_sizes(c->workspace, &sz);
    const int64_t T = L->num_tokens[p], H = L->shape.hidden, k = L->shape.topk, I = L->shape.intermediate;
    const int64_t Is = L->shape.shared_intermediate, El = L->shape.num_experts / sc->nranks;
    layer_result *r = &sc->got;
    r->schedule_bytes = sz.schedule_bytes;
    r->context_bytes = sz.context_bytes;
    r->schedule[p] = alloc_aligned(sz.schedule_bytes);
    c->schedule2 = alloc_aligned(sz.schedule_bytes);
    r->context[p] = alloc_aligned(sz.context_bytes);
    memset(r->schedule[p], 0xa5, sz.schedule_bytes);
    memset(c->schedule2, 0xa5, sz.schedule_bytes);
    fill_u16(r->context[p], sz.context_bytes / 2, LAYER_POISON_BF16);
    r->y[p] = alloc_aligned((size_t)(T * H) * 2);
    r->dx[p] = alloc_aligned((size_t)(T * H) * 2);
    fill_u16(r->y[p], (size_t)(T * H), LAYER_POISON_BF16);
    fill_u16(r->dx[p], (size_t)(T * H), LAYER_POISON_BF16);
    r->d_router_w[p] = alloc_aligned((size_t)(T * k) * 4);
    for (int64_t i = 0; i < T * k; ++i) r->d_router_w[p][i] = NAN;
    for (int m = 0; m < 3; ++m) {
        r->dw[m][p] = alloc_aligned((size_t)(El * I * H) * 2);
        fill_u16(r->dw[m][p], (size_t)(El * I * H), LAYER_POISON_BF16);
        r->ds[m][p] = Is ? alloc_aligned((size_t)(Is * H) * 2) : NULL;
        if (Is) fill_u16(r->ds[m][p], (size_t)(Is * H), LAYER_POISON_BF16);
    }
}

static void *schedule_buffer(rank_thread *c, int which) {
    return which ? c->schedule2 : c->sc->got.schedule[c->rank];
}

static mok_status run_op(rank_thread *c, const op *o) {
    scenario *sc = c->sc;
    const int p = c->rank;
    mok_forward_args fa[MOK_MAX_RANKS];
    mok_backward_args ba[MOK_MAX_RANKS];
    switch (o->kind) {
    case OP_GROUP:
        c->rank = o->arg >= 0 ? o->arg : c->index;
        return mok_group_create(&c->group, MOK_BACKEND_CPU, sc->nranks, c->rank, &sc->id, 0, &c->group_config);
    case OP_WORKSPACE: {
        mok_status st = mok_workspace_create(&c->workspace, c->group, &sc->L->shape, &c->workspace_config);
        if (st == MOK_OK && !sc->got.schedule[p]) alloc_rank_buffers(c);
        return st;
    }
    case OP_SCHEDULE: {
        const layer *from = o->arg ? sc->L2 : sc->L;
        mok_schedule_args a = {from->num_tokens[p], from->topk_ids[p], schedule_buffer(c, o->arg), NULL};
        return mok_schedule_build(c->workspace, &a);
    }
    case OP_FORWARD:
        layer_forward_args(sc->L, &sc->got, fa);
        fa[p].schedule = schedule_buffer(c, o->arg);
        return mok_forward(c->workspace, &fa[p]);
    case OP_BACKWARD:
        layer_backward_args(sc->L, &sc->got, 0, ba);
        ba[p].schedule = schedule_buffer(c, o->arg);
        return mok_backward(c->workspace, &ba[p]);
    case OP_DESTROY_WORKSPACE: {
        mok_status st = mok_workspace_destroy(c->workspace);
        c->workspace = NULL;
        return st;
    }
    case OP_DESTROY_GROUP: {
        mok_status st = mok_group_destroy(c->group);
        if (st == MOK_OK) c->group = NULL;
        return st;
    }
    case OP_SYNC: pthread_barrier_wait(&sc->sync); return MOK_OK;
    case OP_SLEEP: sleep_ms(o->arg); return MOK_OK;
    case OP_END: break;
    }
    return MOK_OK;
}

static void *rank_main(void *arg) {
    rank_thread *c = arg;
    for (int i = 0; i < STEPS && c->script[i].kind != OP_END; ++i) {
        const double start = now_s();
        mok_status st = run_op(c, &c->script[i]);
        c->status[i] = st;
        c->seconds[i] = now_s() - start;
        snprintf(c->message[i], sizeof c->message[i], "%s", st == MOK_OK ? "" : mok_last_error());
    }
    /* whatever the script left behind */
    if (c->workspace) mok_workspace_destroy(c->workspace);
    if (c->group) mok_group_destroy(c->group);
    return NULL;
}

static mok_config base_config(double timeout_ms) {
    mok_config c = MOK_CONFIG_INIT;
    c.minibatch_rows = 128;
    c.ring_rows = 256;
    c.cpu_threads = 2;
    c.cpu_comm_threads = 1;
    c.peer_timeout_ms = timeout_ms;
    return c;
}

/* Runs one thread per script (threads scripts, nranks ranks), each with config (workspace config
 * per thread: ws_configs, or config when NULL). */
static void run_scenario(scenario *sc, int threads, int nranks, const layer *L, const layer *L2,
                         const mok_config *config, const mok_config *ws_configs, const op *const *scripts) {
    memset(sc, 0, sizeof *sc);
    sc->threads = threads;
    sc->nranks = nranks;
    sc->L = L;
    sc->L2 = L2;
    sc->got.nranks = nranks;
    CHECK(mok_unique_id_create(MOK_BACKEND_CPU, &sc->id) == MOK_OK, "unique id: %s", mok_last_error());
    pthread_barrier_init(&sc->sync, NULL, (unsigned)threads);
    pthread_t tid[PMAX];
    for (int i = 0; i < threads; ++i) {
        rank_thread *c = &sc->t[i];
        c->sc = sc;
        c->index = i;
        c->rank = i;
        c->group_config = *config;
        c->workspace_config = ws_configs ? ws_configs[i] : *config;
        c->script = scripts[i];
        for (int s = 0; s < STEPS; ++s) c->status[s] = (mok_status)-1;
    }
    for (int i = 0; i < threads; ++i) pthread_create(&tid[i], NULL, rank_main, &sc->t[i]);
    for (int i = 0; i < threads; ++i) pthread_join(tid[i], NULL);
    pthread_barrier_destroy(&sc->sync);
}

static void scenario_free(scenario *sc) {
    for (int i = 0; i < sc->threads; ++i) free(sc->t[i].schedule2);
    layer_result_free(&sc->got);
}

/* The step's outcome: status `want` (or any failure for want = -1) and every needle in its message. */
static void expect(const scenario *sc, int thread, int step, int want, const char *what, const char *needle1,
                   const char *needle2) {
    const rank_thread *c = &sc->t[thread];
    const mok_status st = c->status[step];
    const int status_ok = want < 0 ? (st != MOK_OK && st != (mok_status)-1) : st == (mok_status)want;
    const int text_ok = (!needle1 || strstr(c->message[step], needle1)) && (!needle2 || strstr(c->message[step], needle2));
    CHECK(status_ok && text_ok, "%s: thread %d step %d: status %d (%s), want %d; message '%s' (want '%s'%s%s%s)", what,
          thread, step, (int)st, st == (mok_status)-1 ? "not run" : mok_status_string(st), want, c->message[step],
          needle1 ? needle1 : "", needle2 ? ", '" : "", needle2 ? needle2 : "", needle2 ? "'" : "");
}

static void expect_fast(const scenario *sc, int thread, int step, double limit, const char *what) {
    CHECK(sc->t[thread].seconds[step] < limit, "%s: thread %d step %d took %.3f s (limit %.1f s)", what, thread, step,
          sc->t[thread].seconds[step], limit);
}

static int make_layer(layer *L, int P, const int64_t *tokens, int64_t hidden, int64_t inter, int64_t shared,
                      int64_t topk, uint64_t salt, int routing) {
    mok_shape s = {hidden, inter, 2 * P, topk, shared, 0, MOK_PRECISION_BF16};
    const int rc = layer_make(L, &s, P, tokens, mok_test_seed() * 0x9e3779b97f4a7c15ull + salt, routing);
    CHECK(rc == 0, "layer_make failed");
    return rc == 0;
}

/* The layer's forward and backward through scenario `sc`'s buffers, against the reference. */
static void compare_with_reference(const scenario *sc, const layer *L, int backward, const char *what) {
    layer_result ref = {0};
    mok_status st = backward ? layer_run_reference(L, &ref) : layer_run_reference_forward(L, &ref);
    CHECK(st == MOK_OK, "%s: reference: %s", what, mok_last_error());
    if (st == MOK_OK) {
        layer_result got = sc->got;
        if (!backward)
            for (int p = 0; p < L->nranks; ++p)
                for (int m = 0; m < 3; ++m) got.dw[m][p] = NULL;
        char tag[160];
        snprintf(tag, sizeof tag, "%s (MOK_TEST_SEED=%llu)", what, mok_test_seed());
        const double err = layer_compare(L, &got, &ref, tag);
        CHECK(err <= 1.0, "%s: worst error %.3g of the tolerance", what, err);
    }
    layer_result_free(&ref);
}

static const int64_t T2[2] = {40, 31};
static const int64_t T3[3] = {29, 0, 40};

/* ---- calls that agree ------------------------------------------------------------------------ */

MOK_TEST(protocol_agreeing_calls_compute_the_reference) {
    /* Two builds, the forward and backward with the second; peer_timeout_ms at its largest
       (deadlines computed from it must not overflow). */
    const op script[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 1}, {OP_SCHEDULE, 0},
                         {OP_FORWARD, 0}, {OP_BACKWARD, 0}, {OP_END, 0}};
    for (int P = 2; P <= 3; ++P) {
        layer L, L2;
        if (!make_layer(&L, P, P == 2 ? T2 : T3, 64, 64, 64, 2, 1, LAYER_ROUTE_HOLES) ||
            !make_layer(&L2, P, P == 2 ? T2 : T3, 64, 64, 64, 2, 2, LAYER_ROUTE_UNIFORM))
            return;
        const op *scripts[PMAX] = {script, script, script};
        mok_config cfg = base_config(1e9);
        scenario sc;
        run_scenario(&sc, P, P, &L, &L2, &cfg, NULL, scripts);
        for (int r = 0; r < P; ++r)
            for (int s = 0; s < 6; ++s) expect(&sc, r, s, MOK_OK, "agreeing calls", NULL, NULL);
        compare_with_reference(&sc, &L, 1, P == 2 ? "agreeing calls P=2" : "agreeing calls P=3");
        scenario_free(&sc);
        layer_free(&L);
        layer_free(&L2);
    }
}

/* ---- calls that do not agree ----------------------------------------------------------------- */

static void forward_meets_backward(const mok_config *cfg, const char *what) {
    layer L;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 3, LAYER_ROUTE_UNIFORM)) return;
    /* step 4: rank 0 forward while rank 1 runs the backward (each with a context of a forward);
       then both go on in step */
    const op r0[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_FORWARD, 0},
                     {OP_FORWARD, 0}, {OP_BACKWARD, 0}, {OP_END, 0}};
    const op r1[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_BACKWARD, 0},
                     {OP_FORWARD, 0}, {OP_BACKWARD, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {r0, r1};
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, cfg, NULL, scripts);
    for (int r = 0; r < 2; ++r)
        for (int s = 0; s < 4; ++s) expect(&sc, r, s, MOK_OK, what, NULL, NULL);
    expect(&sc, 0, 4, MOK_ERR_INVALID_ARGUMENT, what, "rank 1 is in mok_backward #3", "this rank (0) is in mok_forward #3");
    expect(&sc, 1, 4, MOK_ERR_INVALID_ARGUMENT, what, "rank 0 is in mok_forward #3", "this rank (1) is in mok_backward #3");
    for (int r = 0; r < 2; ++r) {
        expect_fast(&sc, r, 4, 1.0, what);
        expect(&sc, r, 5, MOK_OK, what, NULL, NULL);
        expect(&sc, r, 6, MOK_OK, what, NULL, NULL);
    }
    compare_with_reference(&sc, &L, 1, what);
    scenario_free(&sc);
    layer_free(&L);
}

MOK_TEST(protocol_forward_meets_backward) {
    mok_config cfg = base_config(2000);
    forward_meets_backward(&cfg, "forward meets backward, default directions");
    cfg.fwd_dispatch = MOK_PUSH;
    cfg.fwd_combine = MOK_PULL;
    cfg.bwd_combine = MOK_PUSH;
    cfg.bwd_dispatch = MOK_PULL;
    forward_meets_backward(&cfg, "forward meets backward, every transfer turned");
}

MOK_TEST(protocol_destroy_meets_forward) {
    /* Rank 0 destroys its workspace where rank 1 runs its forward: rank 1 must not read or write
       the freed region (the sanitizer run), and both learn of it at once. */
    layer L;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 4, LAYER_ROUTE_UNIFORM)) return;
    const op r0[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_DESTROY_WORKSPACE, 0},
                     {OP_SYNC, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op r1[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0},
                     {OP_FORWARD, 0}, {OP_SYNC, 0}, {OP_DESTROY_WORKSPACE, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {r0, r1};
    mok_config cfg = base_config(2000);
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, &cfg, NULL, scripts);
    const char *what = "destroy meets forward";
    expect(&sc, 1, 3, MOK_ERR_INVALID_ARGUMENT, what, "rank 0 is in mok_workspace_destroy of workspace #0",
           "this rank (1) is in mok_forward #2");
    expect(&sc, 0, 3, MOK_ERR_INVALID_ARGUMENT, what, "rank 1 is in mok_forward #2", "mok_workspace_destroy");
    expect_fast(&sc, 1, 3, 1.0, what);
    expect_fast(&sc, 0, 3, 1.0, what);
    /* the group is unusable now: rank 1's next call fails at once, naming rank 0 */
    expect(&sc, 1, 4, MOK_ERR_STATE, what, "rank 0", "destroyed a workspace");
    expect_fast(&sc, 1, 4, 0.5, what);
    expect(&sc, 1, 6, MOK_OK, what, NULL, NULL);
    expect(&sc, 1, 7, MOK_OK, what, NULL, NULL);
    expect(&sc, 0, 5, MOK_OK, what, NULL, NULL);
    scenario_free(&sc);
    layer_free(&L);
}

MOK_TEST(protocol_schedule_builds_differ) {
    /* Both ranks build two schedules (two routings); rank 0 runs the forward with the first build,
       rank 1 with the second: both refuse, naming both builds. */
    layer L, L2;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 5, LAYER_ROUTE_UNIFORM) ||
        !make_layer(&L2, 2, T2, 64, 64, 64, 2, 6, LAYER_ROUTE_SKEWED))
        return;
    const op r0[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_SCHEDULE, 1}, {OP_FORWARD, 0},
                     {OP_FORWARD, 0}, {OP_BACKWARD, 0}, {OP_END, 0}};
    const op r1[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_SCHEDULE, 1}, {OP_FORWARD, 1},
                     {OP_FORWARD, 0}, {OP_BACKWARD, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {r0, r1};
    mok_config cfg = base_config(2000);
    scenario sc;
    run_scenario(&sc, 2, 2, &L, &L2, &cfg, NULL, scripts);
    const char *what = "forwards with different schedule builds";
    expect(&sc, 0, 4, MOK_ERR_INVALID_ARGUMENT, what, "rank 1 is in mok_forward #3 on workspace #0 with schedule build #2",
           "with schedule build #1");
    expect(&sc, 1, 4, MOK_ERR_INVALID_ARGUMENT, what, "rank 0 is in mok_forward #3 on workspace #0 with schedule build #1",
           "with schedule build #2");
    for (int r = 0; r < 2; ++r) {
        expect_fast(&sc, r, 4, 1.0, what);
        expect(&sc, r, 5, MOK_OK, what, NULL, NULL);
        expect(&sc, r, 6, MOK_OK, what, NULL, NULL);
    }
    compare_with_reference(&sc, &L, 1, what);
    scenario_free(&sc);
    layer_free(&L);
    layer_free(&L2);
}

/* Every config field that changes the protocol (config.c's NOTE), set differently on rank 1:
 * both ranks refuse the workspace at once, naming the field; then a workspace with equal configs
 * computes the reference's result. */
typedef struct config_change {
    const char *field;
    void (*set)(mok_config *);
} config_change;
static void set_ring(mok_config *c) { c->ring_rows = 512; }
static void set_minibatch(mok_config *c) { c->minibatch_rows = 256; }
static void set_context(mok_config *c) { c->context_rows = 128; }
static void set_limit(mok_config *c) { c->swiglu_limit = 7.0f; }
static void set_fwd_dispatch(mok_config *c) { c->fwd_dispatch = MOK_PUSH; }
static void set_fwd_combine(mok_config *c) { c->fwd_combine = MOK_PULL; }
static void set_bwd_combine(mok_config *c) { c->bwd_combine = MOK_PUSH; }
static void set_bwd_dispatch(mok_config *c) { c->bwd_dispatch = MOK_PULL; }

MOK_TEST(protocol_workspace_configs_differ) {
    layer L;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 7, LAYER_ROUTE_UNIFORM)) return;
    const config_change changes[] = {
        {"config.ring_rows", set_ring},         {"config.minibatch_rows", set_minibatch},
        {"config.context_rows", set_context},   {"config.swiglu_limit", set_limit},
        {"config.fwd_dispatch", set_fwd_dispatch}, {"config.fwd_combine", set_fwd_combine},
        {"config.bwd_combine", set_bwd_combine}, {"config.bwd_dispatch", set_bwd_dispatch}};
    const op script[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_DESTROY_WORKSPACE, 0}, {OP_END, 0}};
    for (size_t i = 0; i < sizeof changes / sizeof changes[0]; ++i) {
        mok_config cfg[2] = {base_config(2000), base_config(2000)};
        /* the transfer that ring_rows sized wrongly would break: push dispatch on both */
        if (i == 0) cfg[0].fwd_dispatch = cfg[1].fwd_dispatch = MOK_PUSH;
        changes[i].set(&cfg[1]);
        const op *scripts[PMAX] = {script, script};
        scenario sc;
        run_scenario(&sc, 2, 2, &L, NULL, &cfg[0], cfg, scripts);
        char what[96];
        snprintf(what, sizeof what, "workspaces with different %s", changes[i].field);
        expect(&sc, 0, 1, MOK_ERR_INVALID_ARGUMENT, what, changes[i].field, "rank 1 has");
        expect(&sc, 1, 1, MOK_ERR_INVALID_ARGUMENT, what, changes[i].field, "rank 0 has");
        for (int r = 0; r < 2; ++r) expect_fast(&sc, r, 1, 1.0, what);
        scenario_free(&sc);
    }
    /* Fields that stay each rank's own: a full pass, equal to the reference. */
    mok_config own[2] = {base_config(2000), base_config(3000)};
    own[1].cpu_threads = 3;
    own[1].trace = 1;
    own[0].fwd_comm_sms = 7;
    const op full[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_BACKWARD, 0},
                       {OP_END, 0}};
    const op *scripts[PMAX] = {full, full};
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, &own[0], own, scripts);
    for (int r = 0; r < 2; ++r)
        for (int s = 0; s < 5; ++s) expect(&sc, r, s, MOK_OK, "threads, trace and timeouts per rank", NULL, NULL);
    compare_with_reference(&sc, &L, 1, "threads, trace and timeouts per rank");
    scenario_free(&sc);
    layer_free(&L);
}

/* ---- timeouts --------------------------------------------------------------------------------- */

/* The routing of a pass that keeps one rank busy: every slot of every token on expert `hot`. */
static void route_all_to(layer *L, int hot) {
    for (int p = 0; p < L->nranks; ++p)
        for (int64_t i = 0; i < L->num_tokens[p] * L->shape.topk; ++i) L->topk_ids[p][i] = hot;
}

MOK_TEST(protocol_end_barrier_timeout_keeps_memory) {
    /* Rank 0 owns the only expert that gets rows; rank 1 finishes at once, times out at the
       closing barrier and destroys its workspace and group while rank 0 may still push expert
       outputs into rank 1's region. */
    const int64_t T[2] = {256, 256};
    layer L;
    if (!make_layer(&L, 2, T, 512, 512, 0, 1, 8, LAYER_ROUTE_UNIFORM)) return;
    route_all_to(&L, 0);
    const op r0[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0},
                     {OP_DESTROY_WORKSPACE, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op r1[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0},
                     {OP_DESTROY_WORKSPACE, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {r0, r1};
    mok_config cfg = base_config(2000);
    cfg.minibatch_rows = 512;
    cfg.ring_rows = 512;
    mok_config ws_cfg[2] = {cfg, cfg};
    ws_cfg[0].peer_timeout_ms = ws_cfg[1].peer_timeout_ms = 100;
    mok_config group_cfg = cfg;
    group_cfg.peer_timeout_ms = 100;
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, &group_cfg, ws_cfg, scripts);
    const char *what = "closing barrier timeout";
    for (int r = 0; r < 2; ++r)
        for (int s = 0; s < 3; ++s) expect(&sc, r, s, MOK_OK, what, NULL, NULL);
    expect(&sc, 1, 3, MOK_ERR_TIMEOUT, what, "rank 0 did not arrive", NULL);
    expect(&sc, 0, 3, -1, what, "rank 1", NULL);
    for (int r = 0; r < 2; ++r) {
        expect(&sc, r, 4, MOK_OK, what, NULL, NULL);
        expect(&sc, r, 5, MOK_OK, what, NULL, NULL);
    }
    scenario_free(&sc);
    layer_free(&L);
}

MOK_TEST(protocol_timeout_poisons_the_group) {
    /* Rank 1 is late for the forward; rank 0 times out, then destroys everything while rank 1
       enters the forward (whose opening barrier rank 0 had reached before giving up). Rank 1
       must fail at once, naming rank 0's timeout, and touch nothing of rank 0's. */
    layer L;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 9, LAYER_ROUTE_UNIFORM)) return;
    const op r0[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_SYNC, 0},
                     {OP_DESTROY_WORKSPACE, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op r1[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_SYNC, 0}, {OP_FORWARD, 0},
                     {OP_SCHEDULE, 0}, {OP_DESTROY_WORKSPACE, 0}, {OP_DESTROY_GROUP, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {r0, r1};
    mok_config cfg = base_config(200);
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, &cfg, NULL, scripts);
    const char *what = "timeout poisons the group";
    expect(&sc, 0, 3, MOK_ERR_TIMEOUT, what, "rank 1 did not arrive", "mok_forward #2");
    CHECK(sc.t[0].seconds[3] >= 0.19 && sc.t[0].seconds[3] < 2.0, "%s: rank 0 gave up after %.3f s (timeout 0.2 s)",
          what, sc.t[0].seconds[3]);
    expect(&sc, 1, 4, MOK_ERR_STATE, what, "rank 0 timed out", NULL);
    expect(&sc, 1, 5, MOK_ERR_STATE, what, "rank 0 timed out", NULL);
    expect_fast(&sc, 1, 4, 0.15, what);
    expect_fast(&sc, 1, 5, 0.15, what);
    for (int r = 0; r < 2; ++r) {
        expect(&sc, r, r == 0 ? 5 : 6, MOK_OK, what, NULL, NULL);
        expect(&sc, r, r == 0 ? 6 : 7, MOK_OK, what, NULL, NULL);
        expect_fast(&sc, r, r == 0 ? 5 : 6, 0.15, what); /* no barrier in a poisoned group */
    }
    scenario_free(&sc);
    layer_free(&L);
}

MOK_TEST(protocol_peer_counter_wait_has_a_deadline) {
    /* Turned combine: rank 0 gathers its rows' expert outputs from rank 1's ring, waiting on rank
       1's counters, while rank 1 (the only expert with rows, a wide layer) takes seconds before
       its first row tile is done. Rank 0's wait gives up after peer_timeout_ms. */
    const int64_t T[2] = {512, 512};
    layer L;
    if (!make_layer(&L, 2, T, 1024, 1024, 0, 1, 10, LAYER_ROUTE_UNIFORM)) return;
    route_all_to(&L, 2); /* E = 4: experts 2 and 3 are rank 1's */
    const op script[] = {{OP_GROUP, -1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_END, 0}};
    const op *scripts[PMAX] = {script, script};
    mok_config cfg = base_config(2000);
    cfg.minibatch_rows = 1024;
    cfg.ring_rows = 1024;
    cfg.fwd_combine = MOK_PULL;
    mok_config ws_cfg[2] = {cfg, cfg};
    ws_cfg[0].peer_timeout_ms = ws_cfg[1].peer_timeout_ms = 200;
    scenario sc;
    run_scenario(&sc, 2, 2, &L, NULL, &cfg, ws_cfg, scripts);
    const char *what = "a wait on a peer's counter";
    expect(&sc, 0, 3, MOK_ERR_TIMEOUT, what, "rank 1's counter", NULL);
    expect_fast(&sc, 0, 3, 2.0, what);
    expect(&sc, 1, 3, MOK_ERR_STATE, what, "rank 0 timed out", NULL);
    expect_fast(&sc, 1, 3, 4.0, what);
    scenario_free(&sc);
    layer_free(&L);
}

/* ---- groups ----------------------------------------------------------------------------------- */

MOK_TEST(protocol_rank_joined_twice) {
    /* Thread 1 claims rank 0, which thread 0 holds: refused at once; thread 2 joins as rank 1, and
       the group of threads 0 and 2 works. */
    layer L;
    if (!make_layer(&L, 2, T2, 64, 64, 64, 2, 11, LAYER_ROUTE_UNIFORM)) return;
    const op first[] = {{OP_GROUP, 0}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0}, {OP_END, 0}};
    const op twice[] = {{OP_SLEEP, 50}, {OP_GROUP, 0}, {OP_END, 0}};
    const op second[] = {{OP_SLEEP, 150}, {OP_GROUP, 1}, {OP_WORKSPACE, 0}, {OP_SCHEDULE, 0}, {OP_FORWARD, 0},
                         {OP_END, 0}};
    const op *scripts[PMAX] = {first, twice, second};
    mok_config cfg = base_config(3000);
    scenario sc;
    run_scenario(&sc, 3, 2, &L, NULL, &cfg, NULL, scripts);
    const char *what = "a rank joined twice";
    expect(&sc, 1, 1, MOK_ERR_INVALID_ARGUMENT, what, "rank: 0 is already held", NULL);
    expect_fast(&sc, 1, 1, 0.5, what);
    for (int s = 0; s < 4; ++s) expect(&sc, 0, s, MOK_OK, what, NULL, NULL);
    for (int s = 1; s < 5; ++s) expect(&sc, 2, s, MOK_OK, what, NULL, NULL);
    if (sc.t[0].status[3] == MOK_OK && sc.t[2].status[4] == MOK_OK) compare_with_reference(&sc, &L, 0, what);
    scenario_free(&sc);
    layer_free(&L);
}

MOK_TEST(protocol_group_outlived_by_workspace) {
    /* A group is not destroyed while a workspace made on it lives (the workspace would then use it
       after its free); the workspace first, then the group. */
    for (int per_rank = 0; per_rank < 2; ++per_rank) {
        mok_config cfg = base_config(2000);
        mok_shape shape = {64, 64, 2, 1, 0, 8, MOK_PRECISION_BF16};
        mok_group *g = NULL;
        mok_workspace *ws = NULL, *ws2 = NULL;
        mok_unique_id id;
        mok_unique_id_create(MOK_BACKEND_CPU, &id);
        mok_status st = per_rank ? mok_group_create(&g, MOK_BACKEND_CPU, 1, 0, &id, 0, &cfg)
                                 : mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &cfg);
        CHECK(st == MOK_OK, "group: %s", mok_last_error());
        if (st != MOK_OK) continue;
        CHECK(mok_workspace_create(&ws, g, &shape, NULL) == MOK_OK, "workspace: %s", mok_last_error());
        CHECK(mok_workspace_create(&ws2, g, &shape, NULL) == MOK_OK, "workspace 2: %s", mok_last_error());
        st = mok_group_destroy(g);
        CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "2 workspaces") &&
                  strstr(mok_last_error(), "still alive"),
              "group destroyed before its workspaces: status %d, message '%s'", (int)st, mok_last_error());
        CHECK(mok_workspace_destroy(ws2) == MOK_OK, "workspace 2 destroy: %s", mok_last_error());
        st = mok_group_destroy(g);
        CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "1 workspace "),
              "group destroyed before its workspace: status %d, message '%s'", (int)st, mok_last_error());
        CHECK(mok_workspace_destroy(ws) == MOK_OK, "workspace destroy: %s", mok_last_error());
        CHECK(mok_group_destroy(g) == MOK_OK, "group destroy: %s", mok_last_error());
    }
}

/* ---- schedules and contexts that do not belong together (local mode) --------------------------- */

/* A local-mode session on layer L: its forward, then the buffers for a backward. */
static int local_forward(layer_backend *B, const layer *L, const mok_config *config, layer_result *out) {
    mok_status st = layer_backend_open(B, L, config);
    CHECK(st == MOK_OK, "open: %s", B->message);
    if (st == MOK_OK) st = layer_backend_forward(B, L, out);
    CHECK(st == MOK_OK, "forward: %s", out->message);
    return st == MOK_OK;
}

static void expect_refused(mok_status st, const char *what, const char *needle1, const char *needle2) {
    CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), needle1) &&
              (!needle2 || strstr(mok_last_error(), needle2)),
          "%s: status %d (%s), message '%s' (want INVALID_ARGUMENT naming '%s'%s%s)", what, (int)st,
          mok_status_string(st), mok_last_error(), needle1, needle2 ? " and " : "", needle2 ? needle2 : "");
}

/* The backward's argument arrays with result r's gradient buffers (allocated, poisoned). */
static void backward_buffers(const layer *L, layer_result *r) {
    const int64_t H = L->shape.hidden, k = L->shape.topk, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / L->nranks;
    for (int p = 0; p < L->nranks; ++p) {
        const int64_t T = L->num_tokens[p];
        r->dx[p] = alloc_aligned((size_t)(T * H) * 2);
        fill_u16(r->dx[p], (size_t)(T * H), LAYER_POISON_BF16);
        r->d_router_w[p] = alloc_aligned((size_t)(T * k) * 4);
        for (int64_t i = 0; i < T * k; ++i) r->d_router_w[p][i] = NAN;
        for (int m = 0; m < 3; ++m) {
            r->dw[m][p] = alloc_aligned((size_t)(El * I * H) * 2);
            fill_u16(r->dw[m][p], (size_t)(El * I * H), LAYER_POISON_BF16);
            r->ds[m][p] = Is ? alloc_aligned((size_t)(Is * H) * 2) : NULL;
            if (Is) fill_u16(r->ds[m][p], (size_t)(Is * H), LAYER_POISON_BF16);
        }
    }
}

/* A context buffer that no pass wrote: the bytes of a fresh allocation, poisoned. */
static void *fresh_context(size_t bytes) {
    void *c = alloc_aligned(bytes);
    fill_u16(c, bytes / 2, LAYER_POISON_BF16);
    return c;
}

/* A two-rank layer's schedule, context and y buffers of ws's sizes in r, and the schedule args
 * over them. poisoned: the schedule filled with 0xa5 and the context fresh (fresh_context). */
static void two_rank_buffers(mok_workspace *ws, const layer *L, const int64_t *T, int poisoned, layer_result *r,
                             mok_schedule_args sa[2]) {
    mok_sizes sz;
    mok_workspace_sizes(ws, &sz);
    r->nranks = 2;
    r->schedule_bytes = sz.schedule_bytes;
    r->context_bytes = sz.context_bytes;
    for (int p = 0; p < 2; ++p) {
        r->schedule[p] = alloc_aligned(sz.schedule_bytes);
        if (poisoned) memset(r->schedule[p], 0xa5, sz.schedule_bytes);
        r->context[p] = poisoned ? fresh_context(sz.context_bytes) : alloc_aligned(sz.context_bytes);
        r->y[p] = alloc_aligned((size_t)(T[p] * L->shape.hidden) * 2);
        sa[p] = (mok_schedule_args){T[p], L->topk_ids[p], r->schedule[p], NULL};
    }
}

MOK_TEST(protocol_backward_needs_its_forward) {
    /* The context's tag (which workspace, schedule build and rank wrote it) against the backward's
       schedule: a context no forward wrote, another rank's, and one written before the schedule
       was built again are refused; the context of the forward with the schedule's build runs. */
    const int64_t T[2] = {40, 31};
    layer L, L2;
    if (!make_layer(&L, 2, T, 64, 64, 64, 2, 20, LAYER_ROUTE_HOLES) ||
        !make_layer(&L2, 2, T, 64, 64, 64, 2, 21, LAYER_ROUTE_SKEWED))
        return;
    mok_config cfg = base_config(2000);
    layer_backend B;
    layer_result r = {0};
    if (local_forward(&B, &L, &cfg, &r)) {
        backward_buffers(&L, &r);
        mok_backward_args ba[MOK_MAX_RANKS];
        layer_backward_args(&L, &r, 0, ba);
        mok_schedule_args sa[MOK_MAX_RANKS];

        /* no forward wrote the context (a fresh buffer): refused */
        void *fresh[2];
        for (int p = 0; p < 2; ++p) ba[p].context = fresh[p] = fresh_context(r.context_bytes);
        expect_refused(mok_backward(B.workspace, ba), "backward with a context no forward wrote", "args[0].context",
                       "no mok_forward");
        for (int p = 0; p < 2; ++p) free(fresh[p]);

        /* the ranks' contexts swapped: refused */
        for (int p = 0; p < 2; ++p) ba[p].context = r.context[1 - p];
        expect_refused(mok_backward(B.workspace, ba), "backward with the other rank's context", "args[0].context",
                       "written by rank 1's pass");
        layer_backward_args(&L, &r, 0, ba);

        /* the schedule built again (another routing) after the forward: refused */
        for (int p = 0; p < 2; ++p) sa[p] = (mok_schedule_args){T[p], L2.topk_ids[p], r.schedule[p], NULL};
        CHECK(mok_schedule_build(B.workspace, sa) == MOK_OK, "rebuild: %s", mok_last_error());
        expect_refused(mok_backward(B.workspace, ba), "backward after its schedule was built again", "args[0].context",
                       "with schedule build #1, but args[0].schedule holds build #");

        /* built again with the forward's own routing: still another build than the context's */
        for (int p = 0; p < 2; ++p) sa[p] = (mok_schedule_args){T[p], L.topk_ids[p], r.schedule[p], NULL};
        CHECK(mok_schedule_build(B.workspace, sa) == MOK_OK, "rebuild: %s", mok_last_error());
        expect_refused(mok_backward(B.workspace, ba), "backward of a schedule without a forward", "args[0].context",
                       "with schedule build #1, but");

        /* a forward with the new build into another context; the old context is refused */
        void *old_context[MOK_MAX_RANKS];
        mok_forward_args fa[MOK_MAX_RANKS];
        layer_forward_args(&L, &r, fa);
        for (int p = 0; p < 2; ++p) {
            old_context[p] = r.context[p];
            fa[p].context = fresh_context(r.context_bytes);
        }
        CHECK(mok_forward(B.workspace, fa) == MOK_OK, "forward: %s", mok_last_error());
        expect_refused(mok_backward(B.workspace, ba), "backward with the context of an older build", "args[0].context",
                       "schedule build #1");

        /* with the new context the backward runs and matches the reference */
        for (int p = 0; p < 2; ++p) {
            r.context[p] = (void *)fa[p].context;
            ba[p].context = r.context[p];
            free(old_context[p]);
        }
        mok_status st = mok_backward(B.workspace, ba);
        CHECK(st == MOK_OK, "backward with its forward's context: %s", mok_last_error());
        layer_result ref = {0};
        if (st == MOK_OK && layer_run_reference(&L, &ref) == MOK_OK) {
            const double err = layer_compare(&L, &r, &ref, "backward after the refusals");
            CHECK(err <= 1.0, "backward after the refusals: worst error %.3g (MOK_TEST_SEED=%llu)", err, mok_test_seed());
        }
        layer_result_free(&ref);
    }
    layer_backend_close(&B);
    layer_result_free(&r);
    layer_free(&L);
    layer_free(&L2);
}

MOK_TEST(protocol_context_of_another_workspace) {
    /* Two workspaces of one group; the first keeps 128 context rows, the second all of them (a
       larger context). The second's backward with the first's context must be refused, not read
       past it; so must its passes with the first's schedule. Both workspaces' schedules are the
       build of their first call: only the workspaces' tags tell them apart. */
    const int64_t T[2] = {40, 31};
    layer L;
    if (!make_layer(&L, 2, T, 64, 64, 64, 4, 22, LAYER_ROUTE_UNIFORM)) return;
    mok_config small = base_config(2000), big = base_config(2000);
    small.context_rows = 128;
    mok_group *g = NULL;
    mok_workspace *ws[2] = {NULL, NULL};
    CHECK(mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &small) == MOK_OK, "group: %s", mok_last_error());
    CHECK(mok_workspace_create(&ws[0], g, &L.shape, &small) == MOK_OK, "small: %s", mok_last_error());
    CHECK(mok_workspace_create(&ws[1], g, &L.shape, &big) == MOK_OK, "big: %s", mok_last_error());
    layer_result r[2] = {{0}, {0}};
    if (ws[0] && ws[1]) {
        for (int w = 0; w < 2; ++w) {
            mok_schedule_args sa[2];
            two_rank_buffers(ws[w], &L, T, 0, &r[w], sa);
            CHECK(mok_schedule_build(ws[w], sa) == MOK_OK, "build %d: %s", w, mok_last_error());
            mok_forward_args fa[2];
            layer_forward_args(&L, &r[w], fa);
            CHECK(mok_forward(ws[w], fa) == MOK_OK, "forward %d: %s", w, mok_last_error());
            backward_buffers(&L, &r[w]);
        }
        CHECK(r[0].context_bytes < r[1].context_bytes, "context sizes %zu, %zu", r[0].context_bytes,
              r[1].context_bytes);
        mok_backward_args ba[2];
        layer_backward_args(&L, &r[1], 0, ba);
        for (int p = 0; p < 2; ++p) ba[p].context = r[0].context[p];
        expect_refused(mok_backward(ws[1], ba), "backward with another workspace's context", "args[0].context",
                       "workspace #0");
        layer_backward_args(&L, &r[1], 0, ba);
        for (int p = 0; p < 2; ++p) ba[p].schedule = r[0].schedule[p];
        expect_refused(mok_backward(ws[1], ba), "backward with another workspace's schedule", "args[0].schedule",
                       "workspace #0");
        mok_forward_args fa[2];
        layer_forward_args(&L, &r[1], fa);
        for (int p = 0; p < 2; ++p) fa[p].schedule = r[0].schedule[p];
        expect_refused(mok_forward(ws[1], fa), "forward with another workspace's schedule", "args[0].schedule",
                       "workspace #0");
        layer_backward_args(&L, &r[1], 0, ba);
        CHECK(mok_backward(ws[1], ba) == MOK_OK, "backward with its own buffers: %s", mok_last_error());
    }
    layer_result_free(&r[0]);
    layer_result_free(&r[1]);
    mok_workspace_destroy(ws[0]);
    mok_workspace_destroy(ws[1]);
    mok_group_destroy(g);
    layer_free(&L);
}

/* layer_equal, with the check's message. */
static void expect_equal(const layer *L, const layer_result *a, const layer_result *b, const char *what) {
    char diff[256] = "";
    CHECK(layer_equal(L, a, b, diff, sizeof diff), "%s: %s (MOK_TEST_SEED=%llu)", what, diff, mok_test_seed());
}

/* A copy of r's schedules and contexts in fresh buffers, and fresh y and gradient buffers
 * (poisoned): what the passes with the copies write. */
static void copy_buffers(const layer *L, const layer_result *r, layer_result *c) {
    memset(c, 0, sizeof *c);
    c->nranks = r->nranks;
    c->schedule_bytes = r->schedule_bytes;
    c->context_bytes = r->context_bytes;
    for (int p = 0; p < r->nranks; ++p) {
        c->schedule[p] = alloc_aligned(r->schedule_bytes);
        memcpy(c->schedule[p], r->schedule[p], r->schedule_bytes);
        c->context[p] = alloc_aligned(r->context_bytes);
        memcpy(c->context[p], r->context[p], r->context_bytes);
        const size_t y = (size_t)(L->num_tokens[p] * L->shape.hidden);
        c->y[p] = alloc_aligned(y * 2);
        fill_u16(c->y[p], y, LAYER_POISON_BF16);
    }
    backward_buffers(L, c);
}

/* The backward, then the forward, with c's schedules and contexts (which r's passes wrote): the
 * bits of r's. */
static void passes_with_copies(mok_workspace *ws, const layer *L, const layer_result *r, layer_result *c,
                               const char *what) {
    mok_backward_args ba[MOK_MAX_RANKS];
    layer_backward_args(L, c, 0, ba);
    mok_status st = mok_backward(ws, ba);
    CHECK(st == MOK_OK, "%s: backward: %s", what, mok_last_error());
    mok_forward_args fa[MOK_MAX_RANKS];
    layer_forward_args(L, c, fa);
    if (st == MOK_OK) st = mok_forward(ws, fa);
    CHECK(st == MOK_OK, "%s: forward: %s", what, mok_last_error());
    if (st == MOK_OK) expect_equal(L, r, c, what);
}

MOK_TEST(protocol_copies_of_schedule_and_context_serve) {
    /* The tags travel with the bytes: a schedule and a context copied into fresh buffers (the
       originals then overwritten) serve the backward and the forward as the originals did, to
       the bit. */
    const int64_t T[2] = {40, 31};
    layer L;
    if (!make_layer(&L, 2, T, 64, 64, 64, 2, 25, LAYER_ROUTE_HOLES)) return;
    mok_config cfg = base_config(2000);
    layer_backend B;
    layer_result r = {0}, c = {0};
    if (local_forward(&B, &L, &cfg, &r)) {
        mok_status st = layer_backend_backward(&B, &L, 0, &r);
        CHECK(st == MOK_OK, "backward with the originals: %s", r.message);
        copy_buffers(&L, &r, &c);
        for (int p = 0; p < 2; ++p) {
            memset(r.schedule[p], 0xa5, r.schedule_bytes);
            fill_u16(r.context[p], r.context_bytes / 2, LAYER_POISON_BF16);
        }
        if (st == MOK_OK) passes_with_copies(B.workspace, &L, &r, &c, "the copies of the schedules and contexts");
    }
    layer_backend_close(&B);
    layer_result_free(&r);
    layer_result_free(&c);
    layer_free(&L);
}

MOK_TEST(protocol_buffer_of_one_workspace_reused_by_another) {
    /* Two workspaces A and B of one group, each with its own schedule and context buffers, which
       its passes wrote. A's buffers then take copies of B's schedules and contexts, as an
       allocator hands a buffer freed by one layer to the next: B's passes take them, to the bit
       of its own buffers. What a buffer's address held before means nothing. */
    const int64_t T[2] = {40, 31};
    layer L;
    if (!make_layer(&L, 2, T, 64, 64, 64, 2, 26, LAYER_ROUTE_UNIFORM)) return;
    mok_config cfg = base_config(2000);
    mok_group *g = NULL;
    mok_workspace *ws[2] = {NULL, NULL};
    CHECK(mok_group_create_local(&g, MOK_BACKEND_CPU, 2, NULL, &cfg) == MOK_OK, "group: %s", mok_last_error());
    for (int w = 0; w < 2 && g; ++w)
        CHECK(mok_workspace_create(&ws[w], g, &L.shape, &cfg) == MOK_OK, "workspace %d: %s", w, mok_last_error());
    layer_result r[2] = {{0}, {0}}, c = {0};
    if (ws[0] && ws[1]) {
        mok_status st = MOK_OK;
        for (int w = 0; w < 2; ++w) {
            mok_schedule_args sa[2];
            two_rank_buffers(ws[w], &L, T, 1, &r[w], sa);
            backward_buffers(&L, &r[w]);
            mok_forward_args fa[2];
            mok_backward_args ba[2];
            layer_forward_args(&L, &r[w], fa);
            layer_backward_args(&L, &r[w], 0, ba);
            if (st == MOK_OK) st = mok_schedule_build(ws[w], sa);
            if (st == MOK_OK) st = mok_forward(ws[w], fa);
            if (st == MOK_OK) st = mok_backward(ws[w], ba);
            CHECK(st == MOK_OK, "workspace %d's passes with its own buffers: %s", w, mok_last_error());
        }
        if (st == MOK_OK) {
            /* c: A's schedule and context buffers, now holding B's bytes */
            copy_buffers(&L, &r[1], &c);
            for (int p = 0; p < 2; ++p) {
                memcpy(r[0].schedule[p], r[1].schedule[p], r[1].schedule_bytes);
                memcpy(r[0].context[p], r[1].context[p], r[1].context_bytes);
                free(c.schedule[p]);
                free(c.context[p]);
                c.schedule[p] = r[0].schedule[p];
                c.context[p] = r[0].context[p];
                r[0].schedule[p] = r[0].context[p] = NULL;
            }
            passes_with_copies(ws[1], &L, &r[1], &c, "workspace B's passes with A's buffers holding B's bytes");
        }
    }
    layer_result_free(&r[0]);
    layer_result_free(&r[1]);
    layer_result_free(&c);
    mok_workspace_destroy(ws[0]);
    mok_workspace_destroy(ws[1]);
    mok_group_destroy(g);
    layer_free(&L);
}

/* One change of a schedule buffer: the field, and the value written there. */
typedef struct schedule_change {
    const char *what;
    int64_t *(*where)(const mok_sched_view *v); /* an int64 field, or NULL */
    int32_t *(*where32)(const mok_sched_view *v);
    int64_t value;
} schedule_change;
static int64_t *at_padded_rows(const mok_sched_view *v) { return &v->header->padded_rows; }
static int64_t *at_num_tokens(const mok_sched_view *v) { return &v->header->num_tokens[1]; }
static int64_t *at_expert_start(const mok_sched_view *v) { return &v->expert_start[1]; }
static int64_t *at_expert_rows(const mok_sched_view *v) { return &v->expert_rows[0]; }
static int32_t *at_row_peer(const mok_sched_view *v) { return &v->row_peer[0]; }
static int32_t *at_row_slot(const mok_sched_view *v) { return &v->row_slot[1]; }

MOK_TEST(protocol_changed_schedule_is_refused) {
    /* A schedule written after its build must not make a pass read or write out of bounds: each
       change below is refused, random words of the buffer set to large or negative values are
       refused or harmless, and the schedule put back runs. The fields are found through
       core/schedule.h's layout. */
    const int64_t T[2] = {40, 31};
    layer L;
    if (!make_layer(&L, 2, T, 64, 64, 64, 2, 23, LAYER_ROUTE_UNIFORM)) return;
    mok_config cfg = base_config(2000);
    layer_backend B;
    layer_result r = {0};
    if (local_forward(&B, &L, &cfg, &r)) {
        mok_sched_layout layout;
        mok__sched_layout(&layout, 2, L.shape.num_experts / 2, L.shape.topk, L.shape.max_tokens);
        const mok_sched_view v = mok__sched_view(&layout, r.schedule[0]);
        void *keep = alloc_aligned(r.schedule_bytes);
        memcpy(keep, r.schedule[0], r.schedule_bytes);
        const int64_t padded = v.header->padded_rows;
        mok_forward_args fa[MOK_MAX_RANKS];
        layer_forward_args(&L, &r, fa);
        CHECK(v.header->padded_rows > 0 && v.expert_rows[0] > 1, "the test needs rows on rank 0's first expert");
        const schedule_change changes[] = {
            {"padded_rows beyond the capacity", at_padded_rows, NULL, layout.max_rows + MOK_ROW_TILE},
            {"padded_rows not a multiple of the row tile", at_padded_rows, NULL, padded + 1},
            {"padded_rows negative", at_padded_rows, NULL, -MOK_ROW_TILE},
            {"a peer's num_tokens beyond max_tokens", at_num_tokens, NULL, L.shape.max_tokens + 1},
            {"an expert's segment moved", at_expert_start, NULL, 1 << 30},
            {"an expert's rows beyond its segment", at_expert_rows, NULL, 1 << 20},
            {"a row from rank 9", NULL, at_row_peer, 9},
            {"a row from rank -2", NULL, at_row_peer, -2},
            {"a row's slot beyond its rank's tokens", NULL, at_row_slot, 1 << 28},
            {"a row's slot negative", NULL, at_row_slot, -5},
        };
        for (size_t i = 0; i < sizeof changes / sizeof changes[0]; ++i) {
            memcpy(r.schedule[0], keep, r.schedule_bytes);
            if (changes[i].where) *changes[i].where(&v) = changes[i].value;
            else *changes[i].where32(&v) = (int32_t)changes[i].value;
            expect_refused(mok_forward(B.workspace, fa), changes[i].what, "args[0].schedule", "changed since its build");
        }
        /* random words, each set to a large or a negative value: refused, or a pass that runs */
        int refused = 0, ran = 0;
        uint64_t state = mok_test_seed() ^ 0x5eedull;
        const int64_t words = (int64_t)r.schedule_bytes / 4;
        for (int n = 0; n < (mok_test_quick() ? 40 : 200); ++n) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            const int64_t at = 4 * (int64_t)((state >> 33) % (uint64_t)words);
            const int32_t bad = (n & 1) ? 0x3fffffff : -7;
            memcpy(r.schedule[0], keep, r.schedule_bytes);
            memcpy((char *)r.schedule[0] + at, &bad, 4);
            mok_status st = mok_forward(B.workspace, fa);
            if (st == MOK_OK) ++ran;
            else if (st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "args[0]")) ++refused;
            else CHECK(0, "a schedule word at byte %lld set to %d: status %d, message '%s' (MOK_TEST_SEED=%llu)",
                       (long long)at, bad, (int)st, mok_last_error(), mok_test_seed());
        }
        CHECK(refused > 0, "no change of a schedule word was refused (%d passes ran)", ran);
        memcpy(r.schedule[0], keep, r.schedule_bytes);
        mok_status st = mok_forward(B.workspace, fa);
        CHECK(st == MOK_OK, "the schedule put back: %s", mok_last_error());
        layer_result ref = {0};
        if (st == MOK_OK && layer_run_reference_forward(&L, &ref) == MOK_OK) {
            const double err = layer_compare(&L, &r, &ref, "forward with the schedule put back");
            CHECK(err <= 1.0, "forward with the schedule put back: worst error %.3g", err);
        }
        layer_result_free(&ref);
        free(keep);
    }
    layer_backend_close(&B);
    layer_result_free(&r);
    layer_free(&L);
}

MOK_TEST(protocol_schedule_read_checks_the_rank) {
    const int64_t T[2] = {40, 31};
    layer L;
    if (!make_layer(&L, 2, T, 64, 64, 64, 2, 24, LAYER_ROUTE_UNIFORM)) return;
    mok_config cfg = base_config(2000);
    layer_backend B;
    layer_result r = {0};
    if (local_forward(&B, &L, &cfg, &r)) {
        mok_schedule_info info;
        expect_refused(mok_schedule_read(B.workspace, r.schedule[0], 1, &info), "rank 0's schedule read as local rank 1",
                       "built for rank 0", "local rank 1");
        expect_refused(mok_schedule_read(B.workspace, r.schedule[1], 0, &info), "rank 1's schedule read as local rank 0",
                       "built for rank 1", "local rank 0");
        CHECK(mok_schedule_read(B.workspace, r.schedule[1], 1, &info) == MOK_OK, "own schedule: %s", mok_last_error());
    }
    layer_backend_close(&B);
    layer_result_free(&r);
    layer_free(&L);
}
