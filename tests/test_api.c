/* test_api.c — every rule of the public API broken once. Each call must return the right status
 * and leave a message (mok_last_error) that names the argument; after the failures, a good run
 * in the same test shows that the library still works (on the same workspace where the failed
 * calls used one).
 *
 * The layer is tiny (H = I = I_s = 64, E = 4, k = 2, T_max = 40, P = 2, cpu backend, local
 * mode) so that the good runs cost milliseconds. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mok.h"
#include "test.h"

/* ---- a tiny random layer ------------------------------------------------------------------ */

#define TP 2 /* ranks */

typedef struct tiny {
    mok_shape shape;
    int P;
    int64_t T[TP];
    uint16_t *x[TP], *dy[TP];
    int32_t *ids[TP];
    float *rw[TP];
    uint16_t *w[3][TP]; /* gate, up [E_local, I, H]; down [E_local, H, I] */
    uint16_t *s[3];     /* shared; NULL when I_s = 0 */
} tiny;

typedef struct tiny_out {
    void *sched[TP], *ctx[TP];
    uint16_t *y[TP], *dx[TP];
    float *drw[TP];
    uint16_t *dw[3][TP], *ds[3][TP];
} tiny_out;

static uint64_t rng_state;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_float(float scale) { return scale * (float)((double)(rnd() >> 11) / 4503599627370496.0 - 1.0); }

static void *alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded ? rounded : 64);
}

static uint16_t *random_bf16(size_t n, float scale) {
    uint16_t *v = alloc_aligned(n * 2);
    for (size_t i = 0; i < n; ++i) {
        float f = rnd_float(scale);
        v[i] = mok_bf16_from_float(f == 0.0f ? scale * 0.5f : f);
    }
    return v;
}

static mok_shape tiny_shape(int64_t shared) {
    mok_shape s = {64, 64, 4, 2, shared, 40, MOK_PRECISION_BF16};
    return s;
}

static void tiny_make(tiny *L, const mok_shape *shape, uint64_t salt) {
    memset(L, 0, sizeof *L);
    rng_state = mok_test_seed() * 0x2545f4914f6cdd1dull + salt;
    L->shape = *shape;
    L->P = TP;
    const int64_t H = shape->hidden, I = shape->intermediate, Is = shape->shared_intermediate, k = shape->topk;
    const int64_t El = shape->num_experts / TP;
    L->T[0] = shape->max_tokens;
    L->T[1] = shape->max_tokens - 7;
    for (int p = 0; p < TP; ++p) {
        L->x[p] = random_bf16((size_t)(L->T[p] * H), 1.0f);
        L->dy[p] = random_bf16((size_t)(L->T[p] * H), 1.0f);
        L->ids[p] = alloc_aligned(sizeof(int32_t) * (size_t)(L->T[p] * k));
        L->rw[p] = alloc_aligned(sizeof(float) * (size_t)(L->T[p] * k));
        for (int64_t t = 0; t < L->T[p]; ++t)
            for (int64_t j = 0; j < k; ++j) {
                int32_t e;
                int again;
                do {
                    e = (int32_t)(rnd() % (uint64_t)shape->num_experts);
                    again = 0;
                    for (int64_t q = 0; q < j; ++q) again |= L->ids[p][t * k + q] == e;
                } while (again);
                if (t % 5 == 3 && j == k - 1) e = -1; /* a few empty slots */
                L->ids[p][t * k + j] = e;
                L->rw[p][t * k + j] = rnd_float(1.0f);
            }
        L->w[0][p] = random_bf16((size_t)(El * I * H), 1.0f / 8);
        L->w[1][p] = random_bf16((size_t)(El * I * H), 1.0f / 8);
        L->w[2][p] = random_bf16((size_t)(El * H * I), 1.0f / 8);
    }
    if (Is) {
        L->s[0] = random_bf16((size_t)(Is * H), 1.0f / 8);
        L->s[1] = random_bf16((size_t)(Is * H), 1.0f / 8);
        L->s[2] = random_bf16((size_t)(H * Is), 1.0f / 8);
    }
}

static void tiny_free(tiny *L) {
    for (int p = 0; p < TP; ++p) {
        free(L->x[p]);
        free(L->dy[p]);
        free(L->ids[p]);
        free(L->rw[p]);
        for (int m = 0; m < 3; ++m) free(L->w[m][p]);
    }
    for (int m = 0; m < 3; ++m) free(L->s[m]);
    memset(L, 0, sizeof *L);
}

/* Output buffers, poisoned (bf16 NaN 0x7fc1, fp32 NaN), sized from the workspace. */
static void out_alloc(tiny_out *o, const tiny *L, mok_workspace *ws) {
    memset(o, 0, sizeof *o);
    mok_sizes sz;
    CHECK(mok_workspace_sizes(ws, &sz) == MOK_OK, "workspace sizes: %s", mok_last_error());
    const int64_t H = L->shape.hidden, I = L->shape.intermediate, Is = L->shape.shared_intermediate;
    const int64_t El = L->shape.num_experts / TP, k = L->shape.topk;
    for (int p = 0; p < TP; ++p) {
        o->sched[p] = alloc_aligned(sz.schedule_bytes);
        o->ctx[p] = alloc_aligned(sz.context_bytes);
        memset(o->sched[p], 0, sz.schedule_bytes);
        memset(o->ctx[p], 0x5a, sz.context_bytes);
        size_t n_y = (size_t)(L->T[p] * H), n_w = (size_t)(El * I * H), n_s = (size_t)(Is * H);
        o->y[p] = alloc_aligned(n_y * 2);
        o->dx[p] = alloc_aligned(n_y * 2);
        o->drw[p] = alloc_aligned((size_t)(L->T[p] * k) * 4);
        for (size_t i = 0; i < n_y; ++i) o->y[p][i] = o->dx[p][i] = 0x7fc1;
        for (int64_t i = 0; i < L->T[p] * k; ++i) o->drw[p][i] = NAN;
        for (int m = 0; m < 3; ++m) {
            o->dw[m][p] = alloc_aligned(n_w * 2);
            for (size_t i = 0; i < n_w; ++i) o->dw[m][p][i] = 0x7fc1;
            if (Is) {
                o->ds[m][p] = alloc_aligned(n_s * 2);
                for (size_t i = 0; i < n_s; ++i) o->ds[m][p][i] = 0x7fc1;
            }
        }
    }
}

