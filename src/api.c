/* api.c — the public entry points: validate every argument (the message names the argument and
 * the rule), then hand over to the backend the group was created with, through its table of entry
 * points (backend.h). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

mok_status mok__check_ptr(const void *ptr, const char *name, int required) {
    if (!ptr) return required ? mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: must not be NULL", name) : MOK_OK;
    if ((uintptr_t)ptr % MOK_ALIGN != 0)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: pointer %p is not %d-byte aligned", name, ptr, MOK_ALIGN);
    return MOK_OK;
}

#define TRY(expr)                           \
    do {                                    \
        mok_status try_status_ = (expr);    \
        if (try_status_ != MOK_OK) return try_status_; \
    } while (0)

const char *mok_backend_name(mok_backend backend) {
    switch (backend) {
    case MOK_BACKEND_AUTO: return "auto";
    case MOK_BACKEND_CPU: return "cpu";
    case MOK_BACKEND_CUDA: return "cuda";
    }
    return "unknown";
}

/* The backend's entry points (backend.h); NULL for one this build has not. */
static const mok_backend_ops *backend_ops(mok_backend backend) {
    switch (backend) {
    case MOK_BACKEND_CPU: return &mok__cpu_ops;
#ifdef MOK_HAVE_CUDA
    case MOK_BACKEND_CUDA: return &mok__cuda_ops;
#endif
    default: return NULL;
    }
}

int mok_backend_available(mok_backend backend) {
    if (backend == MOK_BACKEND_AUTO) return 1;
    const mok_backend_ops *ops = backend_ops(backend);
    return ops ? ops->device_count() : 0;
}

static mok_status resolve_backend(mok_backend requested, mok_backend *out) {
    if (requested == MOK_BACKEND_AUTO) {
        *out = mok_backend_available(MOK_BACKEND_CUDA) ? MOK_BACKEND_CUDA : MOK_BACKEND_CPU;
        return MOK_OK;
    }
    if (requested == MOK_BACKEND_CPU) {
        *out = requested;
        return MOK_OK;
    }
    if (requested == MOK_BACKEND_CUDA) {
        if (!mok_backend_available(MOK_BACKEND_CUDA))
            return mok__fail(MOK_ERR_UNSUPPORTED,
                             "backend: cuda is not available (this build has no CUDA backend or no GPU is visible)");
        *out = requested;
        return MOK_OK;
    }
    return mok__fail(MOK_ERR_INVALID_ARGUMENT, "backend: %d is not a mok_backend", (int)requested);
}

mok_status mok_unique_id_create(mok_backend backend, mok_unique_id *id) {
    mok__clear_error();
    if (!id) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "id: must not be NULL");
    mok_backend resolved;
    TRY(resolve_backend(backend, &resolved));
    memset(id, 0, sizeof *id);
    return backend_ops(resolved)->unique_id(id);
}

static mok_status group_new(mok_group **out, mok_backend backend, int nranks, const mok_config *config,
                            mok_group **group) {
    if (!out) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "group: output pointer must not be NULL");
    *out = NULL;
    if (nranks < 1 || nranks > MOK_MAX_RANKS)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "nranks: %d is not in [1, %d]", nranks, MOK_MAX_RANKS);
    mok_config cfg = config ? *config : mok_config_default();
    TRY(mok_config_validate(&cfg));
    mok_backend resolved;
    TRY(resolve_backend(backend, &resolved));
    mok_group *g = calloc(1, sizeof *g);
    if (!g) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "group: out of host memory");
    g->backend = resolved;
    g->ops = backend_ops(resolved);
    g->nranks = nranks;
    g->config = cfg;
    *group = g;
    return MOK_OK;
}

static mok_status group_finish(mok_group **out, mok_group *g, int rank, const mok_unique_id *id, const int *devices) {
    mok_status st = g->ops->group_create(g, rank, id, devices);
    if (st != MOK_OK) {
        free(g);
        return st;
    }
    *out = g;
    return MOK_OK;
}

