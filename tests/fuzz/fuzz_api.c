/* fuzz_api.c — a libFuzzer target over mok's public API on the cpu backend: the input chooses a
 * layer (shape, config, tokens per rank, routings with -1 slots and bad ids, NaN or Inf in the
 * data), local mode or one thread per rank, and a short program of calls (schedule builds,
 * forwards, recomputes, backwards, schedule reads, workspaces destroyed and made again), in per-rank
 * mode possibly different on each rank or skipped by one.
 *
 * The one idea: the target keeps a model of what every call is, and judges the library by it. A
 * call that every rank makes alike with arguments that belong together must return MOK_OK and agree
 * with the fp64 reference within tests/layer.c's tolerance table; a call that certainly does not
 * (ranks in different calls or schedule builds, a bad argument on any rank, a backward whose
 * schedule build had no forward or whose context another build wrote, any call in a group that a
 * timeout made unusable) must fail on every rank; the rest is only run. A disagreement aborts the
 * run, so libFuzzer reports it like a crash; crashes, sanitizer reports and hangs (-timeout) are
 * findings by themselves.
 *
 * Input: a stream of bytes, each read as a choice in a small range (missing bytes read as 0), in
 * the order of setup() and then one op per 3 bytes (run()). The data itself comes from a seed in
 * the input, so inputs stay short. */
#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"
#include "mok.h"

#define MAX_P 3
#define MAX_OPS 12
#define PER_RANK_TIMEOUT_MS 1000.0 /* a skipped call costs this much; calls that agree take far less */

/* ---- the input ----------------------------------------------------------------------------- */

typedef struct reader {
    const uint8_t *p;
    size_t n;
} reader;

static unsigned take(reader *r, unsigned range) {
    if (range <= 1 || r->n == 0) return 0;
    const unsigned v = r->p[0];
    ++r->p;
    --r->n;
    return v % range;
}

/* ---- failures ------------------------------------------------------------------------------- */

static void finding(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void finding(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz_api finding: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

static void *alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) finding("out of host memory (%zu bytes)", bytes);
    return p;
}

/* ---- the world: layer, buffers and the model -------------------------------------------------- */

enum { OP_SCHEDULE, OP_FORWARD, OP_RECOMPUTE, OP_BACKWARD, OP_READ, OP_RECREATE, OP_NUM };
static const char *op_name[OP_NUM] = {"schedule", "forward", "recompute", "backward", "read", "recreate"};

typedef struct rank_op {
    int kind;  /* OP_*, or -1: this rank skips the call */
    int sched; /* schedule buffer 0 or 1 */
    int ctx;   /* context buffer 0 or 1 */
    int variant; /* OP_SCHEDULE: routing 0 or 1; OP_READ: local rank read as */
} rank_op;

typedef struct sched_model {
    int known;      /* 0 after a failed build: the buffer may hold the old schedule or part of one */
    int64_t build;  /* the build it holds, named by its op's index + 1 (0: never built) */
    int variant[MAX_P]; /* the routing each rank built it with */
    int forwarded;  /* a forward or recompute of this rank ran with this build */
} sched_model;

typedef struct ctx_model {
    int known;     /* the library knows what wrote it (a forward or recompute that returned OK, or none) */
    int64_t build; /* the build its pass read (0: never written) */
} ctx_model;

typedef struct world {
    int per_rank, P;
    mok_shape shape;          /* the workspace's (max_tokens may be below a rank's tokens) */
    mok_config config[MAX_P]; /* each rank's workspace config */
    int configs_agree;
    layer L;                  /* data; topk_ids are routing 0's */
    int32_t *ids[2][MAX_P];   /* the two routings */
    int ids_valid[2];         /* every id of that routing in [-1, E) on every rank */
    int tokens_valid;         /* every rank's T <= max_tokens */
    /* buffers, per rank */
    void *sched[2][MAX_P], *ctx[2][MAX_P];
    uint16_t *y[MAX_P], *dx[MAX_P];
    float *drw[MAX_P];
    uint16_t *dw[3][MAX_P], *ds[3][MAX_P];
    size_t sched_bytes, ctx_bytes;
    /* the model, per rank */
    sched_model sm[2][MAX_P];
    ctx_model cm[2][MAX_P];
    int dead;       /* a timeout (or a destroy out of step) made the group unusable */
    int have_workspace;
    /* handles */
    mok_unique_id id;
    mok_group *group[MAX_P];   /* per-rank mode: one per rank; local: [0] */
    mok_workspace *ws[MAX_P];
    /* the op in progress (per-rank threads) */
    rank_op op[MAX_P];
    mok_status status[MAX_P];
    char message[MAX_P][512];
    pthread_barrier_t step;
} world;

