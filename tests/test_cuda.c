/* test_cuda.c — the cuda backend against the reference and the cpu backend, on one and two GPUs;
 * bitwise determinism across runs and configs; faults. Every test skips (passes with a note)
 * where the build has no CUDA backend or the machine has too few GPUs. Buffers are placed with
 * mok_memory_alloc, so this file needs no CUDA headers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/schedule.h"
#include "gpu_layer.h"
#include "layer.h"
#include "test.h"

#ifdef MOK_HAVE_CUDA
#include <cuda_runtime.h>
#endif

static int gpus(void) { return mok_backend_available(MOK_BACKEND_CUDA); }

/* Ranks for the tests that use every GPU (EP2 on two, EP4 / EP8 where lent), at most 8. */
static int all_ranks(void) { return gpus() < 8 ? gpus() : 8; }

static int skip(int need, const char *name) {
    if (gpus() >= need) return 0;
    mok_test_skip("%s needs %d GPU%s, this machine has %d", name, need, need > 1 ? "s" : "", gpus());
    return 1;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Group, workspace and the layer's tensors on the devices; x, topk_ids and router_w with 16 bytes
 * more. On failure G->message is the library's error alone, as the passes below write it. */
static mok_status gpu_open(gpu_layer *G, const layer *L, const mok_config *config) {
    mok_status st = gpu_layer_create(G, L, config);
    for (int p = 0; p < L->nranks && st == MOK_OK; ++p) gpu_layer_upload_rank(G, L, p, 16, &st);
    if (st != MOK_OK) snprintf(G->message, sizeof G->message, "%s", mok_last_error());
    return st;
}

/* Issues the forward (or recompute) with G's schedules and contexts. */
static mok_status gpu_pass(gpu_layer *G, const layer *L, int recompute, void *stream) {
    mok_forward_args fa[MOK_MAX_RANKS];
    gpu_layer_forward_args(G, L, stream, NULL, fa);
    return recompute ? mok_recompute_context(G->ws, fa) : mok_forward(G->ws, fa);
}

/* Issues schedule + forward on `stream` (NULL: the default stream) without waiting. */
static mok_status gpu_issue(gpu_layer *G, const layer *L, int recompute, void *stream) {
    mok_status st = gpu_layer_build(G, L, stream);
    if (st == MOK_OK) st = gpu_pass(G, L, recompute, stream);
    return st;
}

static mok_status gpu_forward(gpu_layer *G, const layer *L, int recompute) {
    mok_status st = gpu_issue(G, L, recompute, NULL);
    if (st == MOK_OK) st = mok_synchronize(G->ws);
    if (st != MOK_OK) snprintf(G->message, sizeof G->message, "%s", mok_last_error());
    return st;
}

static void poison_y(gpu_layer *G, const layer *L) {
    size_t bytes = (size_t)L->shape.max_tokens * (size_t)L->shape.hidden * 2;
    for (int p = 0; p < L->nranks; ++p) gpu_layer_fill(G, p, G->y[p], bytes, 0xff);
}

/* The reference on the first `keep` tokens of every rank (outputs of a token depend only on it). */
static void reference_prefix(const layer *L, int64_t keep, layer_result *ref) {
    layer sub = *L;
    for (int p = 0; p < L->nranks; ++p)
        if (sub.num_tokens[p] > keep) sub.num_tokens[p] = keep;
    layer_run_reference_forward(&sub, ref);
}

static double compare_prefix(const layer *L, const layer_result *got, const layer_result *ref, int64_t keep,
                             const char *tag) {
    layer sub = *L;
    for (int p = 0; p < L->nranks; ++p)
        if (sub.num_tokens[p] > keep) sub.num_tokens[p] = keep;
    return layer_compare(&sub, got, ref, tag);
}

/* Forward on cuda, against the reference (all tokens, or the first `keep`) and, for small layers,
 * against the cpu backend. */
static void check_forward(const char *tag, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                          float limit, const mok_config *config, int64_t keep) {
    layer L;
    if (layer_make(&L, shape, P, tokens, mok_test_seed() ^ (uint64_t)(uintptr_t)tag, routing) != 0) {
        CHECK(0, "%s: layer_make failed", tag);
        return;
    }
    L.swiglu_limit = limit;
    gpu_layer G;
    mok_status st = gpu_open(&G, &L, config);
    CHECK(st == MOK_OK, "%s: open: %s", tag, G.message);
    if (st == MOK_OK) {
        poison_y(&G, &L);
        st = gpu_forward(&G, &L, 0);
        CHECK(st == MOK_OK, "%s: forward: %s", tag, G.message);
    }
    if (st == MOK_OK) {
        layer_result got = {0}, ref = {0};
        gpu_layer_download_y(&G, &L, &got);
        reference_prefix(&L, keep, &ref);
        double err = compare_prefix(&L, &got, &ref, keep, tag);
        CHECK(err <= 1.0, "%s: cuda vs reference error %.3f", tag, err);
        if (keep >= shape->max_tokens && shape->hidden * shape->intermediate <= 256 * 256) {
            layer_result cpu = {0};
            mok_config cc = config ? *config : mok_config_default();
            cc.fwd_dispatch = MOK_PULL;
            if (layer_run_backend(&L, &cc, 0, &cpu) == MOK_OK) {
                layer_result cpu_y = {0};
                cpu_y.nranks = P;
                for (int p = 0; p < P; ++p) cpu_y.y[p] = cpu.y[p];
                double e2 = layer_compare(&L, &got, &cpu_y, tag);
                CHECK(e2 <= 1.0, "%s: cuda vs cpu error %.3f", tag, e2);
                for (int p = 0; p < P; ++p) cpu_y.y[p] = NULL;
            }
            layer_result_free(&cpu);
        }
        layer_result_free(&got);
        layer_result_free(&ref);
    }
    gpu_layer_close(&G);
    layer_free(&L);
}

static mok_shape small_shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is) {
    mok_shape s = {H, I, E, k, Is, 1, MOK_PRECISION_BF16};
    return s;
}

MOK_TEST(cuda_forward_ep1_small) {
    if (skip(1, "cuda_forward_ep1_small")) return;
    int64_t t1[1] = {300};
    mok_shape a = small_shape(256, 128, 8, 2, 128);
    check_forward("ep1 uniform", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 1 << 30);
    check_forward("ep1 skewed", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1 << 30);
    check_forward("ep1 one expert", &a, 1, t1, LAYER_ROUTE_ONE_EXPERT, 0.0f, NULL, 1 << 30);
    check_forward("ep1 even", &a, 1, t1, LAYER_ROUTE_EVEN, 0.0f, NULL, 1 << 30);
    check_forward("ep1 holes", &a, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, NULL, 1 << 30);
    check_forward("ep1 clamp", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.5f, NULL, 1 << 30);
    mok_shape b = small_shape(192, 64, 4, 1, 0); /* H not a multiple of 128, no shared expert */
    check_forward("ep1 h192 k1", &b, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 1 << 30);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    check_forward("ep1 several macrobatches", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, &ring, 1 << 30);
    int64_t zero[1] = {0};
    check_forward("ep1 T=0", &a, 1, zero, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 1 << 30);
}

MOK_TEST(cuda_forward_ep2_small) {
    if (skip(2, "cuda_forward_ep2_small")) return;
    int64_t even[2] = {300, 300}, uneven[2] = {0, 417};
    mok_shape a = small_shape(256, 128, 8, 4, 128);
    check_forward("ep2 uniform", &a, 2, even, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 1 << 30);
    check_forward("ep2 skewed", &a, 2, even, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1 << 30);
    check_forward("ep2 one expert", &a, 2, even, LAYER_ROUTE_ONE_EXPERT, 0.0f, NULL, 1 << 30);
    check_forward("ep2 even", &a, 2, even, LAYER_ROUTE_EVEN, 0.0f, NULL, 1 << 30);
    check_forward("ep2 holes", &a, 2, uneven, LAYER_ROUTE_HOLES | LAYER_ENCODED, 0.0f, NULL, 1 << 30);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.fwd_comm_sms = 4;
    check_forward("ep2 several macrobatches", &a, 2, uneven, LAYER_ROUTE_SKEWED, 0.0f, &ring, 1 << 30);
}

/* Full-size experts (the presets' H and I), checked on the first 24 tokens of every rank. The
 * expert count is cut (8 or 16 per GPU) because the reference keeps an fp64 copy of every weight
 * on the host; routing is still top-8. */
MOK_TEST(cuda_forward_full_size) {
    if (skip(1, "cuda_forward_full_size")) return;
    if (getenv("MOK_TEST_NO_FULL")) {
        mok_test_skip("MOK_TEST_NO_FULL is set");
        return;
    }
    int64_t t[2] = {4096, 4096};
    mok_shape dsv3 = small_shape(7168, 2048, 8, 8, 2048);
    check_forward("deepseek-v3 experts (8)", &dsv3, 1, t, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 24);
    mok_shape qwen = small_shape(2048, 768, 32, 8, 0);
    check_forward("qwen3-30b-a3b experts (32)", &qwen, 1, t, LAYER_ROUTE_SKEWED, 0.0f, NULL, 24);
    mok_shape glm = small_shape(5120, 1536, 16, 8, 1536);
    check_forward("glm-4.5 experts (16)", &glm, 1, t, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 24);
    if (gpus() >= 2) {
        mok_shape dsv3_ep2 = small_shape(7168, 2048, 16, 8, 2048);
        check_forward("deepseek-v3 ep2 experts (16)", &dsv3_ep2, 2, t, LAYER_ROUTE_SKEWED, 0.0f, NULL, 24);
    }
}

/* The tiles' walk order (MOK_CUDA_RASTER, read when a workspace is created): set for the next workspaces, or
 * restored to the environment's value with r = 0. Results must not depend on it. */
static void set_raster(int r) {
    static char saved[16];
    static int have_saved = -1;
    if (have_saved < 0) {
        const char *v = getenv("MOK_CUDA_RASTER");
        have_saved = v != NULL;
        if (v) snprintf(saved, sizeof saved, "%s", v);
    }
    if (r > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r);
        setenv("MOK_CUDA_RASTER", v, 1);
    } else if (have_saved) {
        setenv("MOK_CUDA_RASTER", saved, 1);
    } else {
        unsetenv("MOK_CUDA_RASTER");
    }
}

