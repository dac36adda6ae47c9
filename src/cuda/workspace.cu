/* workspace.cu — the cuda backend's workspace: every rank's memory, allocated once when the
 * workspace is created (the rings, the shared expert's buffers, the counters, the barrier epoch,
 * the task list, the schedule build's scratch, the weight-gradient carry, the trace; the
 * symmetric region through symmetric.cu, the error word through error_word.cu) with its tuning
 * resolved (tuning.h); and the calls that serve a workspace's caller: memory, synchronize, trace. */
#include <string.h>

#include <nccl_device.h> /* ncclTeamLsa */

#include "cuda/backend.cuh"
#include "cuda/sm90/tma.cuh"

static void rank_release(cuda_rank *R) {
    cudaFree(R->peers);
    if (!R->in_window) {
        cudaFree(R->ring_x);
        cudaFree(R->ring_y);
        cudaFree(R->counters);
        cudaFree(R->ring_dy);
        cudaFree(R->ring_dyw);
        cudaFree(R->ring_w);
        cudaFree(R->ring_rdot);
    }
    R->in_window = 0;
    cudaFree(R->ring_h);
    cudaFree(R->sh_h);
    cudaFree(R->sh_out);
    cudaFree(R->ring_gu);
    cudaFree(R->ring_dgu);
    cudaFree(R->sh_dgu);
    cudaFree(R->sh_gq);
    R->sh_gq = NULL;
    cudaFree(R->carry);
    cudaFree(R->trace);
    cudaFree(R->trace_count);
    R->trace = NULL;
    R->trace_count = NULL;
    R->ring_dy = R->ring_dyw = R->ring_gu = R->ring_dgu = R->sh_dgu = NULL;
    R->ring_w = R->ring_rdot = R->carry = NULL;
    cudaFree(R->epoch);
    cudaFree(R->sched_mem);
    R->sched_mem = NULL;
    memset(&R->sched, 0, sizeof R->sched);
    cudaFree(R->spans);
    cudaFree(R->spans_published);
    cudaFree(R->comm_dev);
    R->comm_dev = NULL;
    R->spans = NULL;
    R->spans_published = NULL;
    mok__cuda_error_word_release(R);
    R->peers = NULL;
    R->ring_x = R->ring_h = R->ring_y = R->sh_h = R->sh_out = NULL;
    R->counters = R->epoch = NULL;
}

#define ALLOC(ptr, bytes)                                               \
    do {                                                                \
        size_t b_ = (bytes) ? (bytes) : 256;                            \
        CUDA_TRY(cudaMalloc((void **)&(ptr), b_));                      \
        *total += b_;                                                   \
    } while (0)

/* The worst case of a pass's plan (core/plan.h), with weight-gradient tiles square 128 x 128: more
 * tiles than the real 128 x 256. */
static mok_plan worst_plan(const mok_workspace *ws) {
    const mok_plan_tiles tiles = {CUDA_N_TILE, CUDA_N_TILE, CUDA_WGRAD_M, 0, 0};
    const mok_plan_workspace w = mok__plan_workspace(ws, tiles);
    return mok__plan_worst(&w);
}

size_t mok__cuda_fp8_xhat_bytes(const mok_workspace *ws) {
    return ((size_t)ws->shape.max_tokens * (size_t)ws->shape.hidden * 2 + 255) / 256 * 256;
}

long long mok__cuda_fp8_sh_gq_ld(const mok_workspace *ws) {
    const long long Is = ws->shape.shared_intermediate;
    return (2 * Is + 2 * Is / MOK_FP8_BLOCK * 4 + 15) / 16 * 16;
}

int mok__cuda_fp8_shared_codes_fit(const mok_workspace *ws) {
    const size_t T = (size_t)ws->shape.max_tokens, comb = T * (size_t)ws->shape.topk * (size_t)ws->shape.hidden * 2;
    return mok__cuda_fp8_xhat_bytes(ws) + T * (size_t)mok__cuda_fp8_sh_gq_ld(ws) <= comb;
}