static void out_free(tiny_out *o) {
    for (int p = 0; p < TP; ++p) {
        free(o->sched[p]);
        free(o->ctx[p]);
        free(o->y[p]);
        free(o->dx[p]);
        free(o->drw[p]);
        for (int m = 0; m < 3; ++m) free(o->dw[m][p]), free(o->ds[m][p]);
    }
    memset(o, 0, sizeof *o);
}

static void sched_args(mok_schedule_args a[TP], const tiny *L, tiny_out *o) {
    for (int p = 0; p < TP; ++p) a[p] = (mok_schedule_args){L->T[p], L->ids[p], o->sched[p], NULL};
}

static void fwd_args(mok_forward_args a[TP], const tiny *L, tiny_out *o) {
    for (int p = 0; p < TP; ++p)
        a[p] = (mok_forward_args){L->T[p], o->sched[p], L->x[p], L->rw[p], L->w[0][p], L->w[1][p], L->w[2][p],
                                  L->s[0], L->s[1], L->s[2], o->y[p], o->ctx[p], NULL, NULL};
}

static void bwd_args(mok_backward_args a[TP], const tiny *L, tiny_out *o) {
    for (int p = 0; p < TP; ++p) {
        memset(&a[p], 0, sizeof a[p]);
        a[p].num_tokens = L->T[p];
        a[p].schedule = o->sched[p];
        a[p].context = o->ctx[p];
        a[p].dy = L->dy[p];
        a[p].x = L->x[p];
        a[p].router_w = L->rw[p];
        a[p].w_gate = L->w[0][p];
        a[p].w_up = L->w[1][p];
        a[p].w_down = L->w[2][p];
        a[p].s_gate = L->s[0];
        a[p].s_up = L->s[1];
        a[p].s_down = L->s[2];
        a[p].dx = o->dx[p];
        a[p].d_router_w = o->drw[p];
        a[p].accumulate = 0;
        a[p].dw_gate = o->dw[0][p];
        a[p].dw_up = o->dw[1][p];
        a[p].dw_down = o->dw[2][p];
        a[p].ds_gate = o->ds[0][p];
        a[p].ds_up = o->ds[1][p];
        a[p].ds_down = o->ds[2][p];
    }
}

static mok_config tiny_config(void) {
    mok_config c = MOK_CONFIG_INIT;
    c.minibatch_rows = 128;
    c.ring_rows = 256;
    c.cpu_threads = 2;
    c.cpu_comm_threads = 1;
    c.peer_timeout_ms = 5000;
    return c;
}

/* ---- checking a failure ------------------------------------------------------------------- */

static int expect_error(mok_status got, mok_status want, const char *needle, const char *call, const char *file,
                        int line) {
    const char *msg = mok_last_error();
    int ok = 1;
    if (got != want) {
        mok_test_fail(file, line, "%s: status %d (%s), want %d (%s); message '%s'", call, (int)got,
                      mok_status_string(got), (int)want, mok_status_string(want), msg ? msg : "(null)");
        ok = 0;
    }
    if (!msg || !strstr(msg, needle)) {
        mok_test_fail(file, line, "%s: message '%s' does not name '%s'", call, msg ? msg : "(null)", needle);
        ok = 0;
    }
    return ok;
}

/* EXPECT_ERR(call, status, "text the message must contain") */
#define EXPECT_ERR(call, want, needle) expect_error((call), (want), (needle), #call, __FILE__, __LINE__)
#define EXPECT_OK(call)                                                                                   \
    do {                                                                                                  \
        mok_status st_ = (call);                                                                          \
        CHECK(st_ == MOK_OK, "%s: status %d (%s): %s", #call, (int)st_, mok_status_string(st_), mok_last_error()); \
    } while (0)

/* ---- the good run -------------------------------------------------------------------------- */

/* Schedule, forward (checked against the reference), recompute (bitwise the forward's
 * context), backward (every output written, finite) on ws, with fresh outputs. */
static void good_run_on(mok_workspace *ws, const tiny *L, const char *what) {
    tiny_out o;
    out_alloc(&o, L, ws);
    mok_schedule_args sa[TP];
    mok_forward_args fa[TP];
    mok_backward_args ba[TP];
    sched_args(sa, L, &o);
    mok_status st = mok_schedule_build(ws, sa);
    CHECK(st == MOK_OK, "%s: good schedule build: %s", what, mok_last_error());
    fwd_args(fa, L, &o);
    st = mok_forward(ws, fa);
    CHECK(st == MOK_OK, "%s: good forward: %s", what, mok_last_error());

    /* the reference's y; bf16 results of two fp32/fp64 orders differ by a few ulps at most */
    uint16_t *ref_y[TP];
    const void *w0[TP], *w1[TP], *w2[TP], *xs[TP];
    const int32_t *ids[TP];
    const float *rws[TP];
    for (int p = 0; p < TP; ++p) {
        ref_y[p] = alloc_aligned((size_t)(L->T[p] * L->shape.hidden) * 2);
        w0[p] = L->w[0][p], w1[p] = L->w[1][p], w2[p] = L->w[2][p];
        xs[p] = L->x[p], ids[p] = L->ids[p], rws[p] = L->rw[p];
    }
    mok_ref_layer rl = {&L->shape, TP, 0.0f, L->T, xs, ids, rws, w0, w1, w2, L->s[0], L->s[1], L->s[2]};
    CHECK(mok_ref_forward(&rl, (void *const *)ref_y) == MOK_OK, "%s: reference: %s", what, mok_last_error());
    int bad = 0;
    for (int p = 0; p < TP; ++p)
        for (int64_t i = 0; i < L->T[p] * L->shape.hidden; ++i) {
            float a = mok_bf16_to_float(o.y[p][i]), b = mok_bf16_to_float(ref_y[p][i]);
            if (!(fabsf(a - b) <= 0.02f * fabsf(b) + 2e-3f) && bad++ < 3)
                CHECK(0, "%s: y[%d][%lld] = %g, reference %g", what, p, (long long)i, a, b);
        }
    for (int p = 0; p < TP; ++p) free(ref_y[p]);

    /* recompute: the same context, bit for bit */
    mok_sizes sz;
    mok_workspace_sizes(ws, &sz);
    void *ctx2[TP];
    mok_forward_args ra[TP];
    fwd_args(ra, L, &o);
    for (int p = 0; p < TP; ++p) {
        ctx2[p] = alloc_aligned(sz.context_bytes);
        memset(ctx2[p], 0x5a, sz.context_bytes);
        ra[p].context = ctx2[p];
        ra[p].y = NULL;      /* not written by recompute */
        ra[p].w_down = NULL; /* not read */
        ra[p].s_down = NULL;
    }
    st = mok_recompute_context(ws, ra);
    CHECK(st == MOK_OK, "%s: recompute: %s", what, mok_last_error());
    for (int p = 0; p < TP; ++p) {
        CHECK(memcmp(ctx2[p], o.ctx[p], sz.context_bytes) == 0, "%s: rank %d: recomputed context differs", what, p);
        free(ctx2[p]);
    }

    bwd_args(ba, L, &o);
    st = mok_backward(ws, ba);
    CHECK(st == MOK_OK, "%s: good backward: %s", what, mok_last_error());
    const int64_t H = L->shape.hidden, El = L->shape.num_experts / TP, I = L->shape.intermediate;
    const int64_t Is = L->shape.shared_intermediate;
    int unwritten = 0;
    for (int p = 0; p < TP; ++p) {
        for (int64_t i = 0; i < L->T[p] * H; ++i) unwritten += isnan(mok_bf16_to_float(o.dx[p][i]));
        for (int64_t i = 0; i < L->T[p] * L->shape.topk; ++i) unwritten += isnan(o.drw[p][i]);
        for (int m = 0; m < 3; ++m) {
            for (int64_t i = 0; i < El * I * H; ++i) unwritten += isnan(mok_bf16_to_float(o.dw[m][p][i]));
            for (int64_t i = 0; i < Is * H; ++i) unwritten += isnan(mok_bf16_to_float(o.ds[m][p][i]));
        }
    }
    CHECK(unwritten == 0, "%s: %d backward outputs unwritten or NaN", what, unwritten);
    out_free(&o);
}

/* A fresh group and workspace, one good run, everything destroyed. */
static void good_run(const char *what) {
    mok_config cfg = tiny_config();
    mok_shape shape = tiny_shape(64);
    tiny L;
    tiny_make(&L, &shape, 99);
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    mok_status st = mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg);
    CHECK(st == MOK_OK, "%s: group: %s", what, mok_last_error());
    if (st == MOK_OK) st = mok_workspace_create(&ws, g, &shape, NULL);
    CHECK(st == MOK_OK, "%s: workspace: %s", what, mok_last_error());
    if (st == MOK_OK) good_run_on(ws, &L, what);
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
    tiny_free(&L);
}