static void free_buffers(world *w) {
    for (int p = 0; p < MAX_P; ++p) {
        for (int b = 0; b < 2; ++b) {
            free(w->sched[b][p]);
            free(w->ctx[b][p]);
            w->sched[b][p] = w->ctx[b][p] = NULL;
        }
        free(w->y[p]);
        free(w->dx[p]);
        free(w->drw[p]);
        w->y[p] = w->dx[p] = NULL;
        w->drw[p] = NULL;
        for (int m = 0; m < 3; ++m) {
            free(w->dw[m][p]);
            free(w->ds[m][p]);
            w->dw[m][p] = w->ds[m][p] = NULL;
        }
    }
}

/* Buffers of every rank for the workspace's sizes, poisoned; the model starts empty. */
static void alloc_buffers(world *w, const mok_sizes *sz) {
    free_buffers(w);
    const int64_t H = w->shape.hidden, I = w->shape.intermediate, Is = w->shape.shared_intermediate;
    const int64_t k = w->shape.topk, El = w->shape.num_experts / w->P;
    w->sched_bytes = sz->schedule_bytes;
    w->ctx_bytes = sz->context_bytes;
    for (int p = 0; p < w->P; ++p) {
        const int64_t T = w->L.num_tokens[p];
        for (int b = 0; b < 2; ++b) {
            w->sched[b][p] = alloc_aligned(sz->schedule_bytes);
            memset(w->sched[b][p], 0x5a, sz->schedule_bytes);
            w->ctx[b][p] = alloc_aligned(sz->context_bytes);
            memset(w->ctx[b][p], 0xff, sz->context_bytes);
        }
        w->y[p] = alloc_aligned((size_t)(T * H) * 2);
        w->dx[p] = alloc_aligned((size_t)(T * H) * 2);
        w->drw[p] = alloc_aligned((size_t)(T * k) * 4);
        for (int m = 0; m < 3; ++m) {
            w->dw[m][p] = alloc_aligned((size_t)(El * I * H) * 2);
            w->ds[m][p] = Is ? alloc_aligned((size_t)(Is * H) * 2) : NULL;
        }
    }
    memset(w->sm, 0, sizeof w->sm);
    memset(w->cm, 0, sizeof w->cm);
    for (int b = 0; b < 2; ++b)
        for (int p = 0; p < MAX_P; ++p) w->sm[b][p].known = w->cm[b][p].known = 1;
}

static void poison_outputs(world *w) {
    const int64_t H = w->shape.hidden, I = w->shape.intermediate, Is = w->shape.shared_intermediate;
    const int64_t k = w->shape.topk, El = w->shape.num_experts / w->P;
    for (int p = 0; p < w->P; ++p) {
        const int64_t T = w->L.num_tokens[p];
        for (int64_t i = 0; i < T * H; ++i) w->y[p][i] = w->dx[p][i] = LAYER_POISON_BF16;
        for (int64_t i = 0; i < T * k; ++i) w->drw[p][i] = NAN;
        for (int m = 0; m < 3; ++m) {
            for (int64_t i = 0; i < El * I * H; ++i) w->dw[m][p][i] = LAYER_POISON_BF16;
            for (int64_t i = 0; Is && i < Is * H; ++i) w->ds[m][p][i] = LAYER_POISON_BF16;
        }
    }
}

/* ---- the calls -------------------------------------------------------------------------------- */

static mok_forward_args forward_args(const world *w, int p, const rank_op *o) {
    const layer *L = &w->L;
    mok_forward_args a = {L->num_tokens[p], w->sched[o->sched][p], L->x[p], L->router_w[p],
                          L->w[LAYER_GATE][p], L->w[LAYER_UP][p], L->w[LAYER_DOWN][p], L->s[LAYER_GATE],
                          L->s[LAYER_UP], L->s[LAYER_DOWN], w->y[p], w->ctx[o->ctx][p], NULL};
    return a;
}

