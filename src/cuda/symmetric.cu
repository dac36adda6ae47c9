/* symmetric.cu — each rank's symmetric region: its layout (the same byte offsets on every rank),
 * its memory (ncclMemAlloc, cleared), its registration as an NCCL window (collective, one group
 * call for the local ranks) and the device table of every rank's region that the kernels use
 * (peer pointers fetched once, by peer_table_kernel). The region holds what peers read and write:
 * x, router_w, topk_ids and T for the schedule and the pulls, the per-(token, slot) rows owners
 * write into, the barrier's flags, and with a turned transfer the rings, counters and schedule. */
#include <string.h>
#include <time.h>

#include <nccl_device.h>

#include "cuda/backend.cuh"

/* The region (core/layout.h): every part 256-byte aligned; the barrier's flags and call words and
 * the creation blob first; with a turned transfer the schedule's copy, the counter block and the
 * rings (their bf16(w * dy) rows too) after the per-token parts. */
void mok__cuda_sym_layout(mok_region_layout *L, const mok_workspace *ws, int64_t counters_cap) {
    mok_region_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.align = 256;
    spec.flags_bytes = 8 * MOK_MAX_RANKS;
    spec.calls_bytes = 8 * CALL_SLOTS * MOK_MAX_RANKS;
    spec.blob_bytes = sizeof(cuda_blob);
    spec.rings = mok__config_turned(&ws->config);
    spec.ring_dyw = 1;
    spec.rdot_cols = ws->shape.intermediate / 64;
    spec.counters = counters_cap + MOK_COUNTER_EXTRA_SLOTS;
    mok__region_layout(L, &ws->shape, &ws->config, ws->sched_layout.bytes, &spec);
}

__global__ void peer_table_kernel(ncclWindow_t win, int nranks, char **peers) {
    int p = threadIdx.x;
    if (p < nranks) peers[p] = (char *)ncclGetLsaPointer(win, 0, p);
}

/* Communicators made one process per rank are non-blocking (so a missing peer is a timeout):
 * their collective calls may answer "in progress". Waits until every local communicator is done,
 * bounded by the peer timeout. */
static ncclResult_t nccl_finish(mok_workspace *ws, ncclResult_t r) {
    if (r != ncclInProgress && r != ncclSuccess) return r;
    cuda_group *cg = (cuda_group *)ws->group->impl;
    double waited_ms = 0;
    for (int lr = 0; lr < ws->group->num_local_ranks; ++lr) {
        for (;;) {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(cg->comm[lr], &async);
            if (async == ncclSuccess) break;
            if (async != ncclInProgress) return async;
            if (waited_ms > ws->config.peer_timeout_ms) return ncclInProgress;
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
            waited_ms += 0.2;
        }
    }
    return ncclSuccess;
}

/* With a turned transfer, the buffers peers reach are parts of the rank's window. */
static void window_buffers(const cuda_workspace *cw, cuda_rank *R) {
    if (!cw->sym.turned) return;
    R->in_window = 1;
    R->counters = (unsigned long long *)(R->sym + cw->sym.counters);
    R->ring_x = (uint16_t *)(R->sym + cw->sym.ring_x);
    R->ring_y = (uint16_t *)(R->sym + cw->sym.ring_y);
    R->ring_dy = (uint16_t *)(R->sym + cw->sym.ring_dy);
    R->ring_dyw = (uint16_t *)(R->sym + cw->sym.ring_dyw);
    R->ring_w = (float *)(R->sym + cw->sym.ring_w);
    R->ring_rdot = (float *)(R->sym + cw->sym.ring_rdot);
}

mok_status mok__cuda_sym_alloc(const cuda_workspace *cw, cuda_rank *R) {
    ncclResult_t r = ncclMemAlloc((void **)&R->sym, cw->sym.bytes);
    if (r != ncclSuccess)
        return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: ncclMemAlloc(%zu): %s", cw->sym.bytes,
                         ncclGetErrorString(r));
    if (cudaMemset(R->sym, 0, cw->sym.bytes) != cudaSuccess)
        return mok__fail(MOK_ERR_BACKEND, "workspace: clearing the symmetric region failed");
    window_buffers(cw, R);
    return MOK_OK;
}

mok_status mok__cuda_sym_register(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    cuda_group *cg = (cuda_group *)ws->group->impl;
    /* Collective: every rank registers its region (one group call for all local ranks). */
    ncclResult_t r = ncclGroupStart();
    for (int lr = 0; lr < cw->num_local && r == ncclSuccess; ++lr) {
        cudaSetDevice(cw->ranks[lr].device);
        r = ncclCommWindowRegister(cg->comm[lr], cw->ranks[lr].sym, cw->sym.bytes, &cw->ranks[lr].win,
                                   NCCL_WIN_COLL_SYMMETRIC);
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = r2;
    r = nccl_finish(ws, r);
    if (r == ncclInProgress)
        return mok__fail(MOK_ERR_TIMEOUT, "workspace: window registration did not finish within peer_timeout_ms");
    if (r != ncclSuccess) return mok__fail(MOK_ERR_BACKEND, "workspace: ncclCommWindowRegister: %s", ncclGetErrorString(r));
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        cudaSetDevice(R->device);
        peer_table_kernel<<<1, MOK_MAX_RANKS>>>(R->win, ws->group->nranks, R->peers);
        if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
            return mok__fail(MOK_ERR_BACKEND, "workspace: fetching the peer pointers failed on rank %d", R->rank);
    }
    return MOK_OK;
}

/* NOTE (freeing the window): after a timeout or a stall (group->failed, ws->failed), a rank of a
 * group of one process per rank cannot know that its peers' kernels have left its window: their
 * barrier and pass may still write into it until their own waits give up. Its window then stays
 * allocated (and registered) for the life of the process, as mok.h says; so does it when the
 * collective deregistration does not finish (a peer is not destroying the workspace with this
 * rank). Otherwise every rank has synchronised its devices before it deregisters, so no kernel of
 * any rank touches the window when it is freed. In local mode the synchronisation of every local
 * device suffices. The caller has synchronised this process's devices. */
mok_status mok__cuda_sym_release(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    mok_group *g = ws->group;
    cuda_group *cg = (cuda_group *)g->impl;
    const int per_rank = g->num_local_ranks < g->nranks;
    int keep = per_rank && (g->failed || ws->failed);
    mok_status st = MOK_OK;
    if (!g->failed && !keep) {
        ncclGroupStart();
        for (int lr = 0; lr < cw->num_local; ++lr)
            if (cw->ranks[lr].win) {
                cudaSetDevice(cw->ranks[lr].device);
                ncclCommWindowDeregister(cg->comm[lr], cw->ranks[lr].win);
            }
        ncclResult_t r = nccl_finish(ws, ncclGroupEnd());
        if (r != ncclSuccess && per_rank) {
            keep = 1;
            g->failed = 1;
            st = mok__fail(r == ncclInProgress ? MOK_ERR_TIMEOUT : MOK_ERR_BACKEND,
                           "workspace: the peers did not deregister its window with this rank (%s); the window stays "
                           "allocated and the group is unusable",
                           r == ncclInProgress ? "not within peer_timeout_ms" : ncclGetErrorString(r));
        }
    }
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        cudaSetDevice(R->device);
        if (R->sym && !keep) ncclMemFree(R->sym);
        R->sym = NULL; /* when kept: on purpose, the NOTE above */
    }
    return st;
}