/* ---- tests ---------------------------------------------------------------------------------- */

MOK_TEST(api_version_status_strings) {
    CHECK(mok_version() == MOK_VERSION, "mok_version %d, header %d", mok_version(), MOK_VERSION);
    CHECK(mok_config_struct_size() == sizeof(mok_config), "config size %zu, header %zu", mok_config_struct_size(),
          sizeof(mok_config));
    mok_config init = MOK_CONFIG_INIT, def = mok_config_default();
    /* field by field: the struct has padding */
    CHECK(init.size == def.size && init.fwd_comm_sms == def.fwd_comm_sms && init.bwd_comm_sms == def.bwd_comm_sms &&
              init.minibatch_rows == def.minibatch_rows && init.ring_rows == def.ring_rows &&
              init.context_rows == def.context_rows && init.swiglu_limit == def.swiglu_limit &&
              init.peer_timeout_ms == def.peer_timeout_ms && init.cpu_threads == def.cpu_threads &&
              init.cpu_comm_threads == def.cpu_comm_threads && init.fwd_dispatch == def.fwd_dispatch &&
              init.fwd_combine == def.fwd_combine && init.bwd_combine == def.bwd_combine &&
              init.bwd_dispatch == def.bwd_dispatch && init.trace == def.trace,
          "mok_config_default differs from MOK_CONFIG_INIT");
    CHECK(mok_config_validate(&init) == MOK_OK, "MOK_CONFIG_INIT is not valid: %s", mok_last_error());

    static const mok_status all[] = {
#define X_STATUS(name, value, text) name,
        MOK_STATUS_TABLE(X_STATUS)
#undef X_STATUS
    };
    const int n = (int)(sizeof all / sizeof all[0]);
    CHECK(n == 9, "%d statuses", n);
    for (int i = 0; i < n; ++i) {
        const char *s = mok_status_string(all[i]);
        CHECK(s && s[0], "status %d has an empty string", (int)all[i]);
        for (int j = 0; j < i; ++j)
            CHECK(s && strcmp(s, mok_status_string(all[j])) != 0, "statuses %d and %d share the string '%s'",
                  (int)all[i], (int)all[j], s);
    }
    const char *unknown = mok_status_string((mok_status)1234);
    CHECK(unknown && unknown[0], "an unknown status has no string");
    CHECK(mok_backend_available(MOK_BACKEND_CPU) == 1, "cpu backend not available");
    CHECK(strcmp(mok_backend_name(MOK_BACKEND_CPU), "cpu") == 0 && strcmp(mok_backend_name(MOK_BACKEND_CUDA), "cuda") == 0,
          "backend names");
    /* bf16 helpers: round to nearest even, NaN stays NaN */
    CHECK(mok_bf16_from_float(1.0f) == 0x3f80 && mok_bf16_to_float(0x3f80) == 1.0f, "bf16 of 1");
    CHECK(mok_bf16_from_float(1.00390625f) == 0x3f80, "bf16 ties to even (down)");
    CHECK(mok_bf16_from_float(1.01171875f) == 0x3f82, "bf16 ties to even (up)");
    CHECK(isnan(mok_bf16_to_float(mok_bf16_from_float(NAN))), "bf16 NaN");
    good_run("after version checks");
}