mok_status mok_group_create(mok_group **out, mok_backend backend, int nranks, int rank, const mok_unique_id *id,
                            int device, const mok_config *config) {
    mok__clear_error();
    mok_group *g = NULL;
    TRY(group_new(out, backend, nranks, config, &g));
    if (rank < 0 || rank >= nranks) {
        free(g);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "rank: %d is not in [0, nranks = %d)", rank, nranks);
    }
    if (!id) {
        free(g);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "id: must not be NULL (rank 0 makes it with mok_unique_id_create)");
    }
    if (device < 0) {
        free(g);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "device: %d is negative", device);
    }
    g->num_local_ranks = 1;
    g->first_rank = rank;
    return group_finish(out, g, rank, id, &device);
}

mok_status mok_group_create_local(mok_group **out, mok_backend backend, int nranks, const int *devices,
                                  const mok_config *config) {
    mok__clear_error();
    mok_group *g = NULL;
    TRY(group_new(out, backend, nranks, config, &g));
    if (g->backend == MOK_BACKEND_CUDA && !devices) {
        free(g);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "devices: must list nranks GPU ordinals for the cuda backend");
    }
    g->num_local_ranks = nranks;
    g->first_rank = 0;
    return group_finish(out, g, 0, NULL, devices);
}

mok_status mok_group_destroy(mok_group *g) {
    mok__clear_error();
    if (!g) return MOK_OK;
    if (g->workspaces) {
        int live = 0;
        for (const mok_workspace *w = g->workspaces; w; w = w->next) ++live;
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "group: %d workspace%s made on it %s still alive; destroy %s first (the group is kept)", live,
                         live == 1 ? "" : "s", live == 1 ? "is" : "are", live == 1 ? "it" : "them");
    }
    g->ops->group_destroy(g);
    free(g);
    return MOK_OK;
}

mok_status mok_group_info(const mok_group *g, int *nranks, int *num_local_ranks, int *first_rank,
                          mok_backend *backend) {
    mok__clear_error();
    if (!g) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "group: must not be NULL");
    if (nranks) *nranks = g->nranks;
    if (num_local_ranks) *num_local_ranks = g->num_local_ranks;
    if (first_rank) *first_rank = g->first_rank;
    if (backend) *backend = g->backend;
    return MOK_OK;
}

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* The group's state before a call: usable, or MOK_ERR_STATE after an earlier failure (ours or,
 * where the backend tells, a peer's). */
static mok_status check_group_usable(mok_group *g) {
    if (g->ops->group_check) TRY(g->ops->group_check(g));
    if (g->failed) return mok__fail(MOK_ERR_STATE, "group: unusable after an earlier timeout; destroy it");
    return MOK_OK;
}

/* NOTE: every size of a workspace is a sum of a few products of the shape and config; this bounds
 * them in double precision first, so that the backends' size_t arithmetic cannot wrap (each term
 * below 2^56, their sums below 2^60). The largest: the weight-gradient carry of experts that span
 * macrobatches, the per-(token, slot) buffers, the ring and the context. */
#define MAX_WORKSPACE_BYTES 72057594037927936.0 /* 2^56 */
static mok_status check_workspace_bytes(const mok_shape *s, const mok_config *c, int nranks) {
    const double T = (double)s->max_tokens, H = (double)s->hidden, I = (double)s->intermediate;
    const double Is = (double)s->shared_intermediate, k = (double)s->topk, P = nranks;
    const double El = (double)s->num_experts / P, ring = c->ring_rows;
    const double rows = P * T * k + El * MOK_ROW_TILE; /* mok__sched_max_rows, without its rounding */
    const double context = (c->context_rows > 0 && c->context_rows < rows ? (double)c->context_rows : rows);
    const double terms[] = {
        (rows / ring + 1) * 3 * I * H * 4,            /* carry */
        T * k * H * 2 * 4,                            /* combine and dx buffers */
        ring * (4 * H + 6 * I) * 2 + ring * (I / 64 + 1) * 4, /* rings */
        (context + MOK_ROW_TILE) * 4 * I + T * 4 * Is + MOK_CONTEXT_TAG_BYTES, /* context */
        rows * 8 + T * k * 4 + El * P * 8,            /* schedule */
        (rows / MOK_ROW_TILE + 1) * (H + I + Is) / 64 * 64, /* task list (entries, each < 64 bytes) */
    };
    double total = 0;
    for (size_t i = 0; i < sizeof terms / sizeof terms[0]; ++i) total += terms[i];
    if (!(total < MAX_WORKSPACE_BYTES))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "shape, config: a workspace of this shape and ring_rows would need about %.3g bytes per "
                         "rank, more than 2^56; lower max_tokens, the dimensions or raise ring_rows",
                         total);
    return MOK_OK;
}