static mok_backward_args backward_args(const world *w, int p, const rank_op *o) {
    const layer *L = &w->L;
    mok_backward_args a;
    memset(&a, 0, sizeof a);
    a.num_tokens = L->num_tokens[p];
    a.schedule = w->sched[o->sched][p];
    a.context = w->ctx[o->ctx][p];
    a.dy = L->dy[p];
    a.x = L->x[p];
    a.router_w = L->router_w[p];
    a.w_gate = L->w[LAYER_GATE][p];
    a.w_up = L->w[LAYER_UP][p];
    a.w_down = L->w[LAYER_DOWN][p];
    a.s_gate = L->s[LAYER_GATE];
    a.s_up = L->s[LAYER_UP];
    a.s_down = L->s[LAYER_DOWN];
    a.dx = w->dx[p];
    a.d_router_w = w->drw[p];
    a.dw_gate = w->dw[LAYER_GATE][p];
    a.dw_up = w->dw[LAYER_UP][p];
    a.dw_down = w->dw[LAYER_DOWN][p];
    a.ds_gate = w->ds[LAYER_GATE][p];
    a.ds_up = w->ds[LAYER_UP][p];
    a.ds_down = w->ds[LAYER_DOWN][p];
    return a;
}

/* The call of op kind on handle index h with args of ranks [first, first + n). */
static mok_status call(world *w, int h, int first, int n) {
    mok_workspace *ws = w->ws[h];
    const rank_op *o = &w->op[first];
    mok_schedule_args sa[MAX_P];
    mok_forward_args fa[MAX_P];
    mok_backward_args ba[MAX_P];
    for (int i = 0; i < n; ++i) {
        const int p = first + i;
        const rank_op *q = &w->op[p];
        sa[i] = (mok_schedule_args){w->L.num_tokens[p], w->ids[q->kind == OP_SCHEDULE ? q->variant : 0][p],
                                    w->sched[q->sched][p], NULL};
        fa[i] = forward_args(w, p, q);
        ba[i] = backward_args(w, p, q);
    }
    switch (o->kind) {
    case OP_SCHEDULE: return mok_schedule_build(ws, sa);
    case OP_FORWARD: return mok_forward(ws, fa);
    case OP_RECOMPUTE:
        for (int i = 0; i < n; ++i) fa[i].y = NULL, fa[i].w_down = NULL, fa[i].s_down = NULL;
        return mok_recompute_context(ws, fa);
    case OP_BACKWARD: return mok_backward(ws, ba);
    case OP_READ: {
        mok_schedule_info info;
        mok_status st = mok_schedule_read(ws, w->sched[o->sched][first], o->variant, &info);
        if (st == MOK_OK)
            for (int p = 0; p < w->P; ++p)
                if (info.num_tokens[p] != w->L.num_tokens[p])
                    finding("mok_schedule_read: rank %d's T %lld, the layer's %lld", p, (long long)info.num_tokens[p],
                            (long long)w->L.num_tokens[p]);
        return st;
    }
    }
    return MOK_OK;
}

static void note(world *w, int p, mok_status st) {
    w->status[p] = st;
    snprintf(w->message[p], sizeof w->message[p], "%s", st == MOK_OK ? "" : mok_last_error());
}

typedef struct rank_thread {
    world *w;
    int p, num_ops;
    const rank_op (*ops)[MAX_P];
    void (*judge)(world *w, int index);
} rank_thread;

static void judge(world *w, int index);

/* Per-rank mode: thread p runs its part of every op; after each, all threads meet, rank 0's thread
 * judges the op, and all meet again. */
static void *rank_main(void *arg) {
    rank_thread *t = arg;
    world *w = t->w;
    for (int i = 0; i < t->num_ops; ++i) {
        if (t->p == 0) memcpy(w->op, t->ops[i], sizeof w->op);
        pthread_barrier_wait(&w->step);
        const rank_op *o = &w->op[t->p];
        mok_status st = MOK_OK;
        if (o->kind == OP_RECREATE) {
            st = mok_workspace_destroy(w->ws[t->p]);
            w->ws[t->p] = NULL;
            mok_status cst = mok_workspace_create(&w->ws[t->p], w->group[t->p], &w->shape, &w->config[t->p]);
            if (st == MOK_OK) st = cst;
        } else if (o->kind >= 0 && w->ws[t->p]) {
            st = call(w, t->p, t->p, 1);
        }
        note(w, t->p, st);
        pthread_barrier_wait(&w->step);
        if (t->p == 0) judge(w, i);
        pthread_barrier_wait(&w->step);
    }
    return NULL;
}

/* ---- the judge -------------------------------------------------------------------------------- */

/* The layer of the routings the ranks built `build` with, as the reference sees it. */
static layer routed_layer(const world *w, const sched_model *const *models) {
    layer Lr = w->L;
    for (int p = 0; p < w->P; ++p) Lr.topk_ids[p] = w->ids[models[p]->variant[p]][p];
    return Lr;
}