MOK_TEST(api_shape_rules) {
    mok_config cfg = tiny_config();
    mok_group *g = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
    struct {
        const char *what;
        mok_shape shape;
        mok_status want;
        const char *needle;
    } cases[] = {
        {"H not a multiple of 64", {100, 64, 4, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.hidden"},
        {"H = 96", {96, 64, 4, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.hidden"},
        {"H = 0", {0, 64, 4, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.hidden"},
        {"I not a multiple of 64", {64, 32, 4, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.intermediate"},
        {"I = 200", {64, 200, 4, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.intermediate"},
        {"I_s not a multiple", {64, 64, 4, 2, 96, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.shared_intermediate"},
        {"I_s negative", {64, 64, 4, 2, -64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.shared_intermediate"},
        {"k > E", {64, 64, 4, 5, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.topk"},
        {"k < 1", {64, 64, 4, 0, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.topk"},
        {"E not divisible by P", {64, 64, 5, 2, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.num_experts"},
        {"E = 0", {64, 64, 0, 1, 64, 40, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.num_experts"},
        {"max_tokens < 1", {64, 64, 4, 2, 64, 0, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.max_tokens"},
        {"max_tokens negative", {64, 64, 4, 2, 64, -3, 0}, MOK_ERR_INVALID_ARGUMENT, "shape.max_tokens"},
        {"fp8, H = 64", {64, 128, 4, 2, 128, 40, MOK_PRECISION_FP8}, MOK_ERR_INVALID_ARGUMENT, "shape.hidden"},
        {"fp8, I = 192", {128, 192, 4, 2, 128, 40, MOK_PRECISION_FP8}, MOK_ERR_INVALID_ARGUMENT, "shape.intermediate"},
        {"fp8, I_s = 64", {128, 128, 4, 2, 64, 40, MOK_PRECISION_FP8}, MOK_ERR_INVALID_ARGUMENT,
         "shape.shared_intermediate"},
        {"precision 7", {64, 64, 4, 2, 64, 40, 7}, MOK_ERR_INVALID_ARGUMENT, "shape.precision"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        mok_workspace *ws = (mok_workspace *)&cases[i]; /* must be reset to NULL on failure */
        if (!expect_error(mok_workspace_create(&ws, g, &cases[i].shape, NULL), cases[i].want, cases[i].needle,
                          cases[i].what, __FILE__, __LINE__))
            continue;
        CHECK(ws == NULL, "%s: the output handle is not NULL after a failure", cases[i].what);
        expect_error(mok_shape_validate(&cases[i].shape, TP), cases[i].want, cases[i].needle, cases[i].what, __FILE__,
                     __LINE__);
    }
    mok_workspace *ws = NULL;
    EXPECT_ERR(mok_workspace_create(&ws, g, NULL, NULL), MOK_ERR_INVALID_ARGUMENT, "shape");
    mok_shape good = tiny_shape(64);
    EXPECT_ERR(mok_shape_validate(&good, 0), MOK_ERR_INVALID_ARGUMENT, "nranks");
    EXPECT_OK(mok_shape_validate(&good, TP));
    /* I_s = 0 is fine */
    mok_shape no_shared = tiny_shape(0);
    EXPECT_OK(mok_shape_validate(&no_shared, TP));
    /* the group still works after every rejected workspace */
    EXPECT_OK(mok_workspace_create(&ws, g, &good, NULL));
    if (ws) {
        tiny L;
        tiny_make(&L, &good, 1);
        good_run_on(ws, &L, "after the shape rules");
        tiny_free(&L);
    }
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}

MOK_TEST(api_config_rules) {
    mok_shape shape = tiny_shape(64);
    mok_group *g = NULL;
    mok_config base = tiny_config();
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &base));
    struct {
        const char *what;
        mok_config c;
        const char *needle;
    } cases[32];
    int n = 0;
#define CONFIG_CASE(label, field_changes, text)                                    \
    do {                                                                           \
        mok_config c_ = tiny_config();                                             \
        field_changes;                                                             \
        cases[n].what = label;                                                     \
        cases[n].c = c_;                                                           \
        cases[n].needle = text;                                                    \
        ++n;                                                                       \
    } while (0)
    CONFIG_CASE("size wrong", c_.size = sizeof(mok_config) - 8, "config.size");
    CONFIG_CASE("size zero", c_.size = 0, "config.size");
    CONFIG_CASE("minibatch not a multiple of 128", c_.minibatch_rows = 100, "config.minibatch_rows");
    CONFIG_CASE("minibatch 64", (c_.minibatch_rows = 64, c_.ring_rows = 128), "config.minibatch_rows");
    CONFIG_CASE("minibatch 0", c_.minibatch_rows = 0, "config.minibatch_rows");
    CONFIG_CASE("ring < minibatch", (c_.minibatch_rows = 256, c_.ring_rows = 128), "config.ring_rows");
    CONFIG_CASE("ring not a multiple", (c_.minibatch_rows = 256, c_.ring_rows = 640), "config.ring_rows");
    CONFIG_CASE("swiglu_limit negative", c_.swiglu_limit = -1.0f, "config.swiglu_limit");
    CONFIG_CASE("swiglu_limit NaN", c_.swiglu_limit = NAN, "config.swiglu_limit");
    CONFIG_CASE("swiglu_limit inf", c_.swiglu_limit = INFINITY, "config.swiglu_limit");
    CONFIG_CASE("peer_timeout_ms 0", c_.peer_timeout_ms = 0.0, "config.peer_timeout_ms");
    CONFIG_CASE("peer_timeout_ms negative", c_.peer_timeout_ms = -5.0, "config.peer_timeout_ms");
    CONFIG_CASE("peer_timeout_ms NaN", c_.peer_timeout_ms = NAN, "config.peer_timeout_ms");
    CONFIG_CASE("cpu_threads 1", c_.cpu_threads = 1, "config.cpu_threads");
    CONFIG_CASE("cpu_threads negative", c_.cpu_threads = -2, "config.cpu_threads");
    CONFIG_CASE("cpu_comm_threads = cpu_threads", (c_.cpu_threads = 4, c_.cpu_comm_threads = 4),
                "config.cpu_comm_threads");
    CONFIG_CASE("cpu_comm_threads > cpu_threads", (c_.cpu_threads = 2, c_.cpu_comm_threads = 3),
                "config.cpu_comm_threads");
    CONFIG_CASE("cpu_comm_threads 0", c_.cpu_comm_threads = 0, "config.cpu_comm_threads");
    CONFIG_CASE("fwd_dispatch 2", c_.fwd_dispatch = 2, "fwd_dispatch");
    CONFIG_CASE("fwd_combine -1", c_.fwd_combine = -1, "fwd_combine");
    CONFIG_CASE("bwd_combine 5", c_.bwd_combine = 5, "bwd_combine");
    CONFIG_CASE("bwd_dispatch 9", c_.bwd_dispatch = 9, "bwd_dispatch");
    CONFIG_CASE("context_rows negative", c_.context_rows = -1, "config.context_rows");
    CONFIG_CASE("trace 2", c_.trace = 2, "config.trace");
    CONFIG_CASE("fwd_comm_sms -1", c_.fwd_comm_sms = -1, "config.fwd_comm_sms");
    CONFIG_CASE("bwd_comm_sms 1025", c_.bwd_comm_sms = 1025, "config.bwd_comm_sms");
    /* With cpu_threads = 0 the comm threads come on top of one thread per core: bounded too. */
    CONFIG_CASE("cpu_comm_threads 1030 of auto threads", (c_.cpu_threads = 0, c_.cpu_comm_threads = 1030),
                "config.cpu_comm_threads");
    CONFIG_CASE("cpu_comm_threads INT_MAX of auto threads", (c_.cpu_threads = 0, c_.cpu_comm_threads = 2147483647),
                "config.cpu_comm_threads");
    /* Deadlines are int64 nanoseconds: a timeout past 1e9 ms would overflow them. */
    CONFIG_CASE("peer_timeout_ms 1e13", c_.peer_timeout_ms = 1e13, "config.peer_timeout_ms");
    CONFIG_CASE("peer_timeout_ms 9.3e12", c_.peer_timeout_ms = 9.3e12, "config.peer_timeout_ms");
    CONFIG_CASE("peer_timeout_ms inf", c_.peer_timeout_ms = INFINITY, "config.peer_timeout_ms");
#undef CONFIG_CASE
    for (int i = 0; i < n; ++i) {
        char label[160];
        snprintf(label, sizeof label, "mok_config_validate (%s)", cases[i].what);
        expect_error(mok_config_validate(&cases[i].c), MOK_ERR_INVALID_ARGUMENT, cases[i].needle, label, __FILE__,
                     __LINE__);
        mok_group *bad_group = (mok_group *)&cases[i];
        snprintf(label, sizeof label, "mok_group_create_local (%s)", cases[i].what);
        expect_error(mok_group_create_local(&bad_group, MOK_BACKEND_CPU, TP, NULL, &cases[i].c),
                     MOK_ERR_INVALID_ARGUMENT, cases[i].needle, label, __FILE__, __LINE__);
        CHECK(bad_group == NULL, "%s: output handle not NULL", label);
        if (bad_group && bad_group != (mok_group *)&cases[i]) mok_group_destroy(bad_group);
        mok_workspace *ws = (mok_workspace *)&cases[i];
        snprintf(label, sizeof label, "mok_workspace_create (%s)", cases[i].what);
        expect_error(mok_workspace_create(&ws, g, &shape, &cases[i].c), MOK_ERR_INVALID_ARGUMENT, cases[i].needle,
                     label, __FILE__, __LINE__);
        CHECK(ws == NULL, "%s: output handle not NULL", label);
    }
    EXPECT_ERR(mok_config_validate(NULL), MOK_ERR_INVALID_ARGUMENT, "config");

    /* Every transfer direction runs (core/tasks.h): each flipped alone and all four, through the
       workspace's own config and through the group's (config = NULL); on cuda,
       cuda_turned_transfers. */
    static const char *fields[4] = {"fwd_dispatch", "fwd_combine", "bwd_combine", "bwd_dispatch"};
    for (int f = 0; f <= 4; ++f) {
        mok_config c = tiny_config();
        for (int i = 0; i < 4; ++i) {
            if (f < 4 && i != f) continue;
            int *field = i == 0 ? &c.fwd_dispatch : i == 1 ? &c.fwd_combine : i == 2 ? &c.bwd_combine : &c.bwd_dispatch;
            *field = *field == MOK_PULL ? MOK_PUSH : MOK_PULL;
        }
        CHECK(mok_config_validate(&c) == MOK_OK, "%s flipped is a valid config: %s", f < 4 ? fields[f] : "all",
              mok_last_error());
        mok_workspace *ws = NULL;
        EXPECT_OK(mok_workspace_create(&ws, g, &shape, &c));
        if (ws) mok_workspace_destroy(ws);
        mok_group *g2 = NULL;
        EXPECT_OK(mok_group_create_local(&g2, MOK_BACKEND_CPU, TP, NULL, &c));
        if (g2) {
            ws = NULL;
            EXPECT_OK(mok_workspace_create(&ws, g2, &shape, NULL));
            if (ws) mok_workspace_destroy(ws);
            mok_group_destroy(g2);
        }
    }

    /* the group still works, with its own config and with an override */
    mok_workspace *ws = NULL;
    mok_config other = tiny_config();
    other.minibatch_rows = 256;
    other.ring_rows = 256;
    other.context_rows = 128;
    EXPECT_OK(mok_workspace_create(&ws, g, &shape, &other));
    if (ws) {
        tiny L;
        tiny_make(&L, &shape, 2);
        good_run_on(ws, &L, "after the config rules");
        tiny_free(&L);
    }
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}

MOK_TEST(api_config_bounds_run) {
    /* The largest values the rules allow work: one thread per core plus 1024 comm threads (more
       workers than a fixed table of 1024 held), and the longest peer timeout. */
    mok_shape shape = tiny_shape(64);
    tiny L;
    tiny_make(&L, &shape, 17);
    mok_config cfg = tiny_config();
    cfg.cpu_threads = 0;
    cfg.cpu_comm_threads = 1024;
    cfg.peer_timeout_ms = 1e9;
    EXPECT_OK(mok_config_validate(&cfg));
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
    if (g) EXPECT_OK(mok_workspace_create(&ws, g, &shape, NULL));
    if (ws) good_run_on(ws, &L, "1024 comm threads on top of the cores, peer_timeout_ms 1e9");
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
    tiny_free(&L);
}

MOK_TEST(api_sizes_beyond_memory) {
    /* Sizes no allocation can hold are refused, never wrapped around to a small block. */
    mok_config cfg = tiny_config();
    mok_group *g = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, 1, NULL, &cfg));
    if (!g) return;
    void *p = (void *)&cfg;
    EXPECT_ERR(mok_memory_alloc(g, 0, SIZE_MAX, &p), MOK_ERR_INVALID_ARGUMENT, "bytes");
    CHECK(p == NULL, "mok_memory_alloc(SIZE_MAX) left a pointer");
    EXPECT_ERR(mok_memory_alloc(g, 0, SIZE_MAX - 15, &p), MOK_ERR_INVALID_ARGUMENT, "bytes");
    EXPECT_ERR(mok_memory_alloc(g, 0, (size_t)PTRDIFF_MAX + 1, &p), MOK_ERR_INVALID_ARGUMENT, "bytes");
    EXPECT_OK(mok_memory_alloc(g, 0, 100, &p));
    if (p) {
        memset(p, 1, 100);
        EXPECT_OK(mok_memory_free(g, 0, p));
    }
    /* A shape within every rule whose workspace sizes would pass 2^64 bytes (the weight-gradient
       carry: about 2^22 macrobatches of 3 * 2^40 fp32): refused at once, naming the sizes. */
    mok_shape huge = {1 << 20, 1 << 20, 32, 32, 0, 1 << 24, MOK_PRECISION_BF16};
    EXPECT_OK(mok_shape_validate(&huge, 1));
    mok_config ring = tiny_config();
    ring.minibatch_rows = 128;
    ring.ring_rows = 128;
    mok_workspace *ws = NULL;
    EXPECT_ERR(mok_workspace_create(&ws, g, &huge, &ring), MOK_ERR_INVALID_ARGUMENT, "bytes");
    CHECK(ws == NULL, "huge workspace handle");
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}

MOK_TEST(api_group_rules) {
    mok_config cfg = tiny_config();
    mok_unique_id id;
    EXPECT_OK(mok_unique_id_create(MOK_BACKEND_CPU, &id));
    mok_group *g = (mok_group *)&id;
    EXPECT_ERR(mok_group_create_local(&g, MOK_BACKEND_CPU, 0, NULL, &cfg), MOK_ERR_INVALID_ARGUMENT, "nranks");
    CHECK(g == NULL, "output handle not NULL after a failure");
    EXPECT_ERR(mok_group_create_local(&g, MOK_BACKEND_CPU, -1, NULL, &cfg), MOK_ERR_INVALID_ARGUMENT, "nranks");
    EXPECT_ERR(mok_group_create_local(&g, MOK_BACKEND_CPU, MOK_MAX_RANKS + 1, NULL, &cfg), MOK_ERR_INVALID_ARGUMENT,
               "nranks");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, 0, 0, &id, 0, &cfg), MOK_ERR_INVALID_ARGUMENT, "nranks");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, MOK_MAX_RANKS + 1, 0, &id, 0, &cfg), MOK_ERR_INVALID_ARGUMENT,
               "nranks");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, 2, 2, &id, 0, &cfg), MOK_ERR_INVALID_ARGUMENT, "rank");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, 2, -1, &id, 0, &cfg), MOK_ERR_INVALID_ARGUMENT, "rank");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, 2, 0, NULL, 0, &cfg), MOK_ERR_INVALID_ARGUMENT, "id");
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CPU, 2, 0, &id, -1, &cfg), MOK_ERR_INVALID_ARGUMENT, "device");
    EXPECT_ERR(mok_group_create(NULL, MOK_BACKEND_CPU, 1, 0, &id, 0, &cfg), MOK_ERR_INVALID_ARGUMENT, "group");
    EXPECT_ERR(mok_group_create_local(NULL, MOK_BACKEND_CPU, TP, NULL, &cfg), MOK_ERR_INVALID_ARGUMENT, "group");
    EXPECT_ERR(mok_group_create_local(&g, (mok_backend)7, TP, NULL, &cfg), MOK_ERR_INVALID_ARGUMENT, "backend");
    EXPECT_ERR(mok_unique_id_create(MOK_BACKEND_CPU, NULL), MOK_ERR_INVALID_ARGUMENT, "id");
    EXPECT_ERR(mok_unique_id_create((mok_backend)7, &id), MOK_ERR_INVALID_ARGUMENT, "backend");
    EXPECT_ERR(mok_group_info(NULL, NULL, NULL, NULL, NULL), MOK_ERR_INVALID_ARGUMENT, "group");
    CHECK(mok_group_destroy(NULL) == MOK_OK, "destroying NULL");
    CHECK(mok_workspace_destroy(NULL) == MOK_OK, "destroying NULL");

    /* workspace outputs and handles */
    mok_shape shape = tiny_shape(64);
    mok_workspace *ws = NULL;
    EXPECT_ERR(mok_workspace_create(&ws, NULL, &shape, NULL), MOK_ERR_INVALID_ARGUMENT, "group");
    g = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
    EXPECT_ERR(mok_workspace_create(NULL, g, &shape, NULL), MOK_ERR_INVALID_ARGUMENT, "workspace");
    EXPECT_ERR(mok_workspace_sizes(NULL, NULL), MOK_ERR_INVALID_ARGUMENT, "workspace");
    int nranks = 0, nlocal = 0, first = -1;
    mok_backend backend = MOK_BACKEND_AUTO;
    EXPECT_OK(mok_group_info(g, &nranks, &nlocal, &first, &backend));
    CHECK(nranks == TP && nlocal == TP && first == 0 && backend == MOK_BACKEND_CPU, "group info %d %d %d %d", nranks,
          nlocal, first, (int)backend);
    EXPECT_OK(mok_workspace_create(&ws, g, &shape, NULL));
    if (ws) {
        EXPECT_ERR(mok_workspace_sizes(ws, NULL), MOK_ERR_INVALID_ARGUMENT, "sizes");
        tiny L;
        tiny_make(&L, &shape, 3);
        good_run_on(ws, &L, "after the group rules");
        tiny_free(&L);
    }
    mok_workspace_destroy(ws);
    mok_group_destroy(g);

    /* one rank, one-process-per-rank form: needs nobody else */
    g = NULL;
    EXPECT_OK(mok_group_create(&g, MOK_BACKEND_CPU, 1, 0, &id, 0, &cfg));
    EXPECT_OK(mok_group_info(g, &nranks, &nlocal, &first, &backend));
    CHECK(nranks == 1 && nlocal == 1 && first == 0, "single-rank group info %d %d %d", nranks, nlocal, first);
    mok_group_destroy(g);
}

MOK_TEST(api_cuda_unavailable) {
    if (mok_backend_available(MOK_BACKEND_CUDA)) {
        mok_test_skip("this machine has the cuda backend: the unavailable-backend checks do not apply");
        good_run("cuda available: only the good run");
        return;
    }
    mok_config cfg = tiny_config();
    mok_group *g = NULL;
    int devices[TP] = {0, 1};
    EXPECT_ERR(mok_group_create_local(&g, MOK_BACKEND_CUDA, TP, devices, &cfg), MOK_ERR_UNSUPPORTED, "cuda");
    CHECK(g == NULL, "output handle not NULL");
    mok_unique_id id;
    EXPECT_ERR(mok_unique_id_create(MOK_BACKEND_CUDA, &id), MOK_ERR_UNSUPPORTED, "cuda");
    EXPECT_OK(mok_unique_id_create(MOK_BACKEND_CPU, &id));
    EXPECT_ERR(mok_group_create(&g, MOK_BACKEND_CUDA, 1, 0, &id, 0, &cfg), MOK_ERR_UNSUPPORTED, "cuda");
    /* auto falls back to the cpu */
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_AUTO, TP, NULL, &cfg));
    mok_backend backend = MOK_BACKEND_AUTO;
    if (g) {
        mok_group_info(g, NULL, NULL, NULL, &backend);
        CHECK(backend == MOK_BACKEND_CPU, "auto resolved to %d", (int)backend);
        mok_group_destroy(g);
    }
    good_run("after cuda requests");
}

MOK_TEST(api_schedule_rules) {
    mok_config cfg = tiny_config();
    mok_shape shape = tiny_shape(64);
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
    EXPECT_OK(mok_workspace_create(&ws, g, &shape, NULL));
    if (!ws) {
        mok_group_destroy(g);
        return;
    }
    tiny L;
    tiny_make(&L, &shape, 4);
    tiny_out o;
    out_alloc(&o, &L, ws);
    mok_schedule_args a[TP];

    sched_args(a, &L, &o);
    a[1].num_tokens = shape.max_tokens + 1;
    EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[1].num_tokens");
    sched_args(a, &L, &o);
    a[0].num_tokens = -1;
    EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[0].num_tokens");
    sched_args(a, &L, &o);
    a[0].topk_ids = NULL;
    EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[0].topk_ids");
    sched_args(a, &L, &o);
    a[1].topk_ids = (const int32_t *)((const char *)L.ids[1] + 2);
    if (EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[1].topk_ids"))
        CHECK(strstr(mok_last_error(), "align") != NULL, "misaligned: message '%s'", mok_last_error());
    sched_args(a, &L, &o);
    a[0].schedule = NULL;
    EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[0].schedule");
    sched_args(a, &L, &o);
    a[1].schedule = (char *)o.sched[1] + 2;
    if (EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "args[1].schedule"))
        CHECK(strstr(mok_last_error(), "align") != NULL, "misaligned: message '%s'", mok_last_error());
    EXPECT_ERR(mok_schedule_build(ws, NULL), MOK_ERR_INVALID_ARGUMENT, "args");
    EXPECT_ERR(mok_schedule_build(NULL, a), MOK_ERR_INVALID_ARGUMENT, "workspace");

    /* expert ids out of range: the message names the rank, the token and the slot */
    const int64_t k = shape.topk;
    int32_t saved = L.ids[1][5 * k + 1];
    L.ids[1][5 * k + 1] = (int32_t)shape.num_experts;
    sched_args(a, &L, &o);
    if (EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "rank 1")) {
        CHECK(strstr(mok_last_error(), "token 5") && strstr(mok_last_error(), "slot 1"),
              "id >= E: message '%s' does not name token 5, slot 1", mok_last_error());
        CHECK(strstr(mok_last_error(), "topk_ids"), "message '%s' does not name topk_ids", mok_last_error());
    }
    L.ids[1][5 * k + 1] = saved;
    saved = L.ids[0][17 * k + 0];
    L.ids[0][17 * k + 0] = -2;
    if (EXPECT_ERR(mok_schedule_build(ws, a), MOK_ERR_INVALID_ARGUMENT, "rank 0"))
        CHECK(strstr(mok_last_error(), "token 17") && strstr(mok_last_error(), "slot 0"),
              "id < -1: message '%s' does not name token 17, slot 0", mok_last_error());
    L.ids[0][17 * k + 0] = saved;

    /* T = 0 with NULL topk_ids is allowed */
    sched_args(a, &L, &o);
    a[1].num_tokens = 0;
    a[1].topk_ids = NULL;
    EXPECT_OK(mok_schedule_build(ws, a));
    mok_schedule_info info;
    EXPECT_OK(mok_schedule_read(ws, o.sched[1], 1, &info));
    CHECK(info.num_tokens[0] == L.T[0] && info.num_tokens[1] == 0, "schedule info tokens %lld %lld",
          (long long)info.num_tokens[0], (long long)info.num_tokens[1]);

    out_free(&o);
    good_run_on(ws, &L, "after the schedule rules");
    tiny_free(&L);
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}

MOK_TEST(api_forward_backward_rules) {
    mok_config cfg = tiny_config();
    for (int shared = 0; shared < 2; ++shared) {
        mok_shape shape = tiny_shape(shared ? 64 : 0);
        mok_group *g = NULL;
        mok_workspace *ws = NULL;
        EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
        EXPECT_OK(mok_workspace_create(&ws, g, &shape, NULL));
        if (!ws) {
            mok_group_destroy(g);
            continue;
        }
        tiny L;
        tiny_make(&L, &shape, 5 + (uint64_t)shared);
        tiny_out o;
        out_alloc(&o, &L, ws);
        mok_schedule_args sa[TP];
        sched_args(sa, &L, &o);
        EXPECT_OK(mok_schedule_build(ws, sa));
        mok_forward_args f[TP];
        mok_backward_args b[TP];
        uint16_t dummy[64] __attribute__((aligned(16)));

        fwd_args(f, &L, &o);
        f[1].x = NULL;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].x");
        fwd_args(f, &L, &o);
        f[0].y = NULL;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].y");
        fwd_args(f, &L, &o);
        f[0].router_w = NULL;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].router_w");
        fwd_args(f, &L, &o);
        f[1].w_down = NULL;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].w_down");
        fwd_args(f, &L, &o);
        f[1].context = NULL;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].context");
        fwd_args(f, &L, &o);
        f[0].x = (const char *)L.x[0] + 2;
        if (EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].x"))
            CHECK(strstr(mok_last_error(), "align") != NULL, "misaligned x: message '%s'", mok_last_error());
        fwd_args(f, &L, &o);
        if (shared) {
            f[0].s_up = NULL;
            EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].s_up");
            fwd_args(f, &L, &o);
            f[1].s_down = NULL;
            EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].s_down");
        } else {
            f[0].s_gate = dummy;
            EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].s_gate");
            fwd_args(f, &L, &o);
            f[1].s_down = dummy;
            EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].s_down");
        }
        /* num_tokens other than the schedule's (still within T_max) */
        fwd_args(f, &L, &o);
        f[1].num_tokens = L.T[1] - 1;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].num_tokens");
        fwd_args(f, &L, &o);
        f[0].num_tokens = shape.max_tokens + 1;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].num_tokens");
        /* a schedule buffer that was never built */
        mok_sizes sz;
        mok_workspace_sizes(ws, &sz);
        void *zeros = alloc_aligned(sz.schedule_bytes);
        memset(zeros, 0, sz.schedule_bytes);
        fwd_args(f, &L, &o);
        f[1].schedule = zeros;
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "schedule");
        /* rank 0's schedule given to rank 1 */
        fwd_args(f, &L, &o);
        f[1].schedule = o.sched[0];
        f[1].num_tokens = L.T[0];
        EXPECT_ERR(mok_forward(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[1].schedule");
        EXPECT_ERR(mok_forward(ws, NULL), MOK_ERR_INVALID_ARGUMENT, "args");
        EXPECT_ERR(mok_forward(NULL, f), MOK_ERR_INVALID_ARGUMENT, "workspace");
        fwd_args(f, &L, &o);
        f[0].w_gate = NULL;
        EXPECT_ERR(mok_recompute_context(ws, f), MOK_ERR_INVALID_ARGUMENT, "args[0].w_gate");

        /* a good forward for the backward's context */
        fwd_args(f, &L, &o);
        EXPECT_OK(mok_forward(ws, f));

        bwd_args(b, &L, &o);
        b[0].accumulate = 2;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[0].accumulate");
        bwd_args(b, &L, &o);
        b[1].accumulate = -1;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].accumulate");
        bwd_args(b, &L, &o);
        b[1].dx = NULL;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].dx");
        bwd_args(b, &L, &o);
        b[0].dy = NULL;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[0].dy");
        bwd_args(b, &L, &o);
        b[0].d_router_w = NULL;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[0].d_router_w");
        bwd_args(b, &L, &o);
        b[1].context = NULL;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].context");
        bwd_args(b, &L, &o);
        b[0].dw_down = NULL;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[0].dw_down");
        bwd_args(b, &L, &o);
        b[1].dw_up = (char *)o.dw[1][1] + 2;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].dw_up");
        bwd_args(b, &L, &o);
        if (shared) {
            b[1].ds_gate = NULL;
            EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].ds_gate");
        } else {
            b[1].ds_gate = dummy;
            EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[1].ds_gate");
        }
        bwd_args(b, &L, &o);
        b[0].num_tokens = L.T[0] - 3;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "args[0].num_tokens");
        bwd_args(b, &L, &o);
        b[1].schedule = zeros;
        EXPECT_ERR(mok_backward(ws, b), MOK_ERR_INVALID_ARGUMENT, "schedule");
        EXPECT_ERR(mok_backward(ws, NULL), MOK_ERR_INVALID_ARGUMENT, "args");
        free(zeros);

        out_free(&o);
        good_run_on(ws, &L, shared ? "after the pass rules (shared)" : "after the pass rules (no shared)");
        tiny_free(&L);
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
    }
}