mok_status mok_workspace_create(mok_workspace **out, mok_group *g, const mok_shape *shape, const mok_config *config) {
    mok__clear_error();
    if (!out) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: output pointer must not be NULL");
    *out = NULL;
    if (!g) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "group: must not be NULL");
    TRY(check_group_usable(g));
    /* Collective from here: a rank that rejects its arguments still meets its peers' barrier. */
    const int64_t index = g->workspaces_created++;
    mok_config cfg = config ? *config : g->config;
    mok_status st = mok_shape_validate(shape, g->nranks);
    if (st == MOK_OK) st = mok_config_validate(&cfg);
    if (st == MOK_OK) st = check_workspace_bytes(shape, &cfg, g->nranks);
    mok_workspace *ws = NULL;
    if (st == MOK_OK) {
        ws = calloc(1, sizeof *ws);
        if (!ws) st = mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    }
    if (st != MOK_OK) {
        const mok_call call = {MOK_CALL_WORKSPACE_CREATE, 0, index, 0, 0, 0};
        return g->ops->refuse ? g->ops->refuse(g, &call, st) : st;
    }
    ws->group = g;
    ws->ops = g->ops;
    ws->shape = *shape;
    ws->config = cfg;
    ws->index = index;
    ws->digest = mok__protocol_digest(shape, &cfg, g->nranks);
    ws->tag = mok__workspace_tag();
    ws->num_local_experts = shape->num_experts / g->nranks;
    mok__sched_layout(&ws->sched_layout, g->nranks, ws->num_local_experts, shape->topk, shape->max_tokens);
    int64_t max_rows = ws->sched_layout.max_rows;
    ws->context_rows = (cfg.context_rows == 0 || cfg.context_rows > max_rows)
                           ? max_rows
                           : (cfg.context_rows + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
    /* The context: its tag (core/schedule.h says why at the start), the routed rows, the shared
       expert's rows; each part 256-byte aligned. */
    size_t routed = (size_t)ws->context_rows * 2u * (size_t)shape->intermediate * 2u;
    ws->context_routed_offset = MOK_CONTEXT_TAG_BYTES;
    ws->context_shared_offset = align_up(ws->context_routed_offset + routed, 256);
    size_t shared = (size_t)shape->max_tokens * 2u * (size_t)shape->shared_intermediate * 2u;
    ws->sizes.schedule_bytes = ws->sched_layout.bytes;
    ws->sizes.context_bytes = align_up(ws->context_shared_offset + shared, 256);
    ws->sizes.max_routed_rows = max_rows;

    st = ws->ops->workspace_create(ws);
    if (st != MOK_OK) {
        free(ws);
        return st;
    }
    ws->next = g->workspaces;
    g->workspaces = ws;
    *out = ws;
    return MOK_OK;
}

mok_status mok_workspace_destroy(mok_workspace *ws) {
    mok__clear_error();
    if (!ws) return MOK_OK;
    mok_group *g = ws->group;
    for (mok_workspace **link = &g->workspaces; *link; link = &(*link)->next)
        if (*link == ws) {
            *link = ws->next;
            break;
        }
    const mok_status st = ws->ops->workspace_destroy(ws);
    free(ws);
    return st;
}