static void compare(world *w, const sched_model *const *models, int backward, const char *what) {
    layer Lr = routed_layer(w, models);
    layer_result ref = {0}, got = {0};
    mok_status st = backward ? layer_run_reference(&Lr, &ref) : layer_run_reference_forward(&Lr, &ref);
    if (st != MOK_OK) finding("%s: the reference failed: %s", what, mok_last_error());
    got.nranks = w->P;
    for (int p = 0; p < w->P; ++p) {
        /* the backward is judged on its own outputs: y is the reference's own */
        got.y[p] = backward ? ref.y[p] : w->y[p];
        if (!backward) continue;
        got.dx[p] = w->dx[p];
        got.d_router_w[p] = w->drw[p];
        for (int m = 0; m < 3; ++m) got.dw[m][p] = w->dw[m][p], got.ds[m][p] = w->ds[m][p];
    }
    char tag[96];
    snprintf(tag, sizeof tag, "fuzz %s", what);
    const double err = layer_compare(&Lr, &got, &ref, tag);
    if (!(err <= 1.0)) finding("%s: worst error %.3g of the tolerance against the reference", what, err);
    layer_result_free(&ref);
}

static int is_pass(int kind) { return kind == OP_FORWARD || kind == OP_RECOMPUTE || kind == OP_BACKWARD; }

/* Judges op `index` from the statuses of every rank, then moves the model on. The library names a
 * schedule build by its call's number; every rank makes one call per op while the group lives, so
 * the op's index names it here. */