/* Bitwise equality across repeated runs and across fwd_comm_sms, minibatch_rows, ring_rows. */
MOK_TEST(cuda_forward_deterministic) {
    if (skip(1, "cuda_forward_deterministic")) return;
    int P = all_ranks();
    int64_t tokens[8] = {1500, 1100, 700, 1300, 0, 900, 1200, 800};
    mok_shape s = small_shape(512, 256, 16, 4, 256);
    layer L;
    layer_make(&L, &s, P, tokens, mok_test_seed(), LAYER_ROUTE_SKEWED);
    size_t bytes[8];
    uint16_t *first[8];
    for (int p = 0; p < P; ++p) {
        bytes[p] = (size_t)tokens[p] * 512 * 2;
        first[p] = malloc(bytes[p] ? bytes[p] : 1);
    }
    struct { int comm, mb, ring, raster; } cfgs[] = {{32, 1024, 16384, 1}, {8, 1024, 16384, 8},
                                                     {16, 256, 16384, 3}, {16, 128, 256, 16}, {24, 512, 1024, 1}};
    int runs = 0;
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; ++c) {
        mok_config cfg = mok_config_default();
        cfg.fwd_comm_sms = cfgs[c].comm;
        cfg.minibatch_rows = cfgs[c].mb;
        cfg.ring_rows = cfgs[c].ring;
        set_raster(cfgs[c].raster);
        gpu_layer G;
        if (gpu_open(&G, &L, &cfg) != MOK_OK) {
            CHECK(0, "open: %s", G.message);
            break;
        }
        int reps = c == 0 ? 20 : 3;
        for (int r = 0; r < reps; ++r) {
            poison_y(&G, &L);
            if (gpu_forward(&G, &L, 0) != MOK_OK) {
                CHECK(0, "forward: %s", G.message);
                break;
            }
            for (int p = 0; p < P; ++p) {
                uint16_t *y = malloc(bytes[p] ? bytes[p] : 1);
                mok_memory_copy(G.group, p, y, G.y[p], bytes[p], MOK_COPY_RANK_TO_HOST);
                if (runs == 0) memcpy(first[p], y, bytes[p]);
                else CHECK(memcmp(first[p], y, bytes[p]) == 0, "config %zu run %d rank %d: y differs bitwise", c, r, p);
                free(y);
            }
            ++runs;
        }
        gpu_layer_close(&G);
    }
    set_raster(0);
    for (int p = 0; p < P; ++p) free(first[p]);
    layer_free(&L);
}

/* Two contexts of one rank and workspace hold the same activations, bit for bit, and tags of the
 * same workspace and rank (core/schedule.h); their builds may differ (gpu_forward builds the
 * schedule again before each pass). */
static int contexts_equal(const void *a, const void *b, size_t bytes) {
    const mok_context_tag *ta = a, *tb = b;
    return ta->magic == MOK_CONTEXT_MAGIC && tb->magic == MOK_CONTEXT_MAGIC && ta->workspace == tb->workspace &&
           ta->rank == tb->rank &&
           memcmp((const char *)a + MOK_CONTEXT_TAG_BYTES, (const char *)b + MOK_CONTEXT_TAG_BYTES,
                  bytes - MOK_CONTEXT_TAG_BYTES) == 0;
}

/* mok_recompute_context rebuilds the forward's context bit for bit. */
MOK_TEST(cuda_recompute_context) {
    if (skip(1, "cuda_recompute_context")) return;
    int64_t tokens[1] = {700};
    mok_shape s = small_shape(256, 128, 8, 4, 128);
    layer L;
    layer_make(&L, &s, 1, tokens, mok_test_seed() + 7, LAYER_ROUTE_UNIFORM);
    gpu_layer G;
    if (gpu_open(&G, &L, NULL) != MOK_OK) {
        CHECK(0, "open: %s", G.message);
        layer_free(&L);
        return;
    }
    size_t bytes = G.sizes.context_bytes;
    unsigned char *a = malloc(bytes), *b = malloc(bytes), *ff = malloc(bytes);
    memset(ff, 0xff, bytes);
    mok_memory_copy(G.group, 0, G.context[0], ff, bytes, MOK_COPY_HOST_TO_RANK);
    CHECK(gpu_forward(&G, &L, 0) == MOK_OK, "forward: %s", G.message);
    mok_memory_copy(G.group, 0, a, G.context[0], bytes, MOK_COPY_RANK_TO_HOST);
    mok_memory_copy(G.group, 0, G.context[0], ff, bytes, MOK_COPY_HOST_TO_RANK);
    CHECK(gpu_forward(&G, &L, 1) == MOK_OK, "recompute: %s", G.message);
    mok_memory_copy(G.group, 0, b, G.context[0], bytes, MOK_COPY_RANK_TO_HOST);
    CHECK(contexts_equal(a, b, bytes), "recomputed context differs from the forward's");
    free(a);
    free(b);
    free(ff);
    gpu_layer_close(&G);
    layer_free(&L);
}

/* A bad expert id is found by the schedule kernel and reported, not trapped. */
MOK_TEST(cuda_bad_expert_id) {
    if (skip(1, "cuda_bad_expert_id")) return;
    int64_t tokens[1] = {64};
    mok_shape s = small_shape(128, 64, 4, 2, 0);
    layer L;
    layer_make(&L, &s, 1, tokens, 5, LAYER_ROUTE_UNIFORM);
    L.topk_ids[0][17] = 9;
    gpu_layer G;
    if (gpu_open(&G, &L, NULL) == MOK_OK) {
        mok_status st = gpu_forward(&G, &L, 0);
        CHECK(st == MOK_ERR_INVALID_ARGUMENT, "bad id: got %s (%s)", mok_status_string(st), G.message);
        CHECK(strstr(G.message, "topk_ids") != NULL, "message should name topk_ids: %s", G.message);
        /* the error is the caller's: with the id fixed, the same workspace works again */
        L.topk_ids[0][17] = 1;
        mok_memory_copy(G.group, 0, G.ids[0], L.topk_ids[0], 64 * 2 * 4, MOK_COPY_HOST_TO_RANK);
        st = gpu_forward(&G, &L, 0);
        CHECK(st == MOK_OK, "after fixing the id: %s", G.message);
    }
    gpu_layer_close(&G);
    layer_free(&L);
}

/* A peer that never joins: the group creation times out. */
MOK_TEST(cuda_peer_never_joins) {
    if (skip(1, "cuda_peer_never_joins")) return;
    mok_unique_id id;
    CHECK(mok_unique_id_create(MOK_BACKEND_CUDA, &id) == MOK_OK, "unique id: %s", mok_last_error());
    mok_config cfg = mok_config_default();
    cfg.peer_timeout_ms = 3000;
    mok_group *g = NULL;
    double t0 = now_ms();
    mok_status st = mok_group_create(&g, MOK_BACKEND_CUDA, 2, 0, &id, 0, &cfg);
    double dt = now_ms() - t0;
    CHECK(st == MOK_ERR_TIMEOUT, "got %s: %s", mok_status_string(st), mok_last_error());
    CHECK(dt < 3000 + 5000, "took %.0f ms for a 3000 ms timeout", dt);
    mok_group_destroy(g);
}

/* Create and destroy a group and a workspace many times; device memory must not grow. */
MOK_TEST(cuda_create_destroy_cycles) {
    if (skip(1, "cuda_create_destroy_cycles")) return;
    mok_shape s = small_shape(256, 128, 8, 2, 128);
    s.max_tokens = 512;
    int devices[1] = {0};
    size_t free_first = 0, free_last = 0;
    for (int i = 0; i < 100; ++i) {
        mok_group *g = NULL;
        mok_workspace *ws = NULL;
        mok_status st = mok_group_create_local(&g, MOK_BACKEND_CUDA, 1, devices, NULL);
        if (st == MOK_OK) st = mok_workspace_create(&ws, g, &s, NULL);
        CHECK(st == MOK_OK, "cycle %d: %s", i, mok_last_error());
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
        if (st != MOK_OK) break;
#ifdef MOK_HAVE_CUDA
        /* after the first cycle: the CUDA context and NCCL's one-time state exist */
        size_t free_now = 0, total = 0;
        cudaSetDevice(0);
        cudaDeviceSynchronize();
        cudaMemGetInfo(&free_now, &total);
        if (i == 0) free_first = free_now;
        free_last = free_now;
#endif
    }
    /* One workspace of this shape holds tens of MiB: a leak per cycle would show as GiBs. */
    CHECK(free_last + (64u << 20) >= free_first, "device memory fell by %.1f MiB over 99 cycles",
          ((double)free_first - (double)free_last) / (1 << 20));
}

/* ---- the schedule built on the device against core/schedule.c, byte for byte ------------- */

enum { IDS_UNIFORM, IDS_SKEWED, IDS_ONE_EXPERT, IDS_HOLES };

