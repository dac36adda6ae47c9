/* group.cu — the EP group on GPUs: one NCCL communicator per rank, created either one process
 * per rank from a unique id (non-blocking init, so a peer that never joins is a timeout, not a
 * hang) or by one process for all its GPUs. */
#include <string.h>
#include <time.h>

#include "cuda/backend.cuh"

extern "C" int mok__cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: clear the sticky-free error */
        return 0;
    }
    return n;
}

extern "C" mok_status mok__cuda_unique_id(mok_unique_id *id) {
    static_assert(sizeof(ncclUniqueId) <= sizeof(mok_unique_id), "unique id size");
    ncclUniqueId nid;
    NCCL_TRY(ncclGetUniqueId(&nid));
    memcpy(id->bytes, &nid, sizeof nid);
    return MOK_OK;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static mok_status check_device(int device, int count, const char *name) {
    if (device < 0 || device >= count)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: GPU %d is not in [0, %d)", name, device, count);
    cudaDeviceProp prop;
    CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    if (prop.major != 9)
        return mok__fail(MOK_ERR_UNSUPPORTED, "%s: GPU %d is sm_%d%d; the cuda backend is built for sm_90a (Hopper)",
                         name, device, prop.major, prop.minor);
    return MOK_OK;
}

extern "C" mok_status mok__cuda_group_create(mok_group *g, int rank, const mok_unique_id *id, const int *devices) {
    int count = mok__cuda_device_count();
    cuda_group *cg = (cuda_group *)calloc(1, sizeof *cg);
    if (!cg) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "group: out of host memory");
    int previous = 0;
    cudaGetDevice(&previous);
    mok_status st = MOK_OK;
    for (int lr = 0; lr < g->num_local_ranks && st == MOK_OK; ++lr) {
        char name[32];
        snprintf(name, sizeof name, id ? "device" : "devices[%d]", lr);
        st = check_device(devices[lr], count, name);
        for (int other = 0; other < lr && st == MOK_OK; ++other)
            if (devices[other] == devices[lr])
                st = mok__fail(MOK_ERR_INVALID_ARGUMENT, "devices[%d]: GPU %d is listed twice", lr, devices[lr]);
        cg->device[lr] = devices[lr];
        if (st == MOK_OK) {
            cudaDeviceProp prop;
            cudaGetDeviceProperties(&prop, devices[lr]);
            cg->num_sms[lr] = prop.multiProcessorCount;
            cg->l2_bytes[lr] = prop.l2CacheSize;
        }
    }
    if (st == MOK_OK && !id) {
        ncclResult_t r = ncclCommInitAll(cg->comm, g->nranks, cg->device);
        if (r != ncclSuccess) st = mok__fail(MOK_ERR_BACKEND, "group: ncclCommInitAll: %s", ncclGetErrorString(r));
    } else if (st == MOK_OK) {
        ncclUniqueId nid;
        memcpy(&nid, id->bytes, sizeof nid);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        cudaSetDevice(cg->device[0]);
        ncclResult_t r = ncclCommInitRankConfig(&cg->comm[0], g->nranks, nid, rank, &config);
        double deadline = now_ms() + g->config.peer_timeout_ms;
        while (r == ncclSuccess || r == ncclInProgress) {
            ncclResult_t async = ncclInProgress;
            ncclCommGetAsyncError(cg->comm[0], &async);
            if (async == ncclSuccess) break;
            if (async != ncclInProgress) {
                r = async;
                break;
            }
            if (now_ms() > deadline) {
                ncclCommAbort(cg->comm[0]);
                cg->comm[0] = NULL;
                st = mok__fail(MOK_ERR_TIMEOUT, "group: not every rank joined within peer_timeout_ms = %.0f",
                               g->config.peer_timeout_ms);
                break;
            }
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
        if (st == MOK_OK && r != ncclSuccess && r != ncclInProgress)
            st = mok__fail(MOK_ERR_BACKEND, "group: ncclCommInitRankConfig: %s", ncclGetErrorString(r));
    }
    cudaSetDevice(previous);
    if (st != MOK_OK) {
        for (int lr = 0; lr < g->num_local_ranks; ++lr)
            if (cg->comm[lr]) ncclCommDestroy(cg->comm[lr]);
        free(cg);
        return st;
    }
    g->impl = cg;
    return MOK_OK;
}

extern "C" void mok__cuda_group_destroy(mok_group *g) {
    cuda_group *cg = (cuda_group *)g->impl;
    if (!cg) return;
    int previous = 0;
    cudaGetDevice(&previous);
    for (int lr = 0; lr < g->num_local_ranks; ++lr) {
        if (!cg->comm[lr]) continue;
        cudaSetDevice(cg->device[lr]);
        if (g->failed) ncclCommAbort(cg->comm[lr]);
        else ncclCommDestroy(cg->comm[lr]);
    }
    cudaSetDevice(previous);
    free(cg);
    g->impl = NULL;
}