static void judge(world *w, int index) {
    const int P = w->P;
    const rank_op *o = w->op;
    if (getenv("MOK_FUZZ_VERBOSE"))
        for (int p = 0; p < P; ++p)
            fprintf(stderr, "op %d rank %d: %s sched %d ctx %d variant %d -> %s %s\n", index, p,
                    o[p].kind >= 0 ? op_name[o[p].kind] : "skip", o[p].sched, o[p].ctx, o[p].variant,
                    mok_status_string(w->status[p]), w->message[p]);
    if (!w->have_workspace) return;
    int all_ok = 1, none_ok = 1;
    for (int p = 0; p < P; ++p) {
        if (o[p].kind < 0) continue;
        all_ok &= w->status[p] == MOK_OK;
        none_ok &= w->status[p] != MOK_OK;
    }
    char what[96];
    snprintf(what, sizeof what, "op %d (%s, %s mode, P = %d)", index, o[0].kind >= 0 ? op_name[o[0].kind] : "skipped",
             w->per_rank ? "per-rank" : "local", P);
#define MUST_FAIL(why)                                                                                  \
    do {                                                                                                \
        if (!none_ok) finding("%s: returned MOK_OK on a rank although %s", what, why);                  \
    } while (0)
#define MUST_PASS()                                                                                     \
    do {                                                                                                \
        for (int p_ = 0; p_ < P; ++p_)                                                                  \
            if (w->status[p_] != MOK_OK)                                                                \
                finding("%s: rank %d failed a call that every rank made alike: %s (%s)", what, p_,       \
                        mok_status_string(w->status[p_]), w->message[p_]);                              \
    } while (0)

    int same_kind = 1, skipped = 0, recreated = 0;
    for (int p = 0; p < P; ++p) {
        same_kind &= o[p].kind == o[0].kind;
        skipped |= o[p].kind < 0;
        recreated |= o[p].kind == OP_RECREATE;
    }
    const int was_dead = w->dead;
    for (int p = 0; p < P; ++p)
        if (w->status[p] == MOK_ERR_TIMEOUT || w->status[p] == MOK_ERR_STATE) w->dead = 1;

    if (recreated && same_kind) {
        /* the model starts again on the new workspaces (when every rank has one) */
        int made = 1;
        for (int p = 0; p < (w->per_rank ? P : 1); ++p) made &= w->ws[p] != NULL;
        if (!was_dead && !made) finding("%s: a workspace made again with the same shape and config failed: %s", what,
                                        w->message[0]);
        if (made) {
            mok_sizes sz;
            mok_workspace_sizes(w->ws[0], &sz);
            alloc_buffers(w, &sz);
        }
        w->have_workspace = made;
        return;
    }
    if (was_dead) MUST_FAIL("the group was unusable after a timeout");
    else if (!same_kind) MUST_FAIL("the ranks were in different calls");
    else if (skipped) MUST_FAIL("a rank skipped the call");
    if (was_dead || !same_kind || skipped) {
        if (recreated) w->have_workspace = 0, w->dead = 1; /* a destroy out of step poisons the group */
        goto forget;
    }
    if (o[0].kind == OP_READ) {
        /* local mode only: schedule buffer o.sched of rank 0, read as local rank o.variant */
        const sched_model *s = &w->sm[o[0].sched][0];
        if (o[0].variant != 0) MUST_FAIL("a rank read another rank's schedule");
        else if (s->known && s->build) MUST_PASS();
        else if (s->known) MUST_FAIL("the buffer holds no schedule");
        return;
    }
    const int64_t op_build = index + 1;
    if (o[0].kind == OP_SCHEDULE) {
        int valid = w->tokens_valid;
        for (int p = 0; p < P; ++p) valid &= w->ids_valid[o[p].variant];
        if (valid) MUST_PASS();
        else MUST_FAIL("a rank's tokens or expert ids broke a rule");
        for (int p = 0; p < P; ++p) {
            sched_model *s = &w->sm[o[p].sched][p];
            s->known = all_ok;
            s->build = all_ok ? op_build : 0;
            s->forwarded = 0;
            for (int q = 0; q < P; ++q) s->variant[q] = o[q].variant;
        }
        return;
    }
    /* a pass */
    const sched_model *models[MAX_P];
    int64_t build = -1;
    int same_build = 1, built = 1, unknown = 0;
    for (int p = 0; p < P; ++p) {
        models[p] = &w->sm[o[p].sched][p];
        unknown |= !models[p]->known;
        built &= models[p]->build > 0;
        if (build < 0) build = models[p]->build;
        same_build &= models[p]->build == build;
    }
    if (!w->tokens_valid) {
        MUST_FAIL("a rank's num_tokens is above max_tokens");
        goto forget;
    }
    if (unknown) goto forget; /* run, not judged */
    if (!built) {
        MUST_FAIL("a rank's schedule buffer holds no schedule");
        goto forget;
    }
    if (!same_build) {
        MUST_FAIL("the ranks read different schedule builds");
        goto forget;
    }
    if (o[0].kind == OP_BACKWARD) {
        int unforwarded = 0, other_build = 0, unjudged = 0;
        for (int p = 0; p < P; ++p) {
            const ctx_model *c = &w->cm[o[p].ctx][p];
            unforwarded |= !models[p]->forwarded;
            unjudged |= !c->known || !c->build; /* the model cannot tell what its tag holds */
            other_build |= c->known && c->build && c->build != build;
        }
        if (unforwarded) MUST_FAIL("no forward ran with the schedule build");
        else if (other_build) MUST_FAIL("a context was written with another schedule build");
        else if (!unjudged) {
            MUST_PASS();
            compare(w, models, 1, what);
        }
        return;
    }
    /* forward, recompute: their arguments belong together */
    MUST_PASS();
    if (o[0].kind == OP_FORWARD) compare(w, models, 0, what);
    for (int p = 0; p < P; ++p) {
        w->sm[o[p].sched][p].forwarded = 1;
        w->cm[o[p].ctx][p] = (ctx_model){1, build};
    }
    return;
forget:
    /* a failed pass may have written part of its context, a failed build part of its schedule */
    for (int p = 0; p < P; ++p) {
        if (o[p].kind == OP_FORWARD || o[p].kind == OP_RECOMPUTE) w->cm[o[p].ctx][p].known = 0;
        if (o[p].kind == OP_SCHEDULE) w->sm[o[p].sched][p].known = 0;
    }
#undef MUST_FAIL
#undef MUST_PASS
}

/* ---- setup ------------------------------------------------------------------------------------ */

