/* barrier.cu — the cross-GPU barrier every collective step of a pass runs on a rank's stream:
 * each rank writes its epoch into every peer's flag (system-scope release) and waits, bounded by
 * the peer timeout, until every peer's flag holds it (system-scope acquire); optionally it first
 * publishes this rank's T into its symmetric region. */
#include "cuda/backend.cuh"

/* NOTE: every rank runs the same sequence of barriers, so the epochs agree. The epoch lives in
 * device memory and is bumped by the kernel itself, so a captured CUDA graph replays correctly. */
__global__ void barrier_kernel(char *const *peers, size_t off_flags, size_t off_tokens, int rank, int nranks,
                               unsigned long long *epoch, long long tokens, int publish_tokens, int *error,
                               long long timeout_ns) {
    __shared__ unsigned long long e;
    __threadfence_system();
    if (threadIdx.x == 0) {
        if (publish_tokens) *(volatile long long *)(peers[rank] + off_tokens) = tokens;
        e = *epoch + 1;
        *epoch = e;
        __threadfence_system();
    }
    __syncthreads();
    for (int p = threadIdx.x; p < nranks; p += blockDim.x)
        st_release_sys((unsigned long long *)(peers[p] + off_flags) + rank, e);
    const unsigned long long *mine = (const unsigned long long *)(peers[rank] + off_flags);
    long long start = globaltimer_ns();
    for (int p = threadIdx.x; p < nranks; p += blockDim.x) {
        while (ld_acquire_sys(mine + p) < e) {
            if (*(volatile int *)error) break; /* the device word (cuda_error_word's first member) */
            if (globaltimer_ns() - start > timeout_ns) {
                set_error(error, MOK_KERR_TIMEOUT);
                __threadfence_system();
                break;
            }
        }
    }
    __syncthreads();
}

mok_status mok__cuda_barrier(mok_workspace *ws, int lr, cudaStream_t stream, int64_t tokens_to_publish) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    cuda_rank *R = &cw->ranks[lr];
    LAUNCH_TRY(barrier_kernel<<<1, 128, 0, stream>>>(R->peers, cw->sym.flags, cw->sym.tokens, R->rank,
                                                      ws->group->nranks, R->epoch, (long long)tokens_to_publish,
                                                      tokens_to_publish >= 0, (int *)R->error_word,
                                                      (long long)(ws->config.peer_timeout_ms * 1e6)));
    return MOK_OK;
}