MOK_TEST(api_read_and_trace_rules) {
    mok_config cfg = tiny_config();
    mok_shape shape = tiny_shape(64);
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    EXPECT_OK(mok_group_create_local(&g, MOK_BACKEND_CPU, TP, NULL, &cfg));
    EXPECT_OK(mok_workspace_create(&ws, g, &shape, NULL));
    if (!ws) {
        mok_group_destroy(g);
        return;
    }
    tiny L;
    tiny_make(&L, &shape, 7);
    tiny_out o;
    out_alloc(&o, &L, ws);
    mok_schedule_args sa[TP];
    sched_args(sa, &L, &o);
    EXPECT_OK(mok_schedule_build(ws, sa));
    mok_schedule_info info;
    EXPECT_ERR(mok_schedule_read(ws, o.sched[0], TP, &info), MOK_ERR_INVALID_ARGUMENT, "local_rank");
    EXPECT_ERR(mok_schedule_read(ws, o.sched[0], -1, &info), MOK_ERR_INVALID_ARGUMENT, "local_rank");
    EXPECT_ERR(mok_schedule_read(ws, o.sched[0], 0, NULL), MOK_ERR_INVALID_ARGUMENT, "info");
    EXPECT_ERR(mok_schedule_read(ws, NULL, 0, &info), MOK_ERR_INVALID_ARGUMENT, "schedule");
    EXPECT_ERR(mok_schedule_read(ws, (char *)o.sched[0] + 2, 0, &info), MOK_ERR_INVALID_ARGUMENT, "schedule");
    EXPECT_ERR(mok_schedule_read(NULL, o.sched[0], 0, &info), MOK_ERR_INVALID_ARGUMENT, "workspace");
    mok_sizes sz;
    mok_workspace_sizes(ws, &sz);
    void *zeros = alloc_aligned(sz.schedule_bytes);
    memset(zeros, 0, sz.schedule_bytes);
    EXPECT_ERR(mok_schedule_read(ws, zeros, 0, &info), MOK_ERR_INVALID_ARGUMENT, "schedule");
    free(zeros);
    for (int p = 0; p < TP; ++p) {
        EXPECT_OK(mok_schedule_read(ws, o.sched[p], p, &info));
        CHECK(info.num_tokens[0] == L.T[0] && info.num_tokens[1] == L.T[1], "rank %d: info tokens", p);
        CHECK(info.padded_rows % MOK_ROW_TILE == 0 && info.routed_rows <= info.padded_rows &&
                  info.max_expert_rows <= info.routed_rows,
              "rank %d: info rows %lld %lld %lld", p, (long long)info.routed_rows, (long long)info.padded_rows,
              (long long)info.max_expert_rows);
        CHECK(info.num_minibatches == (info.padded_rows + cfg.minibatch_rows - 1) / cfg.minibatch_rows,
              "rank %d: %lld minibatches", p, (long long)info.num_minibatches);
    }

    char path[64];
    snprintf(path, sizeof path, "/tmp/mok_test_trace_%d.json", (int)getpid());
    EXPECT_ERR(mok_trace_write(ws, path), MOK_ERR_INVALID_ARGUMENT, "trace");
    EXPECT_ERR(mok_trace_write(ws, NULL), MOK_ERR_INVALID_ARGUMENT, "path");
    EXPECT_ERR(mok_trace_write(NULL, path), MOK_ERR_INVALID_ARGUMENT, "workspace");
    out_free(&o);
    good_run_on(ws, &L, "after the read and trace rules");
    mok_workspace_destroy(ws);

    /* with tracing on, the trace is written after a pass */
    mok_config traced = tiny_config();
    traced.trace = 1;
    ws = NULL;
    EXPECT_OK(mok_workspace_create(&ws, g, &shape, &traced));
    if (ws) {
        good_run_on(ws, &L, "traced");
        EXPECT_OK(mok_trace_write(ws, path));
        FILE *f = fopen(path, "r");
        char head[32] = "";
        if (f) {
            size_t n = fread(head, 1, sizeof head - 1, f);
            head[n] = 0;
            fclose(f);
        }
        CHECK(strstr(head, "traceEvents") != NULL, "trace file starts '%s'", head);
        remove(path);
        EXPECT_ERR(mok_trace_write(ws, "/nonexistent-dir/x/trace.json"), MOK_ERR_INVALID_ARGUMENT, "path");
    }
    mok_workspace_destroy(ws);
    tiny_free(&L);
    mok_group_destroy(g);
}