static int setup(world *w, reader *r) {
    memset(w, 0, sizeof *w);
    w->per_rank = (int)take(r, 2);
    w->P = 1 + (int)take(r, MAX_P);
    const int P = w->P;
    mok_shape s;
    s.hidden = 64 * (1 + take(r, 2));
    s.intermediate = 64 * (1 + take(r, 2));
    s.shared_intermediate = 64 * take(r, 2);
    s.num_experts = P * (1 + (int64_t)take(r, 3));
    s.topk = 1 + (int64_t)take(r, (unsigned)(s.num_experts < 4 ? s.num_experts : 4));
    s.max_tokens = 1 + (int64_t)take(r, 48);
    s.precision = MOK_PRECISION_BF16;
    mok_config c = MOK_CONFIG_INIT;
    c.minibatch_rows = 128 * (1 + (int)take(r, 2));
    c.ring_rows = c.minibatch_rows * (1 + (int)take(r, 2));
    static const int64_t context_rows[4] = {0, 100, 128, 256};
    c.context_rows = context_rows[take(r, 4)];
    static const float limits[3] = {0.0f, 1.5f, 7.0f};
    c.swiglu_limit = limits[take(r, 3)];
    const unsigned turned = take(r, 16);
    c.fwd_dispatch = (turned & 1) ? MOK_PUSH : MOK_PULL;
    c.fwd_combine = (turned & 2) ? MOK_PULL : MOK_PUSH;
    c.bwd_combine = (turned & 4) ? MOK_PUSH : MOK_PULL;
    c.bwd_dispatch = (turned & 8) ? MOK_PULL : MOK_PUSH;
    c.cpu_threads = 2 + (int)take(r, 2);
    c.cpu_comm_threads = 1;
    c.peer_timeout_ms = w->per_rank ? PER_RANK_TIMEOUT_MS : 60000.0;
    for (int p = 0; p < MAX_P; ++p) w->config[p] = c;
    /* a rank whose config differs in a field of the protocol (or one of its own) */
    w->configs_agree = 1;
    const unsigned differ = w->per_rank && P > 1 ? take(r, 8) : 0;
    mok_config *last = &w->config[P - 1];
    switch (differ) {
    case 1: last->ring_rows *= 2, w->configs_agree = 0; break;
    case 2: last->fwd_combine ^= 1, w->configs_agree = 0; break;
    case 3: last->bwd_combine ^= 1, w->configs_agree = 0; break;
    case 4: last->context_rows += 128, w->configs_agree = 0; break;
    case 5: last->cpu_threads = 4; break; /* a rank's own */
    default: break;
    }
    /* tokens: uneven, zero, now and then one past max_tokens */
    int64_t tokens[MOK_MAX_RANKS] = {0};
    w->tokens_valid = 1;
    for (int p = 0; p < P; ++p) {
        const unsigned t = take(r, 64);
        tokens[p] = t < 56 ? (int64_t)(t % (unsigned)(s.max_tokens + 1)) : t < 62 ? 0 : s.max_tokens + 1;
        w->tokens_valid &= tokens[p] <= s.max_tokens;
    }
    const uint64_t seed = (uint64_t)take(r, 256) | (uint64_t)take(r, 256) << 8;
    int routing = (int)take(r, LAYER_ROUTE_NUM_MODES);
    if (routing == LAYER_ROUTE_EVEN && 2 * s.topk > s.num_experts) routing = LAYER_ROUTE_UNIFORM;
    if (take(r, 4) == 0) routing |= LAYER_SIGNED_WEIGHTS;
    mok_shape ls = s;
    if (layer_make(&w->L, &ls, P, tokens, seed, routing) != 0) finding("layer_make failed");
    w->L.swiglu_limit = c.swiglu_limit;
    w->shape = s;
    /* the second routing: another layer's, same shape and tokens */
    layer other;
    int routing2 = (int)take(r, LAYER_ROUTE_NUM_MODES);
    if (routing2 == LAYER_ROUTE_EVEN && 2 * s.topk > s.num_experts) routing2 = LAYER_ROUTE_HOLES;
    if (layer_make(&other, &ls, P, tokens, seed ^ 0xabcdefull, routing2) != 0) finding("layer_make failed");
    const int64_t k = s.topk;
    for (int v = 0; v < 2; ++v) {
        w->ids_valid[v] = 1;
        for (int p = 0; p < P; ++p) {
            const int64_t n = tokens[p] * k;
            w->ids[v][p] = alloc_aligned((size_t)n * 4 + 4);
            if (n > 0) memcpy(w->ids[v][p], (v ? other.topk_ids : w->L.topk_ids)[p], (size_t)n * 4);
        }
    }
    layer_free(&other);
    /* bad ids: up to two, in either routing */
    for (int b = 0; b < 2; ++b) {
        const unsigned what = take(r, 8);
        const int v = (int)take(r, 2), p = (int)take(r, (unsigned)P);
        const int64_t n = tokens[p] * k;
        if (what < 4 || n == 0) continue;
        /* 4, 5, 6: an id outside [-1, E); 7: an empty slot (valid) */
        const int32_t value = what == 4 ? -2 : what == 5 ? 0x7fffffff : what == 6 ? (int32_t)s.num_experts : -1;
        w->ids[v][p][take(r, 256) % (unsigned)n] = value;
    }
    /* valid: every id in [-1, E), found by reading them (the second write may land on the first's
       slot and undo a bad id) */
    for (int v = 0; v < 2; ++v)
        for (int p = 0; p < P; ++p)
            for (int64_t i = 0; i < tokens[p] * k; ++i)
                if (w->ids[v][p][i] < -1 || w->ids[v][p][i] >= s.num_experts) w->ids_valid[v] = 0;
    /* the clamp's gradient mask must not sit on a rounding midpoint, for either routing (a row
       redrawn for one is checked again for the other) */
    for (int round = 0, redrawn = 1; redrawn && round < 8; ++round) {
        redrawn = 0;
        for (int v = 0; v < 2; ++v) {
            layer Lv = w->L;
            for (int p = 0; p < P; ++p) Lv.topk_ids[p] = w->ids[v][p];
            if (w->ids_valid[v]) redrawn += layer_avoid_clamp_flips(&Lv);
        }
    }
    /* NaN or Inf in x, dy or the router weights */
    const unsigned nonfinite = take(r, 8);
    if (nonfinite >= 5) {
        const int p = (int)take(r, (unsigned)P);
        const int64_t T = tokens[p];
        const unsigned where = take(r, 256);
        if (T > 0) {
            const uint16_t bits = nonfinite == 5 ? 0x7fc0 : nonfinite == 6 ? 0x7f80 : 0xff80;
            if (where & 1) w->L.x[p][(int64_t)where % (T * s.hidden)] = bits;
            else w->L.dy[p][(int64_t)where % (T * s.hidden)] = bits;
            if (where & 2) w->L.router_w[p][(int64_t)where % (T * k)] = mok_bf16_to_float(bits);
        }
    }
    if (getenv("MOK_FUZZ_VERBOSE"))
        fprintf(stderr, "%s P %d: H %lld I %lld I_s %lld E %lld k %lld T_max %lld; minibatch %d ring %d context %lld "
                "limit %g directions %d%d%d%d; tokens %lld %lld %lld; ids valid %d %d; configs agree %d\n",
                w->per_rank ? "per-rank" : "local", P, (long long)s.hidden, (long long)s.intermediate,
                (long long)s.shared_intermediate, (long long)s.num_experts, (long long)s.topk,
                (long long)s.max_tokens, c.minibatch_rows, c.ring_rows, (long long)c.context_rows,
                (double)c.swiglu_limit, c.fwd_dispatch, c.fwd_combine, c.bwd_combine, c.bwd_dispatch,
                (long long)tokens[0], (long long)tokens[1], (long long)tokens[2], w->ids_valid[0], w->ids_valid[1],
                w->configs_agree);
    return 0;
}