long long mok__cuda_fp8_dyq_ld(const mok_workspace *ws) {
    const long long H = ws->shape.hidden;
    return (H + H / MOK_FP8_BLOCK * 4 + 15) / 16 * 16;
}

long long mok__cuda_fp8_dyq_offset(const mok_workspace *ws) {
    const size_t T = (size_t)ws->shape.max_tokens, comb = T * (size_t)ws->shape.topk * (size_t)ws->shape.hidden * 2;
    size_t off = 0;
    if (ws->shape.shared_intermediate > 0) {
        off = mok__cuda_fp8_xhat_bytes(ws);
        if (mok__cuda_fp8_shared_codes_fit(ws)) off += T * (size_t)mok__cuda_fp8_sh_gq_ld(ws);
    }
    off = (off + 255) / 256 * 256;
    return off + T * (size_t)mok__cuda_fp8_dyq_ld(ws) <= comb ? (long long)off : -1;
}

static mok_status rank_alloc(mok_workspace *ws, cuda_workspace *cw, cuda_rank *R, size_t *total) {
    const mok_shape *s = &ws->shape;
    const size_t ring = (size_t)ws->config.ring_rows, H = (size_t)s->hidden, I = (size_t)s->intermediate;
    const size_t Is = (size_t)s->shared_intermediate, T = (size_t)s->max_tokens;
    const mok_plan worst = worst_plan(ws);
    R->counters_cap = cw->counters_cap;
    ALLOC(R->peers, sizeof(char *) * MOK_MAX_RANKS);
    if (!cw->sym.turned) { /* otherwise in the window (window_buffers) */
        ALLOC(R->ring_x, ring * H * 2);
        ALLOC(R->ring_y, ring * H * 2);
        ALLOC(R->counters, sizeof(unsigned long long) * (size_t)(R->counters_cap + MOK_COUNTER_EXTRA_SLOTS));
        ALLOC(R->ring_dy, ring * H * 2);
        ALLOC(R->ring_dyw, ring * H * 2);
        ALLOC(R->ring_w, ring * 4);
        ALLOC(R->ring_rdot, ring * (I / 64) * 4);
    }
    ALLOC(R->ring_h, ring * I * 2);
    ALLOC(R->sh_h, T * Is * 2);
    ALLOC(R->sh_out, T * H * 2);
    ALLOC(R->ring_gu, ring * 2 * I * 2);
    ALLOC(R->ring_dgu, ring * 2 * I * 2);
    ALLOC(R->sh_dgu, T * 2 * Is * 2);
    if (s->precision == MOK_PRECISION_FP8 && Is > 0 && !mok__cuda_fp8_shared_codes_fit(ws))
        ALLOC(R->sh_gq, T * (size_t)mok__cuda_fp8_sh_gq_ld(ws));
    long long max_macro = (ws->sched_layout.max_rows + ws->config.ring_rows - 1) / ws->config.ring_rows;
    R->carry_slots = max_macro > 1 ? max_macro - 1 : 0;
    ALLOC(R->carry, (size_t)R->carry_slots * 3 * I * H * 4);
    if (ws->config.trace) {
        R->trace_cap = mok__tasks_max(&worst, ws->sched_layout.max_rows, s->max_tokens) + 16 + R->num_sms;
        ALLOC(R->trace, sizeof(mok_trace_event) * (size_t)(MOK_TRACE_PASSES * R->trace_cap));
        ALLOC(R->trace_count, sizeof(unsigned long long) * MOK_TRACE_PASSES);
        CUDA_TRY(cudaMemset(R->trace_count, 0, sizeof(unsigned long long) * MOK_TRACE_PASSES));
    }
    ALLOC(R->epoch, sizeof(unsigned long long));
    ALLOC(R->sched_mem, mok__cuda_sched_scratch(ws, R->num_sms, NULL, &R->sched));
    mok__cuda_sched_scratch(ws, R->num_sms, R->sched_mem, &R->sched);
    R->spans_cap = mok__spans_max(&worst, ws->sched_layout.max_rows, s->max_tokens);
    ALLOC(R->spans, sizeof(mok_task_span) * (size_t)R->spans_cap);
    ALLOC(R->spans_published, sizeof(unsigned long long));
    ALLOC(R->comm_dev, sizeof(int));
    CUDA_TRY(cudaMemset(R->epoch, 0, sizeof(unsigned long long)));
    return mok__cuda_error_word_create(R, total);
}