mok_status mok_workspace_sizes(const mok_workspace *ws, mok_sizes *sizes) {
    mok__clear_error();
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    if (!sizes) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "sizes: must not be NULL");
    *sizes = ws->sizes;
    return MOK_OK;
}

static mok_status check_usable(mok_workspace *ws) {
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    TRY(check_group_usable(ws->group));
    if (ws->failed)
        return mok__fail(MOK_ERR_STATE, "workspace: unusable after an earlier timeout or fault; destroy the group");
    return MOK_OK;
}

/* A collective call begins: its number on the workspace, and what its barriers tell the peers. */
static void begin_call(mok_workspace *ws, mok_call_kind kind) {
    ws->calls += 1;
    ws->call = (mok_call){kind, 0, ws->index, ws->calls, ws->digest, 0};
    for (int r = 0; r < ws->group->num_local_ranks; ++r) ws->call_build[r] = 0;
}

/* A collective call this rank rejects: the backend tells the peers that wait for it (backend.h:
 * refuse), so that they fail at once with a message naming this rank instead of timing out. */
static mok_status reject(mok_workspace *ws, mok_status status) {
    if (!ws->ops->refuse) return status;
    mok_call call = ws->call;
    call.build = ws->call_build[0];
    return ws->ops->refuse(ws->group, &call, status);
}

#define TRY_COLLECTIVE(ws, expr)                              \
    do {                                                      \
        mok_status try_status_ = (expr);                      \
        if (try_status_ != MOK_OK) return reject((ws), try_status_); \
    } while (0)

static mok_status check_tokens(const mok_workspace *ws, int r, int64_t t) {
    if (t < 0 || t > ws->shape.max_tokens)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].num_tokens: %lld is not in [0, max_tokens = %lld]", r,
                         (long long)t, (long long)ws->shape.max_tokens);
    return MOK_OK;
}

#define CHECK_ARG(ptr, required)                                                       \
    do {                                                                               \
        char name_[96];                                                                \
        snprintf(name_, sizeof name_, "args[%d].%s", r, #ptr);                         \
        TRY(mok__check_ptr(a->ptr, name_, (required)));                                \
    } while (0)

#define CHECK_SHARED(ptr)                                                                                     \
    do {                                                                                                      \
        if (has_shared) CHECK_ARG(ptr, 1);                                                                    \
        else if (a->ptr)                                                                                      \
            return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].%s: must be NULL, the layer has no shared expert", \
                             r, #ptr);                                                                        \
    } while (0)

static mok_status check_schedule_args(mok_workspace *ws, const mok_schedule_args *args) {
    for (int r = 0; r < ws->group->num_local_ranks; ++r) {
        const mok_schedule_args *a = &args[r];
        TRY(check_tokens(ws, r, a->num_tokens));
        CHECK_ARG(topk_ids, a->num_tokens > 0);
        CHECK_ARG(schedule, 1);
    }
    return MOK_OK;
}

mok_status mok_schedule_build(mok_workspace *ws, const mok_schedule_args *args) {
    mok__clear_error();
    TRY(check_usable(ws));
    begin_call(ws, MOK_CALL_SCHEDULE_BUILD);
    /* NOTE: a build is named by its call's number, not by a count of builds: every rank counts
       every collective call, so the names stay equal across ranks even after a call that some
       ranks made as a build and others as something else. The backends write it, with the
       workspace's tag, into each schedule's header (mok__sched_tag). */
    const int64_t build = ws->calls;
    for (int r = 0; r < ws->group->num_local_ranks; ++r) ws->call_build[r] = build;
    if (!args) return reject(ws, mok__fail(MOK_ERR_INVALID_ARGUMENT, "args: must not be NULL"));
    TRY_COLLECTIVE(ws, check_schedule_args(ws, args));
    return ws->ops->schedule_build(ws, args);
}

mok_status mok_schedule_read(mok_workspace *ws, const void *schedule, int local_rank, mok_schedule_info *info) {
    mok__clear_error();
    TRY(check_usable(ws));
    TRY(mok__check_ptr(schedule, "schedule", 1));
    if (!info) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "info: must not be NULL");
    if (local_rank < 0 || local_rank >= ws->group->num_local_ranks)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "local_rank: %d is not in [0, %d)", local_rank,
                         ws->group->num_local_ranks);
    mok_sched_header h;
    TRY(ws->ops->schedule_read(ws, schedule, local_rank, &h));
    if (h.magic != MOK_SCHED_MAGIC)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "schedule: not a schedule built by mok_schedule_build");
    const int rank = ws->group->first_rank + local_rank;
    int64_t found = 0, expected = 0;
    const int tag = mok__sched_tag_check(&h, ws->tag, rank, &found, &expected);
    if (tag != MOK_TAG_OK) return mok__tag_refuse(ws, NULL, local_rank, tag, found, expected);
    if (h.nranks != ws->group->nranks || h.num_local_experts != ws->num_local_experts ||
        h.topk != ws->shape.topk || h.max_rows != ws->sched_layout.max_rows)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "schedule: built for rank %d of %d ranks (E_local %d, k %d), not for local rank %d (rank "
                         "%d) of this workspace",
                         h.rank, h.nranks, h.num_local_experts, h.topk, local_rank, rank);
    memset(info, 0, sizeof *info);
    for (int p = 0; p < MOK_MAX_RANKS; ++p) info->num_tokens[p] = h.num_tokens[p];
    info->routed_rows = h.routed_rows;
    info->padded_rows = h.padded_rows;
    info->num_minibatches = (h.padded_rows + ws->config.minibatch_rows - 1) / ws->config.minibatch_rows;
    info->num_macrobatches = (h.padded_rows + ws->config.ring_rows - 1) / ws->config.ring_rows;
    info->max_expert_rows = h.max_expert_rows;
    if (h.error) return mok__fail(MOK_ERR_DEVICE_FAULT, "schedule: the build reported error %d", h.error);
    return MOK_OK;
}