static void teardown(world *w) {
    for (int p = 0; p < MAX_P; ++p) {
        if (w->ws[p]) mok_workspace_destroy(w->ws[p]);
        if (w->group[p]) {
            mok_status st = mok_group_destroy(w->group[p]);
            if (st != MOK_OK) finding("mok_group_destroy after its workspaces: %s", mok_last_error());
        }
    }
    free_buffers(w);
    for (int v = 0; v < 2; ++v)
        for (int p = 0; p < MAX_P; ++p) free(w->ids[v][p]);
    /* the routing the layer owns is routing 0's original; its other arrays are its own */
    layer_free(&w->L);
}

/* ---- the program ------------------------------------------------------------------------------ */

static int decode_ops(world *w, reader *r, rank_op (*ops)[MAX_P]) {
    int n = 0;
    while (n < MAX_OPS && r->n > 0) {
        rank_op base = {(int)take(r, OP_NUM), (int)take(r, 2), 0, 0};
        const unsigned extra = take(r, 256);
        base.ctx = (int)(extra & 1);
        base.variant = (int)((extra >> 1) & 1);
        if (base.kind == OP_READ) {
            if (w->per_rank) base.kind = OP_FORWARD;
            else base.variant = (int)((extra >> 1) % (unsigned)w->P);
        }
        for (int p = 0; p < w->P; ++p) {
            ops[n][p] = base;
            /* local mode: one call, each rank's buffers may differ; per-rank: a rank may diverge */
            if ((extra >> 4) & 1) ops[n][p].sched = (int)((extra >> (5 + p)) & 1) ^ base.sched;
            if (w->per_rank && p == w->P - 1 && (extra >> 6) == 3) {
                const unsigned d = extra & 7;
                ops[n][p].kind = d == 7 ? -1 : (int)(d % 4); /* another call, or none */
            }
        }
        ++n;
    }
    return n;
}