static uint64_t ids_rng(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Ids of T tokens: uniform; skewed (e = E u^3: low ids hot); every slot to expert E - 1 (the last
 * rank's); uniform with a quarter of the slots -1 and every fifth token all -1. */
static void make_ids(int32_t *ids, int64_t T, int64_t k, int64_t E, int mode, uint64_t *rng) {
    for (int64_t s = 0; s < T * k; ++s) {
        double u = (double)(ids_rng(rng) >> 11) / 9007199254740992.0;
        int32_t e = (int32_t)(ids_rng(rng) % (uint64_t)E);
        if (mode == IDS_SKEWED) e = (int32_t)(E * u * u * u);
        if (mode == IDS_ONE_EXPERT) e = (int32_t)(E - 1);
        if (mode == IDS_HOLES && (u < 0.25 || (s / k) % 5 == 0)) e = -1;
        ids[s] = e;
    }
}

/* The first difference between two schedules in every byte core/schedule.c defines (the header
 * but its padding, counts, segments, row_peer / row_slot below padded_rows, own_ids); 0 when none. */
static int sched_differs(const mok_sched_layout *lay, void *got_buf, void *want_buf, char *what, size_t size) {
    mok_sched_view got = mok__sched_view(lay, got_buf), want = mok__sched_view(lay, want_buf);
    const mok_sched_header *g = got.header, *w = want.header;
#define FIELD(f)                                                                                   \
    if (g->f != w->f) return snprintf(what, size, "header." #f " %lld, want %lld", (long long)g->f, (long long)w->f), 1
    FIELD(magic);
    FIELD(nranks);
    FIELD(rank);
    FIELD(num_local_experts);
    FIELD(topk);
    FIELD(max_rows);
    FIELD(routed_rows);
    FIELD(padded_rows);
    FIELD(max_expert_rows);
    FIELD(error);
#undef FIELD
    for (int q = 0; q < MOK_MAX_RANKS; ++q)
        if (g->num_tokens[q] != w->num_tokens[q])
            return snprintf(what, size, "header.num_tokens[%d] %lld, want %lld", q, (long long)g->num_tokens[q],
                            (long long)w->num_tokens[q]), 1;
    const int64_t L = lay->num_local_experts, rows = w->padded_rows;
    struct {
        const char *name;
        const void *got, *want;
        int64_t count;
        int wide;
    } arrays[] = {
        {"counts", got.counts, want.counts, L * lay->nranks, 1},
        {"expert_start", got.expert_start, want.expert_start, L + 1, 1},
        {"expert_rows", got.expert_rows, want.expert_rows, L, 1},
        {"row_peer", got.row_peer, want.row_peer, rows, 0},
        {"row_slot", got.row_slot, want.row_slot, rows, 0},
        {"own_ids", got.own_ids, want.own_ids, lay->max_tokens * lay->topk, 0},
    };
    for (size_t a = 0; a < sizeof arrays / sizeof arrays[0]; ++a) {
        const size_t bytes = (size_t)arrays[a].count * (arrays[a].wide ? 8 : 4);
        if (!memcmp(arrays[a].got, arrays[a].want, bytes)) continue;
        for (int64_t i = 0; i < arrays[a].count; ++i) {
            long long x = arrays[a].wide ? ((const int64_t *)arrays[a].got)[i] : ((const int32_t *)arrays[a].got)[i];
            long long y = arrays[a].wide ? ((const int64_t *)arrays[a].want)[i] : ((const int32_t *)arrays[a].want)[i];
            if (x != y) return snprintf(what, size, "%s[%lld] %lld, want %lld", arrays[a].name, (long long)i, x, y), 1;
        }
    }
    return 0;
}

typedef struct sched_case {
    const char *tag;
    int mode;
    int64_t tokens[8]; /* per rank; past the case's ranks: the first entry */
} sched_case;

/* One group of P ranks and one workspace for every case, in order (so a build after a larger
 * one shows stale state); each case's schedules are built on the device into poisoned buffers
 * and compared with core/schedule.c's on the same ids, rank by rank. Then an id = E on the last
 * rank: reported, the header's error is core/schedule.c's, and the first case, built again,
 * still matches. */
static void check_schedules(const char *tag, int P, int64_t E, int64_t k, int64_t max_tokens,
                            const sched_case *cases, int num_cases) {
    mok_shape shape = small_shape(128, 64, E, k, 0);
    shape.max_tokens = max_tokens;
    mok_sched_layout lay;
    mok__sched_layout(&lay, P, E / P, k, max_tokens);
    int devices[MOK_MAX_RANKS];
    for (int p = 0; p < P; ++p) devices[p] = p;
    mok_group *group = NULL;
    mok_workspace *ws = NULL;
    mok_sizes sizes;
    mok_status st = mok_group_create_local(&group, MOK_BACKEND_CUDA, P, devices, NULL);
    if (st == MOK_OK) st = mok_workspace_create(&ws, group, &shape, NULL);
    if (st == MOK_OK) st = mok_workspace_sizes(ws, &sizes);
    CHECK(st == MOK_OK, "%s: open: %s", tag, mok_last_error());
    if (st == MOK_OK) CHECK(sizes.schedule_bytes == lay.bytes, "%s: schedule_bytes %zu, layout %zu", tag,
                            sizes.schedule_bytes, lay.bytes);
    const size_t id_bytes = (size_t)(max_tokens * k) * 4 + 16;
    void *dev_ids[MOK_MAX_RANKS] = {0}, *dev_sched[MOK_MAX_RANKS] = {0};
    int32_t *ids[MOK_MAX_RANKS] = {0};
    for (int p = 0; p < P && st == MOK_OK; ++p) {
        st = mok_memory_alloc(group, p, id_bytes, &dev_ids[p]);
        if (st == MOK_OK) st = mok_memory_alloc(group, p, lay.bytes, &dev_sched[p]);
        ids[p] = (int32_t *)malloc(id_bytes);
    }
    CHECK(st == MOK_OK, "%s: buffers: %s", tag, mok_last_error());
    char *poison = (char *)malloc(lay.bytes), *got = (char *)malloc(lay.bytes), *want = (char *)malloc(lay.bytes);
    memset(poison, 0xa5, lay.bytes);
    for (int c = 0; c <= num_cases + 1 && st == MOK_OK; ++c) {
        const int bad_id = c == num_cases;
        const sched_case *sc = &cases[c < num_cases ? c : 0];
        int64_t tokens[MOK_MAX_RANKS];
        uint64_t rng = mok_test_seed() ^ ((uint64_t)c * 0x9e37u + (uint64_t)P * 0x51u + (uint64_t)E);
        mok_schedule_args args[MOK_MAX_RANKS];
        for (int p = 0; p < P && st == MOK_OK; ++p) {
            tokens[p] = p < 8 ? sc->tokens[p] : sc->tokens[0];
            make_ids(ids[p], tokens[p], k, E, sc->mode, &rng);
            if (bad_id && p == P - 1) ids[p][tokens[p] * k / 2] = (int32_t)E;
            st = mok_memory_copy(group, p, dev_ids[p], ids[p], (size_t)(tokens[p] * k) * 4, MOK_COPY_HOST_TO_RANK);
            if (st == MOK_OK) st = mok_memory_copy(group, p, dev_sched[p], poison, lay.bytes, MOK_COPY_HOST_TO_RANK);
            args[p] = (mok_schedule_args){tokens[p], (const int32_t *)dev_ids[p], dev_sched[p], NULL};
        }
        if (st == MOK_OK) st = mok_schedule_build(ws, args);
        if (st == MOK_OK) st = mok_synchronize(ws);
        if (bad_id) {
            CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "topk_ids"), "%s, id = E: got %s (%s)",
                  tag, mok_status_string(st), mok_last_error());
            st = MOK_OK;
        } else {
            CHECK(st == MOK_OK, "%s, %s: build: %s", tag, sc->tag, mok_last_error());
        }
        for (int p = 0; p < P && st == MOK_OK; ++p) {
            st = mok_memory_copy(group, p, got, dev_sched[p], lay.bytes, MOK_COPY_RANK_TO_HOST);
            CHECK(st == MOK_OK, "%s, %s: download: %s", tag, sc->tag, mok_last_error());
            memset(want, 0x5a, lay.bytes);
            int err = mok__sched_build(&lay, want, p, E, tokens, (const int32_t *const *)ids);
            const mok_sched_header *h = (const mok_sched_header *)got;
            char what[256];
            if (bad_id) {
                /* On an error the device leaves the rows unset (padded_rows 0); the code is the same. */
                CHECK(err == MOK_SCHED_ERR_EXPERT_ID && h->error == err && h->padded_rows == 0,
                      "%s, id = E: rank %d: error %d, padded_rows %lld; core/schedule.c: error %d", tag, p, h->error,
                      (long long)h->padded_rows, err);
                continue;
            }
            CHECK(err == 0, "%s, %s: core/schedule.c reports error %d", tag, sc->tag, err);
            if (st == MOK_OK && sched_differs(&lay, got, want, what, sizeof what))
                CHECK(0, "%s, %s: rank %d of %d: %s", tag, sc->tag, p, P, what);
        }
    }
    free(poison);
    free(got);
    free(want);
    for (int p = 0; p < P; ++p) {
        if (dev_ids[p]) mok_memory_free(group, p, dev_ids[p]);
        if (dev_sched[p]) mok_memory_free(group, p, dev_sched[p]);
        free(ids[p]);
    }
    mok_workspace_destroy(ws);
    mok_group_destroy(group);
}

/* The device builds its schedule in chunks of a peer's slots (1024 times a power of two, chosen
 * from T_max * k, P and the SM count); the cases cover one chunk and many, a last chunk cut short,
 * chunks of several 1024-slot steps (T_max * k = 2^19 on one rank, below 256 SMs), more local
 * experts than the scan's 1024 threads, T = 0 on a rank, and larger T before smaller on the same
 * workspace. */
MOK_TEST(cuda_schedule_matches_cpu) {
    if (skip(1, "cuda_schedule_matches_cpu")) return;
    const sched_case many_chunks[] = {
        {"uniform, 12000 slots", IDS_UNIFORM, {3000}},
        {"skewed, 11996 slots", IDS_SKEWED, {2999}},
        {"one expert", IDS_ONE_EXPERT, {3000}},
        {"holes", IDS_HOLES, {1777}},
        {"T = 0", IDS_UNIFORM, {0}},
        {"one token", IDS_SKEWED, {1}},
        {"exactly one chunk", IDS_UNIFORM, {256}},
    };
    check_schedules("ep1 E16 k4", 1, 16, 4, 3000, many_chunks, 7);
    const sched_case one_chunk[] = {
        {"uniform", IDS_UNIFORM, {100}},
        {"holes", IDS_HOLES, {37}},
        {"one expert", IDS_ONE_EXPERT, {99}},
    };
    check_schedules("ep1 E8 k2, T_max * k < 1024", 1, 8, 2, 100, one_chunk, 3);
    const sched_case long_chunks[] = {
        {"skewed, full", IDS_SKEWED, {65536}},
        {"uniform, 400000 slots", IDS_UNIFORM, {50000}},
        {"one expert, a few chunks", IDS_ONE_EXPERT, {700}},
        {"holes", IDS_HOLES, {65535}},
    };
    check_schedules("ep1 E64 k8, T_max = 65536", 1, 64, 8, 65536, long_chunks, 4);
    const sched_case wide[] = {
        {"uniform", IDS_UNIFORM, {700}},
        {"skewed", IDS_SKEWED, {699}},
    };
    check_schedules("ep1 E1500 k2", 1, 1500, 2, 700, wide, 2);
    /* Two ranks where two GPUs exist, then every GPU (up to 8) where there are more. */
    const int rank_counts[2] = {2, all_ranks()};
    for (int r = 0; r < 2; ++r) {
        const int P = rank_counts[r];
        if (P < 2 || P > all_ranks() || (r == 1 && P == 2)) continue; /* the GPUs there are */
        const sched_case ranks[] = {
            {"uniform", IDS_UNIFORM, {2500, 2500, 2500, 2500, 2500, 2500, 2500, 2500}},
            {"skewed, uneven", IDS_SKEWED, {2500, 1234, 17, 2500, 999, 2048, 1, 2200}},
            {"one expert", IDS_ONE_EXPERT, {2500, 2500, 2000, 300, 2500, 2500, 2500, 2500}},
            {"holes", IDS_HOLES, {1777, 2500, 2500, 0, 1024, 2500, 333, 2500}},
            {"T = 0 on rank 0", IDS_UNIFORM, {0, 2500, 2500, 2500, 2500, 2500, 2500, 2500}},
            {"T = 0 on the last rank", IDS_SKEWED, {2500, 0, 2500, 2500, 2500, 2500, 2500, 0}},
        };
        char tag[64];
        snprintf(tag, sizeof tag, "ep%d E%d k8", P, 16 * P);
        check_schedules(tag, P, 16 * P, 8, 2500, ranks, 6);
    }
}

/* Schedule + forward captured once in a CUDA graph, replayed with new x, router weights and
 * routing: the same bits as a direct run on those inputs (no host synchronisation inside). */
MOK_TEST(cuda_graph_capture_replay) {
    if (skip(1, "cuda_graph_capture_replay")) return;
#ifdef MOK_HAVE_CUDA
    int64_t tokens[1] = {900};
    mok_shape s = small_shape(512, 256, 16, 4, 256);
    layer A, B;
    layer_make(&A, &s, 1, tokens, mok_test_seed() + 11, LAYER_ROUTE_UNIFORM);
    layer_make(&B, &s, 1, tokens, mok_test_seed() + 12, LAYER_ROUTE_SKEWED);
    memcpy(B.w[0][0], A.w[0][0], 16 * 256 * 512 * 2); /* same weights, new x and routing */
    memcpy(B.w[1][0], A.w[1][0], 16 * 256 * 512 * 2);
    memcpy(B.w[2][0], A.w[2][0], 16 * 256 * 512 * 2);
    memcpy(B.s[0], A.s[0], 256 * 512 * 2);
    memcpy(B.s[1], A.s[1], 256 * 512 * 2);
    memcpy(B.s[2], A.s[2], 256 * 512 * 2);
    gpu_layer G;
    if (gpu_open(&G, &A, NULL) != MOK_OK) {
        CHECK(0, "open: %s", G.message);
        return;
    }
    size_t ybytes = 900 * 512 * 2;
    uint16_t *direct = malloc(ybytes), *replayed = malloc(ybytes);
    /* direct run on B's inputs */
    mok_memory_copy(G.group, 0, G.x[0], B.x[0], ybytes, MOK_COPY_HOST_TO_RANK);
    mok_memory_copy(G.group, 0, G.ids[0], B.topk_ids[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
    mok_memory_copy(G.group, 0, G.rw[0], B.router_w[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
    CHECK(gpu_forward(&G, &B, 0) == MOK_OK, "direct: %s", G.message);
    mok_memory_copy(G.group, 0, direct, G.y[0], ybytes, MOK_COPY_RANK_TO_HOST);
    /* capture with A's inputs in place */
    mok_memory_copy(G.group, 0, G.x[0], A.x[0], ybytes, MOK_COPY_HOST_TO_RANK);
    mok_memory_copy(G.group, 0, G.ids[0], A.topk_ids[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
    mok_memory_copy(G.group, 0, G.rw[0], A.router_w[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
    cudaStream_t stream;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaSetDevice(0);
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) == cudaSuccess, "begin capture");
    mok_status st = gpu_issue(&G, &A, 0, stream);
    CHECK(st == MOK_OK, "captured issue: %s", mok_last_error());
    CHECK(cudaStreamEndCapture(stream, &graph) == cudaSuccess, "end capture: %s", cudaGetErrorString(cudaGetLastError()));
    CHECK(graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate: %s",
          cudaGetErrorString(cudaGetLastError()));
    if (exec) {
        for (int r = 0; r < 3; ++r) { /* replay on A's inputs: warm, and it must not break anything */
            CHECK(cudaGraphLaunch(exec, stream) == cudaSuccess, "launch");
        }
        cudaStreamSynchronize(stream);
        /* new inputs: B's, then replay */
        mok_memory_copy(G.group, 0, G.x[0], B.x[0], ybytes, MOK_COPY_HOST_TO_RANK);
        mok_memory_copy(G.group, 0, G.ids[0], B.topk_ids[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
        mok_memory_copy(G.group, 0, G.rw[0], B.router_w[0], 900 * 4 * 4, MOK_COPY_HOST_TO_RANK);
        poison_y(&G, &B);
        CHECK(cudaGraphLaunch(exec, stream) == cudaSuccess, "launch");
        CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "sync");
        CHECK(mok_synchronize(G.ws) == MOK_OK, "kernel error: %s", mok_last_error());
        mok_memory_copy(G.group, 0, replayed, G.y[0], ybytes, MOK_COPY_RANK_TO_HOST);
        CHECK(memcmp(direct, replayed, ybytes) == 0, "graph replay with new inputs differs from a direct run");
        cudaGraphExecDestroy(exec);
    }
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    free(direct);
    free(replayed);
    gpu_layer_close(&G);
    layer_free(&A);
    layer_free(&B);
#endif
}

/* ---- backward ------------------------------------------------------------------------------ */

/* Forward + backward on cuda against the reference (and the cpu backend for small layers). */
static void check_backward(const char *tag, const mok_shape *shape, int P, const int64_t *tokens, int routing,
                           float limit, const mok_config *config, int accumulate) {
    layer L;
    if (layer_make(&L, shape, P, tokens, mok_test_seed() ^ (uint64_t)(uintptr_t)tag ^ 0x55, routing) != 0) {
        CHECK(0, "%s: layer_make failed", tag);
        return;
    }
    L.swiglu_limit = limit;
    gpu_layer G;
    mok_status st = gpu_open(&G, &L, config);
    CHECK(st == MOK_OK, "%s: open: %s", tag, G.message);
    layer_result got = {0}, ref = {0};
    if (st == MOK_OK) {
        st = gpu_forward(&G, &L, 0);
        CHECK(st == MOK_OK, "%s: forward: %s", tag, G.message);
    }
    if (st == MOK_OK) {
        gpu_layer_download_y(&G, &L, &got);
        st = gpu_layer_backward(&G, &L, accumulate, NULL, &got);
        CHECK(st == MOK_OK, "%s: backward: %s", tag, G.message);
    }
    if (st == MOK_OK) {
        layer_run_reference(&L, &ref);
        double err = layer_compare(&L, &got, &ref, tag);
        CHECK(err <= 1.0, "%s: cuda backward vs reference error %.3f", tag, err);
    }
    layer_result_free(&got);
    layer_result_free(&ref);
    gpu_layer_close(&G);
    layer_free(&L);
}

MOK_TEST(cuda_backward_ep1) {
    if (skip(1, "cuda_backward_ep1")) return;
    int64_t t1[1] = {300};
    mok_shape a = small_shape(256, 128, 8, 2, 128);
    check_backward("bwd ep1 uniform", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0);
    check_backward("bwd ep1 skewed accumulate", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1);
    check_backward("bwd ep1 even (empty experts)", &a, 1, t1, LAYER_ROUTE_EVEN, 0.0f, NULL, 0);
    check_backward("bwd ep1 holes, weights <= 0", &a, 1, t1, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, NULL, 0);
    check_backward("bwd ep1 clamp", &a, 1, t1, LAYER_ROUTE_UNIFORM, 0.5f, NULL, 0);
    mok_shape b = small_shape(192, 64, 4, 1, 0);
    check_backward("bwd ep1 h192 k1 no shared", &b, 1, t1, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.context_rows = 128;
    check_backward("bwd ep1 several macrobatches, replay", &a, 1, t1, LAYER_ROUTE_SKEWED, 0.0f, &ring, 0);
    check_backward("bwd ep1 several macrobatches, accumulate", &a, 1, t1, LAYER_ROUTE_ONE_EXPERT, 0.0f, &ring, 1);
}

MOK_TEST(cuda_backward_ep2) {
    if (skip(2, "cuda_backward_ep2")) return;
    int64_t even[2] = {300, 300}, uneven[2] = {0, 417};
    mok_shape a = small_shape(256, 128, 8, 4, 128);
    check_backward("bwd ep2 uniform", &a, 2, even, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0);
    check_backward("bwd ep2 skewed accumulate", &a, 2, even, LAYER_ROUTE_SKEWED, 0.0f, NULL, 1);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.context_rows = 256;
    ring.bwd_comm_sms = 4;
    check_backward("bwd ep2 uneven, macrobatches, replay", &a, 2, uneven, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS,
                   0.0f, &ring, 0);
}

/* The compute-sanitizer cases (scripts/gpu-check.sh --sanitize): one forward and backward each,
 * as small as a layer gets while it still takes every path: several macrobatches, replay of
 * rows the context does not keep, -1 slots, router weights <= 0, the shared expert, a rank with
 * fewer tokens (EP2); each with the default transfers and with every one turned around. */
static void sanitize_case(const char *tag, int P, const int64_t *tokens) {
    mok_shape a = small_shape(128, 128, 4, 2, 128);
    mok_config ring = mok_config_default();
    ring.minibatch_rows = 128;
    ring.ring_rows = 256;
    ring.context_rows = 128;
    ring.fwd_comm_sms = ring.bwd_comm_sms = 2;
    check_backward(tag, &a, P, tokens, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, &ring, 0);
    ring.fwd_dispatch = ring.bwd_combine = MOK_PUSH; /* every transfer turned around */
    ring.fwd_combine = ring.bwd_dispatch = MOK_PULL;
    char turned[96];
    snprintf(turned, sizeof turned, "%s, turned transfers", tag);
    check_backward(turned, &a, P, tokens, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, &ring, 0);
}

MOK_TEST(cuda_sanitize_ep1) {
    if (skip(1, "cuda_sanitize_ep1")) return;
    int64_t t[1] = {150};
    sanitize_case("sanitize ep1", 1, t);
}

MOK_TEST(cuda_sanitize_ep2) {
    if (skip(2, "cuda_sanitize_ep2")) return;
    int64_t t[2] = {150, 97};
    sanitize_case("sanitize ep2", 2, t);
}

/* EP4 and EP8 where the machine has the GPUs: every output and gradient against the reference,
 * uniform and skewed routing, uneven tokens (one rank with none), several macrobatches with
 * replay. (The determinism tests above run on every GPU of the machine too.) */
MOK_TEST(cuda_ep4_ep8) {
    if (skip(4, "cuda_ep4_ep8")) return;
    for (int P = 4; P <= 8 && P <= gpus(); P *= 2) {
        int64_t even[8], uneven[8];
        for (int r = 0; r < P; ++r) {
            even[r] = 256;
            uneven[r] = r == 1 ? 0 : 100 + 53 * r;
        }
        mok_shape a = small_shape(256, 128, 4 * P, 4, 128);
        char tag[64];
        snprintf(tag, sizeof tag, "ep%d uniform", P);
        check_backward(tag, &a, P, even, LAYER_ROUTE_UNIFORM, 0.0f, NULL, 0);
        snprintf(tag, sizeof tag, "ep%d skewed, uneven", P);
        check_backward(tag, &a, P, uneven, LAYER_ROUTE_SKEWED, 0.0f, NULL, 0);
        mok_config ring = mok_config_default();
        ring.minibatch_rows = 128;
        ring.ring_rows = 256;
        ring.context_rows = 256;
        snprintf(tag, sizeof tag, "ep%d macrobatches, replay, weights <= 0", P);
        check_backward(tag, &a, P, uneven, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS, 0.0f, &ring, 1);
    }
}

/* Every gradient bitwise equal across runs and across bwd_comm_sms, minibatch and ring sizes. */
MOK_TEST(cuda_backward_deterministic) {
    if (skip(1, "cuda_backward_deterministic")) return;
    int P = all_ranks();
    int64_t tokens[8] = {700, 500, 0, 300, 650, 420, 510, 280};
    mok_shape s = small_shape(512, 256, 8, 4, 256);
    layer L;
    layer_make(&L, &s, P, tokens, mok_test_seed() + 3, LAYER_ROUTE_SKEWED);
    struct { int comm, mb, ring, raster; } cfgs[] = {{32, 1024, 16384, 1}, {8, 256, 16384, 8}, {16, 128, 256, 3},
                                                     {24, 128, 512, 16}};
    layer_result first = {0};
    int have_first = 0;
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; ++c) {
        mok_config cfg = mok_config_default();
        cfg.bwd_comm_sms = cfgs[c].comm;
        cfg.minibatch_rows = cfgs[c].mb;
        cfg.ring_rows = cfgs[c].ring;
        set_raster(cfgs[c].raster);
        gpu_layer G;
        if (gpu_open(&G, &L, &cfg) != MOK_OK) {
            CHECK(0, "open: %s", G.message);
            break;
        }
        int reps = c == 0 ? 5 : 2;
        for (int r = 0; r < reps; ++r) {
            layer_result got = {0};
            if (gpu_forward(&G, &L, 0) != MOK_OK || gpu_layer_backward(&G, &L, 0, NULL, &got) != MOK_OK) {
                CHECK(0, "config %zu: %s", c, G.message);
                layer_result_free(&got);
                break;
            }
            gpu_layer_download_y(&G, &L, &got);
            if (!have_first) {
                first = got;
                have_first = 1;
                continue;
            }
            char what[256] = "";
            CHECK(layer_equal(&L, &first, &got, what, sizeof what), "config %zu run %d: %s", c, r, what);
            layer_result_free(&got);
        }
        gpu_layer_close(&G);
    }
    set_raster(0);
    if (have_first) layer_result_free(&first);
    layer_free(&L);
}

/* A tuning switch (a MOK_CUDA_* variable, read when a workspace is created) set by a test and given back
 * its environment value afterwards: env_save before the first setenv, env_restore at the end. */
typedef struct env_saved {
    const char *var;
    int had;
    char value[32];
} env_saved;

static env_saved env_save(const char *var) {
    env_saved s = {var, 0, ""};
    const char *v = getenv(var);
    if (v) {
        s.had = 1;
        snprintf(s.value, sizeof s.value, "%s", v);
    }
    return s;
}

static void env_restore(const env_saved *s) {
    if (s->had) setenv(s->var, s->value, 1);
    else unsetenv(s->var);
}

/* The TMA loads and the cp.async loads (MOK_CUDA_TMA=0) feed the tiles the same operands, the
 * gate|up tiles' h handed to the producer's warps (the TMA path's default) is the consumers' own
 * (MOK_CUDA_HANDOFF=0), and the down and dx rows stored straight from the accumulators (the
 * default) are the staged ones (MOK_CUDA_DIRECT_ROWS=0, on either load path): y and every gradient
 * (which read the context's g|u) bitwise equal, on half-width tiles (H, I not multiples of 128),
 * the shared expert, uneven tokens, several macrobatches, replayed rows and context rows fewer
 * than the routed rows. */
MOK_TEST(cuda_tma_matches_cp_async) {
    if (skip(1, "cuda_tma_matches_cp_async")) return;
    int P = gpus() >= 2 ? 2 : 1;
    int64_t tokens[2] = {600, 333};
    const mok_shape shapes[2] = {small_shape(512, 256, 8, 4, 256), small_shape(320, 192, 8, 4, 192)};
    const env_saved saved[3] = {env_save("MOK_CUDA_TMA"), env_save("MOK_CUDA_HANDOFF"),
                                env_save("MOK_CUDA_DIRECT_ROWS")};
    enum { PATHS = 5 };
    static const char *const path_name[PATHS] = {"tma", "cp.async", "tma without the handoff", "tma, rows staged",
                                                 "cp.async, rows staged"};
    for (int si = 0; si < 2; ++si) {
        layer L;
        layer_make(&L, &shapes[si], P, tokens, mok_test_seed() + 11 + si, LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS);
        mok_config cfg = mok_config_default();
        cfg.minibatch_rows = 128;
        cfg.ring_rows = 512;
        cfg.context_rows = 384;
        layer_result res[PATHS];
        memset(res, 0, sizeof res);
        int ok = 1;
        for (int path = 0; path < PATHS && ok; ++path) {
            setenv("MOK_CUDA_TMA", path == 1 || path == 4 ? "0" : "1", 1);
            setenv("MOK_CUDA_HANDOFF", path == 2 ? "0" : "1", 1);
            setenv("MOK_CUDA_DIRECT_ROWS", path >= 3 ? "0" : "1", 1);
            gpu_layer G;
            if (gpu_open(&G, &L, &cfg) != MOK_OK) {
                CHECK(0, "shape %d open: %s", si, G.message);
                ok = 0;
                break;
            }
            if (gpu_forward(&G, &L, 0) != MOK_OK || gpu_layer_backward(&G, &L, 0, NULL, &res[path]) != MOK_OK) {
                CHECK(0, "shape %d %s: %s", si, path_name[path], G.message);
                ok = 0;
            } else {
                gpu_layer_download_y(&G, &L, &res[path]);
            }
            gpu_layer_close(&G);
        }
        for (int path = 1; path < PATHS && ok; ++path) {
            char what[256] = "";
            CHECK(layer_equal(&L, &res[0], &res[path], what, sizeof what), "shape %d: tma vs %s: %s", si,
                  path_name[path], what);
        }
        for (int path = 0; path < PATHS; ++path) layer_result_free(&res[path]);
        layer_free(&L);
    }
    for (int i = 0; i < 3; ++i) env_restore(&saved[i]);
}

/* The tasks' column widths (cuda/tuning.h: 256, 128 or 64, capped by MOK_CUDA_COLS_H and
 * MOK_CUDA_COLS_DH): forward and backward under each cap against the reference, on a shape
 * where down and dx take every width and dh 128 and 64 (256 needs I >= 2048). Not bitwise
 * across widths: the router weights' gradient sums one partial per dh task. */
MOK_TEST(cuda_task_cols) {
    if (skip(1, "cuda_task_cols")) return;
    int P = gpus() >= 2 ? 2 : 1;
    int64_t tokens[2] = {500, 300};
    /* down and dx at 256, 128, 64; dh at 256 (I >= 2048), 128, 64 */
    const mok_shape shapes[2] = {small_shape(512, 256, 8, 4, 256), small_shape(256, 2048, 4, 2, 0)};
    const char *caps[3] = {"256", "128", "64"};
    const env_saved saved[2] = {env_save("MOK_CUDA_COLS_H"), env_save("MOK_CUDA_COLS_DH")};
    mok_config cfg = mok_config_default();
    cfg.minibatch_rows = 128;
    cfg.ring_rows = 256;
    cfg.context_rows = 256;
    for (int si = 0; si < 2; ++si)
        for (int c = 0; c < 3; ++c) {
            setenv("MOK_CUDA_COLS_H", caps[c], 1);
            setenv("MOK_CUDA_COLS_DH", caps[si == 0 ? 2 - c : c], 1);
            char tag[64];
            snprintf(tag, sizeof tag, "shape %d, cols H<=%s dh<=%s", si, caps[c], caps[si == 0 ? 2 - c : c]);
            check_backward(tag, &shapes[si], P, tokens, LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS, 0.0f, &cfg, 0);
        }
    env_restore(&saved[0]);
    env_restore(&saved[1]);
}

/* A knob of the workspace's tuning (mok_workspace_tuning's "name=value" pairs), or -1. */
static int tuning_value(const mok_workspace *ws, const char *name) {
    char text[512];
    if (mok_workspace_tuning(ws, text, sizeof text) != MOK_OK) return -1;
    const size_t n = strlen(name);
    for (const char *p = text; *p;) {
        if (strncmp(p, name, n) == 0 && p[n] == '=') return atoi(p + n + 1);
        p = strchr(p, ' ');
        if (!p) break;
        ++p;
    }
    return -1;
}

/* The task list built inside the megakernel while its first tasks run (MOK_CUDA_STREAM_SPANS=1,
 * megakernel/task_list.cuh) is the list spans_kernel builds before it: y and every gradient
 * bitwise equal, forward and backward, with several macrobatches, replayed rows, uneven tokens and
 * the shared expert, and on two GPUs also with every transfer turned around (lists that name
 * peers, built from the peers' padded rows). Each run twice, so a list read before it was
 * published would show as a run that differs from its twin. */
MOK_TEST(cuda_stream_spans) {
    if (skip(1, "cuda_stream_spans")) return;
    const int P = gpus() >= 2 ? 2 : 1;
    int64_t tokens[2] = {600, 333};
    const mok_shape shape = small_shape(512, 256, 8, 4, 256);
    const env_saved saved = env_save("MOK_CUDA_STREAM_SPANS");
    layer L;
    layer_make(&L, &shape, P, tokens, mok_test_seed() + 41, LAYER_ROUTE_SKEWED | LAYER_SIGNED_WEIGHTS);
    for (int turned = 0; turned < (P == 2 ? 2 : 1); ++turned) {
        mok_config cfg = mok_config_default();
        cfg.minibatch_rows = 128;
        cfg.ring_rows = 512;
        cfg.context_rows = 384;
        if (turned) {
            cfg.fwd_dispatch = cfg.bwd_combine = MOK_PUSH;
            cfg.fwd_combine = cfg.bwd_dispatch = MOK_PULL;
        }
        layer_result res[4] = {{0}, {0}, {0}, {0}}; /* spans_kernel's list twice, the streamed one twice */
        int ok = 1;
        for (int run = 0; run < 4 && ok; ++run) {
            setenv("MOK_CUDA_STREAM_SPANS", run < 2 ? "0" : "1", 1);
            gpu_layer G;
            if (gpu_open(&G, &L, &cfg) != MOK_OK) {
                CHECK(0, "open: %s", G.message);
                ok = 0;
                break;
            }
            const int streamed = tuning_value(G.ws, "stream_spans");
            CHECK(streamed == (run >= 2), "run %d: the workspace's stream_spans is %d", run, streamed);
            if (gpu_forward(&G, &L, 0) != MOK_OK || gpu_layer_backward(&G, &L, 0, NULL, &res[run]) != MOK_OK) {
                CHECK(0, "%s, run %d: %s", turned ? "turned" : "default", run, G.message);
                ok = 0;
            } else {
                gpu_layer_download_y(&G, &L, &res[run]);
            }
            gpu_layer_close(&G);
        }
        for (int run = 1; run < 4 && ok; ++run) {
            char what[256] = "";
            CHECK(layer_equal(&L, &res[0], &res[run], what, sizeof what), "%s transfers: run %d (%s) against run 0: %s",
                  turned ? "turned" : "default", run, run < 2 ? "spans_kernel" : "streamed", what);
        }
        for (int run = 0; run < 4; ++run) layer_result_free(&res[run]);
    }
    layer_free(&L);
    env_restore(&saved);
}

/* With config.trace, the kernels record every task; the trace file lists them. */
MOK_TEST(cuda_trace) {
    if (skip(1, "cuda_trace")) return;
    int64_t tokens[1] = {600};
    mok_shape s = small_shape(256, 128, 8, 4, 128);
    layer L;
    layer_make(&L, &s, 1, tokens, mok_test_seed() + 21, LAYER_ROUTE_UNIFORM);
    mok_config cfg = mok_config_default();
    cfg.trace = 1;
    gpu_layer G;
    if (gpu_open(&G, &L, &cfg) != MOK_OK) {
        CHECK(0, "open: %s", G.message);
        layer_free(&L);
        return;
    }
    CHECK(gpu_forward(&G, &L, 0) == MOK_OK, "forward: %s", G.message);
    const char *path = "build/cuda_trace_test.json";
    CHECK(mok_trace_write(G.ws, path) == MOK_OK, "trace: %s", mok_last_error());
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "no trace file");
    if (f) {
        char line[512];
        int dispatch = 0, gateup = 0, down = 0, combine = 0, shared = 0, resident = 0;
        while (fgets(line, sizeof line, f)) {
            resident += strstr(line, "\"resident\"") != NULL;
            dispatch += strstr(line, "\"dispatch\"") != NULL;
            gateup += strstr(line, "\"gateup\"") != NULL;
            down += strstr(line, "\"down\"") != NULL;
            combine += strstr(line, "\"combine\"") != NULL;
            shared += strstr(line, "\"shared_up\"") != NULL;
        }
        fclose(f);
        mok_schedule_info info;
        mok_schedule_read(G.ws, G.schedule[0], 0, &info);
        int64_t tiles = info.padded_rows / MOK_ROW_TILE;
        /* one rank: the down tiles write the outputs in place, and the list has no combine (mok__plan_in_place) */
        CHECK(dispatch == tiles && combine == 0, "dispatch %d, combine %d events for %lld row tiles", dispatch,
              combine, (long long)tiles);
        /* one event per task: a task covers the columns the workspace's tuning gives */
        const int cols_gateup = tuning_value(G.ws, "cols_gateup"), cols_h = tuning_value(G.ws, "cols_h");
        CHECK(cols_gateup > 0 && cols_h > 0, "tuning: cols_gateup %d, cols_h %d", cols_gateup, cols_h);
        const int gu_tasks = cols_gateup > 0 ? (int)(s.intermediate / cols_gateup) : 0;
        const int h_tasks = cols_h > 0 ? (int)(s.hidden / cols_h) : 0;
        CHECK(gateup == tiles * gu_tasks && down == tiles * h_tasks, "gateup %d, down %d events for %lld row tiles",
              gateup, down, (long long)tiles);
        CHECK(cols_gateup > 0 && shared == 5 * (int)(s.shared_intermediate / cols_gateup),
              "shared_up %d events for 5 token tiles", shared);
#ifdef MOK_HAVE_CUDA
        int sms = 0, device = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        CHECK(resident == sms, "%d residency events for a kernel on %d SMs", resident, sms);
#endif
    }
    gpu_layer_close(&G);
    layer_free(&L);
}

/* The API's argument rules on a cuda workspace: the same messages as on cpu, and the workspace
 * keeps working after each refusal. */
/* The cuda backend runs the default transfer directions only: each flipped one is refused at
 * workspace creation, with a message that names it (the cpu backend runs them all). */
/* Forward + backward of config on cuda into *out; with ctx_equal set, also whether a recompute
 * pass gives back the context of the forward bit for bit. */
static mok_status turned_run(const layer *L, const mok_config *cfg, int reps, layer_result *out, int *ctx_equal,
                             char *message, size_t size) {
    gpu_layer G;
    mok_status st = gpu_open(&G, L, cfg);
    for (int r = 0; r < reps && st == MOK_OK; ++r) {
        layer_result got = {0};
        st = gpu_forward(&G, L, 0);
        if (st == MOK_OK) {
            gpu_layer_download_y(&G, L, &got);
            st = gpu_layer_backward(&G, L, 0, NULL, &got);
        }
        if (st == MOK_OK && r == 0) {
            *out = got;
            continue;
        }
        if (st == MOK_OK && !layer_equal(L, out, &got, message, size)) st = MOK_ERR_INTERNAL;
        layer_result_free(&got);
    }
    if (st == MOK_OK && ctx_equal) {
        /* the context of a forward and of a recompute pass, each over a poisoned buffer */
        const size_t bytes = G.sizes.context_bytes;
        char *ctx[2] = {malloc(bytes * L->nranks), malloc(bytes * L->nranks)}, *ff = malloc(bytes);
        memset(ff, 0xff, bytes);
        for (int pass = 0; pass < 2 && st == MOK_OK; ++pass) {
            for (int p = 0; p < L->nranks; ++p) mok_memory_copy(G.group, p, G.context[p], ff, bytes, MOK_COPY_HOST_TO_RANK);
            st = gpu_forward(&G, L, pass);
            for (int p = 0; p < L->nranks && st == MOK_OK; ++p)
                mok_memory_copy(G.group, p, ctx[pass] + bytes * p, G.context[p], bytes, MOK_COPY_RANK_TO_HOST);
        }
        *ctx_equal = st == MOK_OK;
        for (int p = 0; p < L->nranks && *ctx_equal; ++p)
            *ctx_equal = contexts_equal(ctx[0] + bytes * p, ctx[1] + bytes * p, bytes);
        free(ctx[0]);
        free(ctx[1]);
        free(ff);
    }
    if (st != MOK_OK && !message[0]) snprintf(message, size, "%s", G.message);
    gpu_layer_close(&G);
    return st;
}

/* The transfer directions (docs/design.md §2.4a): every output and gradient of each turned
 * combination bitwise equal to the defaults' (the same sums in the same order, whoever moves the
 * rows), on 1 GPU and on 2 (uneven tokens, then a rank with none; skewed routing with -1 slots
 * and weights <= 0), in one macrobatch and in several with replay; the fully turned one against
 * the reference, twice in one workspace, and its recompute pass gives the forward's context. */
MOK_TEST(cuda_turned_transfers) {
    if (skip(1, "cuda_turned_transfers")) return;
    const mok_shape s = small_shape(256, 128, 8, 4, 128);
    for (int P = 1; P <= 2 && P <= gpus(); ++P)
        for (int c = 0; c < 2; ++c) {
            int64_t tokens[2] = {P == 1 ? 300 : c ? 0 : 211, 417};
            mok_config base = mok_config_default();
            base.fwd_comm_sms = base.bwd_comm_sms = 4;
            if (c) {
                base.minibatch_rows = 128;
                base.ring_rows = 256;
                base.context_rows = 256;
            }
            char tag[96];
            snprintf(tag, sizeof tag, "P = %d, T = %lld/%lld, %s", P, (long long)tokens[0],
                     (long long)(P > 1 ? tokens[1] : 0), c ? "macrobatches with replay" : "one macrobatch");
            layer L;
            if (layer_make(&L, &s, P, tokens, mok_test_seed() ^ (uint64_t)(P * 2 + c) ^ 0x7a,
                           LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS) != 0) {
                CHECK(0, "%s: layer_make failed", tag);
                continue;
            }
            layer_result want = {0};
            char msg[1024] = "";
            mok_status st = turned_run(&L, &base, 1, &want, NULL, msg, sizeof msg);
            CHECK(st == MOK_OK, "%s: defaults: %s", tag, msg);
            for (int t = 0; t < 4 && st == MOK_OK; ++t) {
                mok_config cfg = base; /* 0: all turned, 1: the pushes, 2: the pulls, 3: forward only */
                if (t != 2) cfg.fwd_dispatch = MOK_PUSH;
                if (t != 1) cfg.fwd_combine = MOK_PULL;
                if (t < 2) cfg.bwd_combine = MOK_PUSH;
                if (t == 0 || t == 2) cfg.bwd_dispatch = MOK_PULL;
                layer_result got = {0};
                int ctx_equal = 0;
                msg[0] = 0;
                mok_status ts = turned_run(&L, &cfg, t == 0 ? 2 : 1, &got, t == 0 ? &ctx_equal : NULL, msg, sizeof msg);
                CHECK(ts == MOK_OK, "%s: turned %d: %s", tag, t, msg);
                if (ts != MOK_OK) continue;
                char what[256] = "";
                CHECK(layer_equal(&L, &want, &got, what, sizeof what), "%s: turned %d differs from the defaults: %s",
                      tag, t, what);
                if (t == 0) {
                    CHECK(ctx_equal, "%s: the recompute pass's context differs from the forward's", tag);
                    layer_result ref = {0};
                    layer_run_reference(&L, &ref);
                    double err = layer_compare(&L, &got, &ref, tag);
                    CHECK(err <= 1.0, "%s: turned vs reference error %.3f", tag, err);
                    layer_result_free(&ref);
                }
                layer_result_free(&got);
            }
            layer_result_free(&want);
            layer_free(&L);
        }
}

MOK_TEST(cuda_bad_inputs) {
    if (skip(1, "cuda_bad_inputs")) return;
    int64_t tokens[1] = {100};
    mok_shape s = small_shape(128, 64, 4, 2, 64);
    layer L;
    layer_make(&L, &s, 1, tokens, 9, LAYER_ROUTE_UNIFORM);
    gpu_layer G;
    if (gpu_open(&G, &L, NULL) != MOK_OK) {
        CHECK(0, "open: %s", G.message);
        layer_free(&L);
        return;
    }
    mok_schedule_args sa = {101, G.ids[0], G.schedule[0], NULL};
    CHECK(mok_schedule_build(G.ws, &sa) == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "num_tokens"),
          "T > T_max: %s", mok_last_error());
    sa = (mok_schedule_args){100, (const int32_t *)((const char *)G.ids[0] + 4), G.schedule[0], NULL};
    CHECK(mok_schedule_build(G.ws, &sa) == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "aligned"),
          "misaligned ids: %s", mok_last_error());
    CHECK(gpu_forward(&G, &L, 0) == MOK_OK, "good run: %s", G.message);
    mok_forward_args fa = {100, G.schedule[0], NULL, G.rw[0], G.w[0][0], G.w[1][0], G.w[2][0], G.s[0][0],
                           G.s[1][0], G.s[2][0], G.y[0], G.context[0], NULL, NULL};
    CHECK(mok_forward(G.ws, &fa) == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "x"), "NULL x: %s",
          mok_last_error());
    fa.x = G.x[0];
    fa.s_gate = NULL;
    CHECK(mok_forward(G.ws, &fa) == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "s_gate"),
          "missing shared weight: %s", mok_last_error());
    fa.s_gate = G.s[0][0];
    fa.num_tokens = 99; /* differs from the schedule's: found on the device, reported, then recoverable */
    mok_status st = mok_forward(G.ws, &fa);
    if (st == MOK_OK) st = mok_synchronize(G.ws);
    CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "schedule"), "T differs: %s %s",
          mok_status_string(st), mok_last_error());
    CHECK(mok_trace_write(G.ws, "build/x.json") == MOK_ERR_INVALID_ARGUMENT, "trace off: %s", mok_last_error());
    CHECK(gpu_forward(&G, &L, 0) == MOK_OK, "good run after the refusals: %s", G.message);
    gpu_layer_close(&G);
    layer_free(&L);
}

/* ---- the per-rank protocol on GPUs ----------------------------------------------------------
 * As test_protocol.c on the cpu backend, with one thread per rank, each holding its own group
 * handle (mok_group_create, device = rank): ranks put out of step on purpose fail alike (the device
 * barrier carries each call to the peers, and the error word reports it at the next call or
 * mok_synchronize), configs that differ are refused at creation on every rank, and after a
 * timeout a rank keeps its window so that a late peer's kernels write into live memory. */
#include <pthread.h>

enum { G_END = 0, G_CREATE, G_SCHEDULE, G_FORWARD, G_BACKWARD, G_SYNC, G_DESTROY, G_MEET };

typedef struct gpu_rank_run {
    const layer *L;
    int rank, P;
    const mok_unique_id *id;
    mok_config config;
    const int (*script)[2];
    pthread_barrier_t *meet;
    mok_group *group;
    mok_workspace *ws;
    mok_sizes sizes;
    void *x, *ids, *rw, *dy, *dx, *drw, *y, *context, *schedule[2], *w[3], *s[3], *dw[3], *ds[3];
    mok_status status[16];
    char message[16][512];
} gpu_rank_run;

static void *rank_upload(gpu_rank_run *r, const void *host, size_t bytes, mok_status *st) {
    void *d = NULL;
    if (*st != MOK_OK) return NULL;
    *st = mok_memory_alloc(r->group, 0, bytes, &d);
    if (*st == MOK_OK && host && bytes) *st = mok_memory_copy(r->group, 0, d, host, bytes, MOK_COPY_HOST_TO_RANK);
    return d;
}

static mok_status rank_buffers(gpu_rank_run *r) {
    const layer *L = r->L;
    const int p = r->rank;
    const size_t H = (size_t)L->shape.hidden, I = (size_t)L->shape.intermediate, k = (size_t)L->shape.topk;
    const size_t Is = (size_t)L->shape.shared_intermediate, El = (size_t)(L->shape.num_experts / L->nranks);
    const size_t T = (size_t)L->num_tokens[p];
    mok_status st = mok_workspace_sizes(r->ws, &r->sizes);
    r->x = rank_upload(r, L->x[p], T * H * 2 + 16, &st);
    r->ids = rank_upload(r, L->topk_ids[p], T * k * 4 + 16, &st);
    r->rw = rank_upload(r, L->router_w[p], T * k * 4 + 16, &st);
    r->dy = rank_upload(r, L->dy[p], T * H * 2 + 16, &st);
    r->dx = rank_upload(r, NULL, T * H * 2 + 16, &st);
    r->drw = rank_upload(r, NULL, T * k * 4 + 16, &st);
    r->y = rank_upload(r, NULL, T * H * 2 + 16, &st);
    r->context = rank_upload(r, NULL, r->sizes.context_bytes, &st);
    for (int b = 0; b < 2; ++b) r->schedule[b] = rank_upload(r, NULL, r->sizes.schedule_bytes, &st);
    for (int m = 0; m < 3; ++m) {
        r->w[m] = rank_upload(r, L->w[m][p], El * I * H * 2, &st);
        r->dw[m] = rank_upload(r, NULL, El * I * H * 2, &st);
        r->s[m] = Is ? rank_upload(r, L->s[m], Is * H * 2, &st) : NULL;
        r->ds[m] = Is ? rank_upload(r, NULL, Is * H * 2, &st) : NULL;
    }
    return st;
}

static void rank_free_buffers(gpu_rank_run *r) {
    void *all[] = {r->x, r->ids, r->rw, r->dy, r->dx, r->drw, r->y, r->context, r->schedule[0], r->schedule[1],
                   r->w[0], r->w[1], r->w[2], r->s[0], r->s[1], r->s[2], r->dw[0], r->dw[1], r->dw[2],
                   r->ds[0], r->ds[1], r->ds[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) mok_memory_free(r->group, 0, all[i]);
}

static mok_status rank_op(gpu_rank_run *r, int op, int arg) {
    const layer *L = r->L;
    const int64_t T = L->num_tokens[r->rank];
    switch (op) {
    case G_CREATE: {
        mok_status st = mok_workspace_create(&r->ws, r->group, &L->shape, &r->config);
        return st == MOK_OK ? rank_buffers(r) : st;
    }
    case G_SCHEDULE: {
        mok_schedule_args a = {T, r->ids, r->schedule[arg], NULL};
        return mok_schedule_build(r->ws, &a);
    }
    case G_FORWARD: {
        mok_forward_args a = {T, r->schedule[arg], r->x, r->rw, r->w[0], r->w[1], r->w[2], r->s[0], r->s[1], r->s[2],
                              r->y, r->context, NULL, NULL};
        return mok_forward(r->ws, &a);
    }
    case G_BACKWARD: {
        mok_backward_args a = {T, r->schedule[arg], r->context, r->dy, r->x, r->rw, r->w[0], r->w[1], r->w[2],
                               r->s[0], r->s[1], r->s[2], r->dx, r->drw, 0, r->dw[0], r->dw[1], r->dw[2],
                               r->ds[0], r->ds[1], r->ds[2], NULL, NULL};
        return mok_backward(r->ws, &a);
    }
    case G_SYNC: return mok_synchronize(r->ws);
    case G_DESTROY: {
        rank_free_buffers(r);
        mok_status st = mok_workspace_destroy(r->ws);
        r->ws = NULL;
        return st;
    }
    case G_MEET: pthread_barrier_wait(r->meet); return MOK_OK;
    }
    return MOK_OK;
}

static void *gpu_rank_main(void *arg) {
    gpu_rank_run *r = arg;
    for (int i = 0; i < 16; ++i) r->status[i] = (mok_status)-1;
    mok_status st = mok_group_create(&r->group, MOK_BACKEND_CUDA, r->P, r->rank, r->id, r->rank, &r->config);
    r->status[0] = st;
    snprintf(r->message[0], sizeof r->message[0], "%s", st == MOK_OK ? "" : mok_last_error());
    for (int i = 0; st == MOK_OK && r->script[i][0] != G_END && i < 15; ++i) {
        if (r->script[i][0] != G_MEET && r->script[i][0] != G_CREATE && !r->ws) continue;
        mok_status s = rank_op(r, r->script[i][0], r->script[i][1]);
        r->status[i + 1] = s;
        snprintf(r->message[i + 1], sizeof r->message[i + 1], "%s", s == MOK_OK ? "" : mok_last_error());
    }
    if (r->ws) {
        rank_free_buffers(r);
        mok_workspace_destroy(r->ws);
    }
    if (r->group) mok_group_destroy(r->group);
    return NULL;
}

/* Runs the scripts of ranks 0 and 1 (step i's result in status[i + 1]; status[0]: the group). */
static void gpu_ranks(gpu_rank_run *r, const layer *L, const mok_config *c0, const mok_config *c1,
                      const int (*s0)[2], const int (*s1)[2]) {
    static mok_unique_id id;
    CHECK(mok_unique_id_create(MOK_BACKEND_CUDA, &id) == MOK_OK, "unique id: %s", mok_last_error());
    pthread_barrier_t meet;
    pthread_barrier_init(&meet, NULL, 2);
    pthread_t t[2];
    for (int p = 0; p < 2; ++p) {
        memset(&r[p], 0, sizeof r[p]);
        r[p] = (gpu_rank_run){.L = L, .rank = p, .P = 2, .id = &id, .config = p ? *c1 : *c0, .script = p ? s1 : s0,
                              .meet = &meet};
        pthread_create(&t[p], NULL, gpu_rank_main, &r[p]);
    }
    for (int p = 0; p < 2; ++p) pthread_join(t[p], NULL);
    pthread_barrier_destroy(&meet);
}

static int gpu_rank_layer(layer *L) {
    const int64_t T[2] = {200, 137};
    mok_shape s = small_shape(256, 128, 8, 2, 128);
    return layer_make(L, &s, 2, T, mok_test_seed() ^ 0x70c0, LAYER_ROUTE_HOLES) == 0;
}

static void expect_step(const gpu_rank_run *r, int step, mok_status want, const char *needle, int line) {
    const int ok = r->status[step] == want && (!needle || strstr(r->message[step], needle));
    if (!ok)
        mok_test_fail(__FILE__, line, "rank %d step %d: status %d (%s), want %d; message '%s' (want '%s')", r->rank, step,
                      (int)r->status[step], mok_status_string(r->status[step]), (int)want, r->message[step],
                      needle ? needle : "");
}
#define EXPECT_STEP(r, step, want, needle) expect_step(&(r), (step), (want), (needle), __LINE__)

/* Workspaces whose configs differ in a field of the protocol: refused on both ranks, naming it. */
MOK_TEST(cuda_protocol_configs_differ_ep2) {
    if (skip(2, "cuda_protocol_configs_differ_ep2")) return;
    layer L;
    if (!gpu_rank_layer(&L)) return;
    mok_config c0 = mok_config_default(), c1 = c0;
    c0.peer_timeout_ms = c1.peer_timeout_ms = 10000;
    c1.ring_rows = 2 * c0.ring_rows;
    const int script[][2] = {{G_CREATE, 0}, {G_END, 0}};
    gpu_rank_run r[2];
    gpu_ranks(r, &L, &c0, &c1, script, script);
    for (int p = 0; p < 2; ++p) {
        EXPECT_STEP(r[p], 0, MOK_OK, NULL);
        EXPECT_STEP(r[p], 1, MOK_ERR_INVALID_ARGUMENT, "config.ring_rows");
    }
    /* equal configs: a pass runs */
    const int good[][2] = {{G_CREATE, 0}, {G_SCHEDULE, 0}, {G_FORWARD, 0}, {G_SYNC, 0}, {G_END, 0}};
    gpu_ranks(r, &L, &c0, &c0, good, good);
    for (int p = 0; p < 2; ++p)
        for (int i = 1; i <= 4; ++i) EXPECT_STEP(r[p], i, MOK_OK, NULL);
    layer_free(&L);
}

/* Rank 0 runs a forward where rank 1 runs the backward, then schedule builds that differ: each
 * is reported on both ranks, neither pass runs, and matching calls work again afterwards. */
MOK_TEST(cuda_protocol_calls_differ_ep2) {
    if (skip(2, "cuda_protocol_calls_differ_ep2")) return;
    layer L;
    if (!gpu_rank_layer(&L)) return;
    mok_config c = mok_config_default();
    c.peer_timeout_ms = 10000;
    const int s0[][2] = {{G_CREATE, 0},  {G_SCHEDULE, 0}, {G_SCHEDULE, 1}, {G_FORWARD, 0}, {G_SYNC, 0},
                         {G_FORWARD, 0}, {G_SYNC, 0},     {G_FORWARD, 0},  {G_SYNC, 0},    {G_FORWARD, 1},
                         {G_BACKWARD, 1}, {G_SYNC, 0},    {G_END, 0}};
    const int s1[][2] = {{G_CREATE, 0},  {G_SCHEDULE, 0}, {G_SCHEDULE, 1}, {G_FORWARD, 0}, {G_SYNC, 0},
                         {G_BACKWARD, 0}, {G_SYNC, 0},    {G_FORWARD, 1},  {G_SYNC, 0},    {G_FORWARD, 1},
                         {G_BACKWARD, 1}, {G_SYNC, 0},    {G_END, 0}};
    gpu_rank_run r[2];
    gpu_ranks(r, &L, &c, &c, s0, s1);
    for (int p = 0; p < 2; ++p) {
        for (int i = 1; i <= 5; ++i) EXPECT_STEP(r[p], i, MOK_OK, NULL);
        /* forward meets backward (step 6: call, 7: its report) */
        const int reported = r[p].status[6] != MOK_OK ? 6 : 7;
        EXPECT_STEP(r[p], reported, MOK_ERR_INVALID_ARGUMENT, p ? "was in mok_forward #4" : "was in mok_backward #4");
        /* schedule builds #2 and #3 (steps 8, 9) */
        const int reported2 = r[p].status[8] != MOK_OK ? 8 : 9;
        EXPECT_STEP(r[p], reported2, MOK_ERR_INVALID_ARGUMENT, "schedule build #");
        for (int i = 10; i <= 12; ++i) EXPECT_STEP(r[p], i, MOK_OK, NULL);
    }
    layer_free(&L);
}

/* Rank 1 misses the forward: rank 0 times out and destroys its workspace, keeping its window;
 * then rank 1's forward writes its barrier into that window and times out too. Neither GPU may
 * fault (memory stays usable on both afterwards). */
MOK_TEST(cuda_protocol_timeout_keeps_window_ep2) {
    if (skip(2, "cuda_protocol_timeout_keeps_window_ep2")) return;
    layer L;
    if (!gpu_rank_layer(&L)) return;
    mok_config c = mok_config_default();
    c.peer_timeout_ms = 2000;
    const int s0[][2] = {{G_CREATE, 0}, {G_SCHEDULE, 0}, {G_FORWARD, 0}, {G_SYNC, 0},
                         {G_DESTROY, 0}, {G_MEET, 0}, {G_MEET, 0}, {G_END, 0}};
    const int s1[][2] = {{G_CREATE, 0}, {G_SCHEDULE, 0}, {G_MEET, 0}, {G_FORWARD, 0}, {G_SYNC, 0},
                         {G_MEET, 0}, {G_DESTROY, 0}, {G_END, 0}};
    gpu_rank_run r[2];
    gpu_ranks(r, &L, &c, &c, s0, s1);
    EXPECT_STEP(r[0], 4, MOK_ERR_TIMEOUT, NULL);
    EXPECT_STEP(r[0], 5, MOK_OK, NULL);
    /* rank 0 reached the forward's opening barrier before it gave up, so rank 1 passes it; rank
       0's closing barrier says it failed: rank 1 reports that instead of a result without rank
       0's rows */
    EXPECT_STEP(r[1], 5, MOK_ERR_INVALID_ARGUMENT, "rank 0's part of mok_forward");
    for (int p = 0; p < 2; ++p) {
        /* the devices are healthy: a fresh group and pass on each */
        int devices[1] = {p};
        mok_group *g = NULL;
        void *ptr = NULL;
        mok_status st = mok_group_create_local(&g, MOK_BACKEND_CUDA, 1, devices, NULL);
        if (st == MOK_OK) st = mok_memory_alloc(g, 0, 1 << 20, &ptr);
        CHECK(st == MOK_OK, "GPU %d after the timeout: %s", p, mok_last_error());
        if (ptr) mok_memory_free(g, 0, ptr);
        mok_group_destroy(g);
    }
    layer_free(&L);
}

/* A second workspace on G's group, of G's shape and config, with schedule and context buffers of
 * its own (the inputs, weights and y stay G's). gpu_second_close releases what it adds, before
 * gpu_layer_close(G). */
static mok_status gpu_second_workspace(const gpu_layer *G, const layer *L, const mok_config *config,
                                       gpu_layer *G2) {
    *G2 = *G;
    G2->ws = NULL;
    const mok_config cfg = gpu_layer_config(L, config);
    mok_status st = mok_workspace_create(&G2->ws, G->group, &L->shape, &cfg);
    for (int p = 0; p < L->nranks; ++p) G2->schedule[p] = G2->context[p] = NULL;
    for (int p = 0; p < L->nranks && st == MOK_OK; ++p) {
        G2->schedule[p] = gpu_layer_upload(G2, p, NULL, G->sizes.schedule_bytes, &st);
        G2->context[p] = gpu_layer_upload(G2, p, NULL, G->sizes.context_bytes, &st);
    }
    if (st != MOK_OK) snprintf(G2->message, sizeof G2->message, "%s", mok_last_error());
    return st;
}

static void gpu_second_close(gpu_layer *G2) {
    for (int p = 0; p < G2->nranks && G2->group; ++p) {
        mok_memory_free(G2->group, p, G2->schedule[p]);
        mok_memory_free(G2->group, p, G2->context[p]);
    }
    mok_workspace_destroy(G2->ws);
    memset(G2, 0, sizeof *G2);
}

/* Every rank's `bytes` of `value` into bufs[p]. */
static void gpu_fill(gpu_layer *G, void *const *bufs, size_t bytes, int value) {
    for (int p = 0; p < G->nranks; ++p) gpu_layer_fill(G, p, bufs[p], bytes, value);
}

/* Fresh device buffers holding copies of src's (every rank's `bytes`). */
static void gpu_copies(gpu_layer *G, void *const *src, size_t bytes, void **out) {
    for (int p = 0; p < G->nranks; ++p) {
        mok_status st = MOK_OK;
        out[p] = gpu_layer_upload(G, p, NULL, bytes, &st);
        if (st == MOK_OK) st = mok_memory_copy(G->group, p, out[p], src[p], bytes, MOK_COPY_RANK_TO_RANK);
        CHECK(st == MOK_OK, "copy of rank %d's buffer: %s", p, mok_last_error());
    }
}

/* A pass the device refused (the error word, reported by mok_synchronize): an argument error
 * naming what was wrong. */
static void expect_refused_on_device(mok_status st, const char *message, const char *what, const char *needle1,
                                     const char *needle2) {
    CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(message, needle1) && (!needle2 || strstr(message, needle2)),
          "%s: status %s, message '%s' (want INVALID_ARGUMENT naming '%s'%s%s)", what, mok_status_string(st), message,
          needle1, needle2 ? " and " : "", needle2 ? needle2 : "");
}

static mok_status gpu_forward_only(gpu_layer *G, const layer *L) {
    mok_status st = gpu_pass(G, L, 0, NULL);
    if (st == MOK_OK) st = mok_synchronize(G->ws);
    if (st != MOK_OK) snprintf(G->message, sizeof G->message, "%s", mok_last_error());
    return st;
}

/* The tags on the cuda backend (core/schedule.h), checked by one device thread of each pass and
 * reported through the error word: a backward with a context no forward wrote, with another
 * rank's, with one of a build older than its schedule's, with another workspace's; passes with
 * another workspace's or rank's schedule; a schedule read as another local rank (host). Copies of
 * a schedule and a context serve to the bit, as do buffers that held another workspace's and
 * took copies of this one's. */
MOK_TEST(cuda_protocol_tags) {
    if (skip(1, "cuda_protocol_tags")) return;
    const int P = gpus() >= 2 ? 2 : 1;
    int64_t tokens[2] = {100, 60};
    mok_shape s = small_shape(128, 64, 4, 2, 64);
    s.max_tokens = 128;
    layer L;
    layer_make(&L, &s, P, tokens, mok_test_seed() ^ 0x1ed9, LAYER_ROUTE_HOLES);
    gpu_layer G, G2;
    memset(&G2, 0, sizeof G2);
    mok_status st = gpu_open(&G, &L, NULL);
    if (st == MOK_OK) st = gpu_second_workspace(&G, &L, NULL, &G2);
    CHECK(st == MOK_OK, "open: %s %s", G.message, G2.message);
    if (st == MOK_OK) {
        const size_t sbytes = G.sizes.schedule_bytes, cbytes = G.sizes.context_bytes;
        layer_result want = {0}, want2 = {0}, got = {0};
        char diff[256] = "";

        /* a context no forward wrote */
        gpu_fill(&G, G.context, cbytes, 0xff);
        CHECK(gpu_layer_build(&G, &L, NULL) == MOK_OK, "build: %s", mok_last_error());
        st = gpu_layer_backward(&G, &L, 0, NULL, &got);
        expect_refused_on_device(st, G.message, "backward with a context no forward wrote", "args[0].context",
                                 "holds no context tag");
        layer_result_free(&got);

        if (P == 2) {
            mok_schedule_info info;
            st = mok_schedule_read(G.ws, G.schedule[0], 1, &info);
            CHECK(st == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "built for rank 0"),
                  "rank 0's schedule read as local rank 1: %s", mok_last_error());
            /* the ranks' schedules swapped */
            void *keep = G.schedule[0];
            G.schedule[0] = G.schedule[1];
            G.schedule[1] = keep;
            st = gpu_forward_only(&G, &L);
            expect_refused_on_device(st, G.message, "forward with the other rank's schedule", "args[0].schedule",
                                     "built for rank 1");
            G.schedule[1] = G.schedule[0];
            G.schedule[0] = keep;
        }

        /* the forward, then its backward */
        CHECK(gpu_forward(&G, &L, 0) == MOK_OK, "forward: %s", G.message);
        st = gpu_layer_backward(&G, &L, 0, NULL, &want);
        CHECK(st == MOK_OK, "backward after its forward: %s", G.message);

        if (P == 2) {
            void *keep = G.context[0];
            G.context[0] = G.context[1];
            G.context[1] = keep;
            st = gpu_layer_backward(&G, &L, 0, NULL, &got);
            expect_refused_on_device(st, G.message, "backward with the other rank's context", "args[0].context",
                                     "written by rank 1's pass");
            layer_result_free(&got);
            G.context[1] = G.context[0];
            G.context[0] = keep;
        }

        /* copies of the schedules and contexts in fresh buffers, the originals freed: the same bits */
        void *sched_copy[MOK_MAX_RANKS], *ctx_copy[MOK_MAX_RANKS];
        gpu_copies(&G, G.schedule, sbytes, sched_copy);
        gpu_copies(&G, G.context, cbytes, ctx_copy);
        for (int p = 0; p < P; ++p) {
            mok_memory_free(G.group, p, G.schedule[p]);
            mok_memory_free(G.group, p, G.context[p]);
            G.schedule[p] = sched_copy[p];
            G.context[p] = ctx_copy[p];
        }
        st = gpu_layer_backward(&G, &L, 0, NULL, &got);
        CHECK(st == MOK_OK, "backward with copies of the schedules and contexts: %s", G.message);
        if (st == MOK_OK)
            CHECK(layer_equal(&L, &want, &got, diff, sizeof diff), "backward with the copies: %s", diff);
        layer_result_free(&got);

        /* the second workspace's passes on its own buffers */
        CHECK(gpu_forward(&G2, &L, 0) == MOK_OK, "second workspace's forward: %s", G2.message);
        st = gpu_layer_backward(&G2, &L, 0, NULL, &want2);
        CHECK(st == MOK_OK, "second workspace's backward: %s", G2.message);

        /* the other workspace's context, then its schedule */
        void *mine[MOK_MAX_RANKS];
        for (int p = 0; p < P; ++p) {
            mine[p] = G.context[p];
            G.context[p] = G2.context[p];
        }
        st = gpu_layer_backward(&G, &L, 0, NULL, &got);
        expect_refused_on_device(st, G.message, "backward with another workspace's context", "args[0].context",
                                 "workspace #1");
        layer_result_free(&got);
        for (int p = 0; p < P; ++p) {
            G.context[p] = mine[p];
            mine[p] = G.schedule[p];
            G.schedule[p] = G2.schedule[p];
        }
        st = gpu_forward_only(&G, &L);
        expect_refused_on_device(st, G.message, "forward with another workspace's schedule", "args[0].schedule",
                                 "workspace #1");
        for (int p = 0; p < P; ++p) G.schedule[p] = mine[p];

        /* the schedule built again after the forward: its context is of an older build */
        CHECK(gpu_layer_build(&G, &L, NULL) == MOK_OK, "rebuild: %s", mok_last_error());
        st = gpu_layer_backward(&G, &L, 0, NULL, &got);
        expect_refused_on_device(st, G.message, "backward after the schedule was built again", "args[0].context",
                                 ", but args[0].schedule holds build #");
        layer_result_free(&got);

        /* G's buffers, which held G's schedules and contexts, take copies of the second
           workspace's: its backward takes them, to the bit of its own */
        for (int p = 0; p < P; ++p) {
            mok_memory_copy(G.group, p, G.schedule[p], G2.schedule[p], sbytes, MOK_COPY_RANK_TO_RANK);
            mok_memory_copy(G.group, p, G.context[p], G2.context[p], cbytes, MOK_COPY_RANK_TO_RANK);
            mine[p] = G2.schedule[p];
            G2.schedule[p] = G.schedule[p];
            G.schedule[p] = mine[p];
            mine[p] = G2.context[p];
            G2.context[p] = G.context[p];
            G.context[p] = mine[p];
        }
        st = gpu_layer_backward(&G2, &L, 0, NULL, &got);
        CHECK(st == MOK_OK, "second workspace's backward with the buffers that held the first's: %s", G2.message);
        if (st == MOK_OK)
            CHECK(layer_equal(&L, &want2, &got, diff, sizeof diff), "backward with the reused buffers: %s", diff);
        layer_result_free(&got);
        layer_result_free(&want);
        layer_result_free(&want2);
    }
    gpu_second_close(&G2);
    gpu_layer_close(&G);
    layer_free(&L);
}