static mok_status check_forward_args(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    int has_shared = ws->shape.shared_intermediate > 0;
    for (int r = 0; r < ws->group->num_local_ranks; ++r) {
        const mok_forward_args *a = &args[r];
        TRY(check_tokens(ws, r, a->num_tokens));
        CHECK_ARG(schedule, 1);
        CHECK_ARG(x, a->num_tokens > 0);
        CHECK_ARG(router_w, a->num_tokens > 0);
        CHECK_ARG(w_gate, 1);
        CHECK_ARG(w_up, 1);
        CHECK_ARG(w_down, !recompute);
        CHECK_SHARED(s_gate);
        CHECK_SHARED(s_up);
        if (!recompute) CHECK_SHARED(s_down);
        CHECK_ARG(y, !recompute && a->num_tokens > 0);
        CHECK_ARG(context, 1);
        TRY(mok__check_fp8_weights(ws, r, a->fp8_weights));
    }
    return MOK_OK;
}

static mok_status forward_common(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    TRY(check_usable(ws));
    begin_call(ws, recompute ? MOK_CALL_RECOMPUTE : MOK_CALL_FORWARD);
    if (!args) return reject(ws, mok__fail(MOK_ERR_INVALID_ARGUMENT, "args: must not be NULL"));
    TRY_COLLECTIVE(ws, check_forward_args(ws, args, recompute));
    /* The schedule's and context's tags are checked by the backend: on the host (cpu) or on the
       device (cuda), which the host does not wait for. */
    return ws->ops->forward(ws, args, recompute);
}

mok_status mok_forward(mok_workspace *ws, const mok_forward_args *args) {
    mok__clear_error();
    return forward_common(ws, args, 0);
}

mok_status mok_recompute_context(mok_workspace *ws, const mok_forward_args *args) {
    mok__clear_error();
    return forward_common(ws, args, 1);
}

static mok_status check_backward_args(mok_workspace *ws, const mok_backward_args *args);