static void run_local(world *w, rank_op (*ops)[MAX_P], int num_ops) {
    for (int i = 0; i < num_ops && w->have_workspace; ++i) {
        memcpy(w->op, ops[i], sizeof w->op);
        poison_outputs(w);
        mok_status st;
        if (w->op[0].kind == OP_RECREATE) {
            st = mok_workspace_destroy(w->ws[0]);
            w->ws[0] = NULL;
            mok_status cst = mok_workspace_create(&w->ws[0], w->group[0], &w->shape, &w->config[0]);
            if (st == MOK_OK) st = cst;
        } else {
            st = call(w, 0, 0, w->P);
        }
        for (int p = 0; p < w->P; ++p) note(w, p, st);
        judge(w, i);
    }
}

static void run_per_rank(world *w, rank_op (*ops)[MAX_P], int num_ops) {
    pthread_barrier_init(&w->step, NULL, (unsigned)w->P);
    pthread_t tid[MAX_P];
    rank_thread t[MAX_P];
    for (int p = 0; p < w->P; ++p) {
        t[p] = (rank_thread){w, p, num_ops, (const rank_op(*)[MAX_P])ops, judge};
        if (pthread_create(&tid[p], NULL, rank_main, &t[p]) != 0) finding("pthread_create failed");
    }
    for (int p = 0; p < w->P; ++p) pthread_join(tid[p], NULL);
    pthread_barrier_destroy(&w->step);
}

/* Per-rank mode: groups and workspaces are collective, so one thread per rank makes them. */
typedef struct maker {
    world *w;
    int p;
    mok_status group_status, ws_status;
} maker;

static void *make_rank(void *arg) {
    maker *m = arg;
    world *w = m->w;
    m->group_status = mok_group_create(&w->group[m->p], MOK_BACKEND_CPU, w->P, m->p, &w->id, 0, &w->config[m->p]);
    m->ws_status = m->group_status == MOK_OK
                       ? mok_workspace_create(&w->ws[m->p], w->group[m->p], &w->shape, &w->config[m->p])
                       : m->group_status;
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size};
    static world w;
    setup(&w, &r);
    rank_op ops[MAX_OPS][MAX_P];
    const int num_ops = decode_ops(&w, &r, ops);
    if (!w.per_rank) {
        if (mok_group_create_local(&w.group[0], MOK_BACKEND_CPU, w.P, NULL, &w.config[0]) != MOK_OK)
            finding("mok_group_create_local: %s", mok_last_error());
        mok_status st = mok_workspace_create(&w.ws[0], w.group[0], &w.shape, &w.config[0]);
        if (st != MOK_OK) finding("mok_workspace_create of a valid shape: %s", mok_last_error());
        mok_sizes sz;
        mok_workspace_sizes(w.ws[0], &sz);
        alloc_buffers(&w, &sz);
        w.have_workspace = 1;
        run_local(&w, ops, num_ops);
    } else {
        if (mok_unique_id_create(MOK_BACKEND_CPU, &w.id) != MOK_OK) finding("mok_unique_id_create");
        pthread_t tid[MAX_P];
        maker m[MAX_P];
        for (int p = 0; p < w.P; ++p) {
            m[p] = (maker){&w, p, MOK_OK, MOK_OK};
            if (pthread_create(&tid[p], NULL, make_rank, &m[p]) != 0) finding("pthread_create failed");
        }
        for (int p = 0; p < w.P; ++p) pthread_join(tid[p], NULL);
        int made = 1;
        for (int p = 0; p < w.P; ++p) {
            if (m[p].group_status != MOK_OK) finding("rank %d: mok_group_create: %s", p, mok_status_string(m[p].group_status));
            made &= m[p].ws_status == MOK_OK;
            if (w.configs_agree && m[p].ws_status != MOK_OK)
                finding("rank %d: mok_workspace_create with configs that agree: %s", p,
                        mok_status_string(m[p].ws_status));
            if (!w.configs_agree && m[p].ws_status == MOK_OK)
                finding("rank %d: mok_workspace_create accepted configs that differ", p);
        }
        if (made) {
            mok_sizes sz;
            mok_workspace_sizes(w.ws[0], &sz);
            alloc_buffers(&w, &sz);
            w.have_workspace = 1;
            run_per_rank(&w, ops, num_ops);
        }
    }
    teardown(&w);
    return 0;
}
