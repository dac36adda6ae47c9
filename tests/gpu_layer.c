/* gpu_layer.c — a layer's buffers on the GPUs for the cuda tests (gpu_layer.h). */
#include "gpu_layer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

mok_config gpu_layer_config(const layer *L, const mok_config *config) {
    mok_config cfg = config ? *config : mok_config_default();
    cfg.swiglu_limit = L->swiglu_limit;
    const char *timeout = getenv("MOK_TEST_PEER_TIMEOUT_MS");
    if (timeout) cfg.peer_timeout_ms = atoi(timeout);
    return cfg;
}

mok_status gpu_layer_create(gpu_layer *G, const layer *L, const mok_config *config) {
    memset(G, 0, sizeof *G);
    G->nranks = L->nranks;
    const mok_config cfg = gpu_layer_config(L, config);
    int devices[MOK_MAX_RANKS];
    for (int p = 0; p < L->nranks; ++p) devices[p] = p;
    mok_status st =
        gpu_layer_note(G, mok_group_create_local(&G->group, MOK_BACKEND_CUDA, L->nranks, devices, &cfg), "group");
    if (st == MOK_OK) st = gpu_layer_note(G, mok_workspace_create(&G->ws, G->group, &L->shape, &cfg), "workspace");
    if (st == MOK_OK) st = gpu_layer_note(G, mok_workspace_sizes(G->ws, &G->sizes), "sizes");
    return st;
}

void gpu_layer_upload_rank(gpu_layer *G, const layer *L, int p, size_t pad, mok_status *st) {
    const size_t H = (size_t)L->shape.hidden, I = (size_t)L->shape.intermediate, k = (size_t)L->shape.topk;
    const size_t Is = (size_t)L->shape.shared_intermediate, El = (size_t)(L->shape.num_experts / L->nranks);
    const size_t T = (size_t)L->shape.max_tokens, t = (size_t)L->num_tokens[p];
    G->x[p] = gpu_layer_upload(G, p, L->x[p], t * H * 2 + pad, st);
    G->ids[p] = gpu_layer_upload(G, p, L->topk_ids[p], t * k * 4 + pad, st);
    G->rw[p] = gpu_layer_upload(G, p, L->router_w[p], t * k * 4 + pad, st);
    for (int m = 0; m < 3; ++m) G->w[m][p] = gpu_layer_upload(G, p, L->w[m][p], El * I * H * 2, st);
    for (int m = 0; m < 3 && Is; ++m) G->s[m][p] = gpu_layer_upload(G, p, L->s[m], Is * H * 2, st);
    G->y[p] = gpu_layer_upload(G, p, NULL, T * H * 2, st);
    G->schedule[p] = gpu_layer_upload(G, p, NULL, G->sizes.schedule_bytes, st);
    G->context[p] = gpu_layer_upload(G, p, NULL, G->sizes.context_bytes, st);
}

void gpu_layer_close(gpu_layer *G) {
    for (int p = 0; p < G->nranks && G->group; ++p) {
        void **all[] = {&G->x[p], &G->ids[p], &G->rw[p], &G->w[0][p], &G->w[1][p], &G->w[2][p], &G->s[0][p],
                        &G->s[1][p], &G->s[2][p], &G->y[p], &G->schedule[p], &G->context[p]};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) mok_memory_free(G->group, p, *all[i]);
    }
    mok_workspace_destroy(G->ws);
    mok_group_destroy(G->group);
    memset(G, 0, sizeof *G);
}

mok_status gpu_layer_note(gpu_layer *G, mok_status st, const char *what) {
    if (st != MOK_OK && !G->message[0]) snprintf(G->message, sizeof G->message, "%s: %s", what, mok_last_error());
    return st;
}

void *gpu_layer_upload(gpu_layer *G, int p, const void *host, size_t bytes, mok_status *st) {
    void *d = NULL;
    if (*st != MOK_OK) return NULL;
    *st = mok_memory_alloc(G->group, p, bytes ? bytes : 16, &d);
    if (*st == MOK_OK && host && bytes) *st = mok_memory_copy(G->group, p, d, host, bytes, MOK_COPY_HOST_TO_RANK);
    return d;
}

mok_status gpu_layer_fill(gpu_layer *G, int p, void *dev, size_t bytes, int value) {
    void *host = malloc(bytes ? bytes : 1);
    if (!host) return MOK_ERR_OUT_OF_MEMORY;
    memset(host, value, bytes);
    mok_status st = mok_memory_copy(G->group, p, dev, host, bytes, MOK_COPY_HOST_TO_RANK);
    free(host);
    return st;
}

void *gpu_layer_download(gpu_layer *G, int p, const void *dev, size_t bytes) {
    void *host = malloc(bytes ? bytes : 16);
    if (host && bytes) mok_memory_copy(G->group, p, host, dev, bytes, MOK_COPY_RANK_TO_HOST);
    return host;
}

void gpu_layer_download_y(gpu_layer *G, const layer *L, layer_result *out) {
    out->nranks = L->nranks;
    for (int p = 0; p < L->nranks; ++p)
        out->y[p] = gpu_layer_download(G, p, G->y[p], (size_t)L->num_tokens[p] * (size_t)L->shape.hidden * 2);
}

mok_status gpu_layer_build(gpu_layer *G, const layer *L, void *stream) {
    mok_schedule_args sa[MOK_MAX_RANKS];
    for (int p = 0; p < L->nranks; ++p)
        sa[p] = (mok_schedule_args){L->num_tokens[p], G->ids[p], G->schedule[p], stream};
    return mok_schedule_build(G->ws, sa);
}

void gpu_layer_forward_args(const gpu_layer *G, const layer *L, void *stream, void *const *fp8_weights,
                            mok_forward_args *fa) {
    for (int p = 0; p < L->nranks; ++p)
        fa[p] = (mok_forward_args){L->num_tokens[p], G->schedule[p], G->x[p], G->rw[p], G->w[0][p], G->w[1][p],
                                   G->w[2][p], G->s[0][p], G->s[1][p], G->s[2][p], G->y[p], G->context[p], stream,
                                   fp8_weights ? fp8_weights[p] : NULL};
}