mok_status mok_backward(mok_workspace *ws, const mok_backward_args *args) {
    mok__clear_error();
    TRY(check_usable(ws));
    begin_call(ws, MOK_CALL_BACKWARD);
    if (!args) return reject(ws, mok__fail(MOK_ERR_INVALID_ARGUMENT, "args: must not be NULL"));
    TRY_COLLECTIVE(ws, check_backward_args(ws, args));
    return ws->ops->backward(ws, args);
}

static mok_status check_backward_args(mok_workspace *ws, const mok_backward_args *args) {
    int has_shared = ws->shape.shared_intermediate > 0;
    for (int r = 0; r < ws->group->num_local_ranks; ++r) {
        const mok_backward_args *a = &args[r];
        TRY(check_tokens(ws, r, a->num_tokens));
        CHECK_ARG(schedule, 1);
        CHECK_ARG(context, 1);
        CHECK_ARG(dy, a->num_tokens > 0);
        CHECK_ARG(x, a->num_tokens > 0);
        CHECK_ARG(router_w, a->num_tokens > 0);
        CHECK_ARG(w_gate, 1);
        CHECK_ARG(w_up, 1);
        CHECK_ARG(w_down, 1);
        CHECK_SHARED(s_gate);
        CHECK_SHARED(s_up);
        CHECK_SHARED(s_down);
        CHECK_ARG(dx, a->num_tokens > 0);
        CHECK_ARG(d_router_w, a->num_tokens > 0);
        if (a->accumulate != 0 && a->accumulate != 1)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].accumulate: %d must be 0 or 1", r, a->accumulate);
        CHECK_ARG(dw_gate, 1);
        CHECK_ARG(dw_up, 1);
        CHECK_ARG(dw_down, 1);
        CHECK_SHARED(ds_gate);
        CHECK_SHARED(ds_up);
        CHECK_SHARED(ds_down);
        TRY(mok__check_fp8_weights(ws, r, a->fp8_weights));
    }
    return MOK_OK;
}

mok_status mok_trace_write(mok_workspace *ws, const char *path) {
    mok__clear_error();
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    if (!path) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "path: must not be NULL");
    if (!ws->config.trace) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.trace: tracing was off for this workspace");
    return ws->ops->trace_write(ws, path);
}

static mok_status check_rank(const mok_group *g, int local_rank) {
    if (!g) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "group: must not be NULL");
    if (local_rank < 0 || local_rank >= g->num_local_ranks)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "local_rank: %d is not in [0, %d)", local_rank, g->num_local_ranks);
    return MOK_OK;
}

mok_status mok_memory_alloc(mok_group *g, int local_rank, size_t bytes, void **ptr) {
    mok__clear_error();
    TRY(check_rank(g, local_rank));
    if (!ptr) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "ptr: must not be NULL");
    *ptr = NULL;
    /* Above PTRDIFF_MAX no allocation can exist, and rounding up to the alignment would wrap. */
    if (bytes > (size_t)PTRDIFF_MAX)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "bytes: %zu is more than any allocation can hold (PTRDIFF_MAX)",
                         bytes);
    return g->ops->memory_alloc(g, local_rank, bytes, ptr);
}

mok_status mok_memory_free(mok_group *g, int local_rank, void *ptr) {
    mok__clear_error();
    TRY(check_rank(g, local_rank));
    if (!ptr) return MOK_OK;
    return g->ops->memory_free(g, local_rank, ptr);
}

mok_status mok_memory_copy(mok_group *g, int local_rank, void *dst, const void *src, size_t bytes,
                           mok_copy_kind kind) {
    mok__clear_error();
    TRY(check_rank(g, local_rank));
    if (bytes == 0) return MOK_OK;
    if (!dst || !src) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "dst, src: must not be NULL");
    if (kind != MOK_COPY_HOST_TO_RANK && kind != MOK_COPY_RANK_TO_HOST && kind != MOK_COPY_RANK_TO_RANK)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "kind: %d is not a mok_copy_kind", (int)kind);
    return g->ops->memory_copy(g, local_rank, dst, src, bytes, kind);
}

mok_status mok_synchronize(mok_workspace *ws) {
    mok__clear_error();
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    return ws->ops->synchronize(ws);
}