static const char *environment(const char *name) { return getenv(name); }

extern "C" const mok_cuda_tuning *mok__cuda_workspace_tuning(const mok_workspace *ws) {
    return &((const cuda_workspace *)ws->impl)->ranks[0].tuning;
}

__global__ void blob_gather_kernel(char *const *peers, size_t off_blob, int nranks, cuda_blob *out) {
    for (int p = threadIdx.x; p < nranks; p += blockDim.x) out[p] = *(const cuda_blob *)(peers[p] + off_blob);
}

static int shapes_equal(const mok_shape *a, const mok_shape *b) {
    return a->hidden == b->hidden && a->intermediate == b->intermediate && a->num_experts == b->num_experts &&
           a->topk == b->topk && a->shared_intermediate == b->shared_intermediate && a->max_tokens == b->max_tokens &&
           a->precision == b->precision;
}

/* One process per rank: every rank publishes its shape and config in its window, meets the others
 * at the workspace's first barrier, and reads theirs; a shape, or a config field of the protocol
 * (config.c's NOTE), that differs fails the creation on every rank alike, naming the field. */
static mok_status workspace_agree(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    cuda_rank *R = &cw->ranks[0];
    const int P = ws->group->nranks;
    const cuda_blob own = {ws->shape, ws->config};
    const mok_call create = {MOK_CALL_WORKSPACE_CREATE, 0, ws->index, 0, 0, 0};
    ws->call = create;
    ws->call_build[0] = 0;
    cudaSetDevice(R->device);
    CUDA_TRY(cudaMemcpy(R->sym + cw->sym.blob, &own, sizeof own, cudaMemcpyHostToDevice));
    mok_status st = mok__cuda_barrier(ws, 0, 0, -1, 0, NULL);
    if (st != MOK_OK) return st;
    CUDA_TRY(cudaDeviceSynchronize());
    st = mok__cuda_check_error_word(ws);
    if (st != MOK_OK) return st;
    cuda_blob *dev = NULL, theirs[MOK_MAX_RANKS];
    CUDA_TRY(cudaMalloc((void **)&dev, sizeof(cuda_blob) * (size_t)P));
    blob_gather_kernel<<<1, MOK_MAX_RANKS>>>(R->peers, cw->sym.blob, P, dev);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpy(theirs, dev, sizeof(cuda_blob) * (size_t)P, cudaMemcpyDeviceToHost);
    cudaFree(dev);
    if (e != cudaSuccess)
        return mok__fail(MOK_ERR_BACKEND, "workspace: reading the peers' shapes and configs: %s", cudaGetErrorString(e));
    for (int p = 0; p < P; ++p) {
        if (!shapes_equal(&theirs[p].shape, &ws->shape))
            return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape: rank %d's shape differs from rank %d's", R->rank, p);
        char diff[256];
        if (mok__config_protocol_diff(&ws->config, &theirs[p].config, p, diff, sizeof diff))
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "%s (rank %d); every rank's workspace needs the same minibatch_rows, ring_rows, "
                             "context_rows, swiglu_limit and transfer directions",
                             diff, R->rank);
    }
    return MOK_OK;
}

extern "C" mok_status mok__cuda_workspace_create(mok_workspace *ws) {
    mok_group *g = ws->group;
    cuda_group *cg = (cuda_group *)g->impl;
#ifdef MOK_CUDA_NO_TRACE
    if (ws->config.trace) return mok__fail(MOK_ERR_UNSUPPORTED, "config.trace: this build has the trace compiled out (NO_TRACE=1)");
#endif
    /* FP8 workspaces hold the same buffers as bf16 ones: an E4M3 row and its scales (n + n / 32
       bytes) fit where the bf16 row (2 n bytes) goes (forward.cu: pass_params_fp8). */
    cuda_workspace *cw = (cuda_workspace *)calloc(1, sizeof *cw);
    if (!cw) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    {
        const mok_plan worst = worst_plan(ws);
        cw->counters_cap = mok__counters_max(&worst, ws->sched_layout.max_rows, ws->shape.max_tokens);
    }
    mok__cuda_sym_layout(&cw->sym, ws, cw->counters_cap);
    cw->num_local = g->num_local_ranks;
    ws->impl = cw;
    int previous = 0;
    cudaGetDevice(&previous);
    mok_status st = MOK_OK;
    size_t total = 0;
    for (int lr = 0; lr < cw->num_local && st == MOK_OK; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        R->device = cg->device[lr];
        R->rank = g->first_rank + lr;
        R->num_sms = cg->num_sms[lr];
        mok__cuda_tuning_resolve(&R->tuning, &ws->shape, &ws->config, g->nranks, R->num_sms, cg->l2_bytes[lr],
                                 tma_encoder_found(), environment);
        cudaSetDevice(R->device);
        ncclTeam_t lsa = ncclTeamLsa(cg->comm[lr]);
        if (lsa.nRanks != g->nranks) {
            st = mok__fail(MOK_ERR_UNSUPPORTED,
                           "group: %d of its %d ranks share load/store memory with rank %d; mok needs one NVLink "
                           "domain for the whole EP group",
                           lsa.nRanks, g->nranks, R->rank);
            break;
        }
        size_t mine = 0;
        st = rank_alloc(ws, cw, R, &mine);
        total = mine;
        if (st == MOK_OK) st = mok__cuda_sym_alloc(cw, R);
    }
    if (st == MOK_OK) st = mok__cuda_sym_register(ws);
    if (st == MOK_OK && g->num_local_ranks < g->nranks) st = workspace_agree(ws);
    ws->sizes.symmetric_bytes = cw->sym.bytes;
    ws->sizes.workspace_bytes = total + cw->sym.bytes;
    cudaSetDevice(previous);
    if (st != MOK_OK) {
        mok__cuda_workspace_destroy(ws);
        return st;
    }
    return MOK_OK;
}

extern "C" mok_status mok__cuda_workspace_destroy(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    if (!cw) return MOK_OK;
    int previous = 0;
    cudaGetDevice(&previous);
    /* No kernel of this rank may still use this memory (a peer's: symmetric.cu's NOTE). */
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cudaSetDevice(cw->ranks[lr].device);
        cudaDeviceSynchronize();
    }
    const mok_status st = mok__cuda_sym_release(ws);
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        cudaSetDevice(R->device);
        rank_release(R);
    }
    cudaSetDevice(previous);
    free(cw);
    ws->impl = NULL;
    return st;
}

/* ---- memory for callers ------------------------------------------------------------------- */
extern "C" mok_status mok__cuda_memory_alloc(mok_group *g, int lr, size_t bytes, void **ptr) {
    cuda_group *cg = (cuda_group *)g->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    CUDA_TRY(cudaSetDevice(cg->device[lr]));
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 256);
    cudaSetDevice(previous);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "bytes: %zu of GPU %d memory: %s", bytes, cg->device[lr],
                         cudaGetErrorString(e));
    }
    return MOK_OK;
}

extern "C" mok_status mok__cuda_memory_free(mok_group *g, int lr, void *ptr) {
    cuda_group *cg = (cuda_group *)g->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    CUDA_TRY(cudaSetDevice(cg->device[lr]));
    cudaError_t e = cudaFree(ptr);
    cudaSetDevice(previous);
    if (e != cudaSuccess) return mok__fail(MOK_ERR_BACKEND, "ptr: cudaFree: %s", cudaGetErrorString(e));
    return MOK_OK;
}

extern "C" mok_status mok__cuda_memory_copy(mok_group *g, int lr, void *dst, const void *src, size_t bytes,
                                            mok_copy_kind kind) {
    cuda_group *cg = (cuda_group *)g->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    CUDA_TRY(cudaSetDevice(cg->device[lr]));
    cudaMemcpyKind k = kind == MOK_COPY_HOST_TO_RANK   ? cudaMemcpyHostToDevice
                       : kind == MOK_COPY_RANK_TO_HOST ? cudaMemcpyDeviceToHost
                                                       : cudaMemcpyDeviceToDevice;
    cudaError_t e = cudaMemcpy(dst, src, bytes, k);
    cudaSetDevice(previous);
    if (e != cudaSuccess) return mok__fail(MOK_ERR_BACKEND, "dst, src: cudaMemcpy: %s", cudaGetErrorString(e));
    return MOK_OK;
}

extern "C" mok_status mok__cuda_synchronize(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    int previous = 0;
    cudaGetDevice(&previous);
    for (int lr = 0; lr < cw->num_local; ++lr) {
        CUDA_TRY(cudaSetDevice(cw->ranks[lr].device));
        CUDA_TRY(cudaDeviceSynchronize());
    }
    cudaSetDevice(previous);
    return mok__cuda_check_error_word(ws);
}

/* Writes the tasks of the last forward and the last backward (config.trace) as Chrome trace JSON. */
extern "C" mok_status mok__cuda_trace_write(mok_workspace *ws, const char *path) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    const int parts = MOK_TRACE_PASSES * cw->num_local; /* part = pass * num_local + local rank */
    const mok_trace_event *events[MOK_TRACE_PASSES * MOK_MAX_RANKS];
    int64_t counts[MOK_TRACE_PASSES * MOK_MAX_RANKS];
    mok_trace_event *host[MOK_TRACE_PASSES * MOK_MAX_RANKS] = {0};
    int previous = 0;
    cudaGetDevice(&previous);
    mok_status st = MOK_OK;
    for (int part = 0; part < parts && st == MOK_OK; ++part) {
        const int pass = part / cw->num_local;
        cuda_rank *R = &cw->ranks[part % cw->num_local];
        unsigned long long n = 0;
        if (cudaSetDevice(R->device) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
            cudaMemcpy(&n, R->trace_count + pass, sizeof n, cudaMemcpyDeviceToHost) != cudaSuccess) {
            st = mok__fail(MOK_ERR_BACKEND, "trace: reading rank %d's trace failed", R->rank);
            break;
        }
        counts[part] = (int64_t)n < R->trace_cap ? (int64_t)n : R->trace_cap;
        host[part] = (mok_trace_event *)malloc(sizeof(mok_trace_event) * (size_t)(counts[part] + 1));
        if (!host[part]) {
            st = mok__fail(MOK_ERR_OUT_OF_MEMORY, "trace: out of host memory");
            break;
        }
        if (cudaMemcpy(host[part], R->trace + pass * R->trace_cap, sizeof(mok_trace_event) * (size_t)counts[part],
                       cudaMemcpyDeviceToHost) != cudaSuccess)
            st = mok__fail(MOK_ERR_BACKEND, "trace: copying rank %d's trace failed", R->rank);
        events[part] = host[part];
    }
    cudaSetDevice(previous);
    if (st == MOK_OK) st = mok__trace_write_json(path, events, counts, cw->num_local);
    for (int part = 0; part < parts; ++part) free(host[part]);
    return st;
}
