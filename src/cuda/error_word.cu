/* error_word.cu — the host's side of a rank's error word (error_word.cuh): its memory (the word
 * in device memory, its mirror in mapped pinned host memory), the report of what the kernels
 * set, and the clearing of argument errors.
 *
 * NOTE (the error word): who writes it, who reads it, who clears it, in which order.
 * - Set: only set_error, on the device: atomicCAS(word, 0, code) at device scope; the one
 *   thread whose CAS succeeds then stores the code into the mirror (st.relaxed.sys + a system
 *   fence). So between two clears the mirror is written at most once, with the first code.
 * - Read on the device: the device word, never the mirror (kernels skip their work while it
 *   is set; waits give up). Read on the host: the mirror only, without synchronising
 *   (mok__cuda_check_error_word at the start of every call, and after mok_synchronize).
 * - Clear, for argument errors only (a timeout or a stall leaves the group unusable): the host
 *   first zeroes the mirror when it reports the error and marks the rank; the next call on
 *   the rank then zeroes the word with a cudaMemsetAsync on that call's stream, before any of
 *   its kernels (mok__cuda_error_word_clear, from mok__cuda_launch_pass and the schedule build). In
 *   between, the word stays set, so kernels still in flight from the failed calls lose the
 *   CAS and cannot write the mirror again; after the memset, in stream order, the next error
 *   wins the CAS and writes the mirror anew. A word is never zeroed on every call: a call
 *   issued behind a failed one (a forward behind a schedule with a bad id) must see the
 *   earlier error, not clear it. A workspace serves one pass at a time (the caller orders its
 *   passes, on one stream or through events), so the memset cannot overtake a kernel of an
 *   earlier pass. One window is left: when a process drives several ranks, one report clears
 *   every rank's mirror, and a rank whose winning store is still on its way shows its code
 *   again later; mok_synchronize, which waits for the kernels before it reads, has none.
 * - Graphs: a call captured while a clear is pending records the memset as a node, and every
 *   replay then starts with a cleared word, as such a call would; other captures hold none. */
#include <string.h>

#include "cuda/backend.cuh"

#define ALLOC(ptr, bytes)                                               \
    do {                                                                \
        size_t b_ = (bytes) ? (bytes) : 256;                            \
        CUDA_TRY(cudaMalloc((void **)&(ptr), b_));                      \
        *total += b_;                                                   \
    } while (0)

mok_status mok__cuda_error_word_create(cuda_rank *R, size_t *total) {
    CUDA_TRY(cudaHostAlloc((void **)&R->error_mirror, sizeof(int) * MIRROR_INTS, cudaHostAllocMapped));
    memset(R->error_mirror, 0, sizeof(int) * MIRROR_INTS);
    cuda_error_word word = {0, 0, NULL};
    CUDA_TRY(cudaHostGetDevicePointer((void **)&word.mirror, R->error_mirror, 0));
    ALLOC(R->error_word, sizeof(cuda_error_word));
    CUDA_TRY(cudaMemcpy(R->error_word, &word, sizeof word, cudaMemcpyHostToDevice));
    R->error_clear_pending = 0;
    return MOK_OK;
}

void mok__cuda_error_word_release(cuda_rank *R) {
    cudaFree(R->error_word);
    if (R->error_mirror) cudaFreeHost(R->error_mirror);
    R->error_word = NULL;
    R->error_mirror = NULL;
    R->error_clear_pending = 0;
}

/* Reports the first error word set on a local rank, as its host mirror shows it (no
 * synchronisation). Argument errors found on the device (a bad expert id, a schedule that does not
 * fit the pass, a schedule or context whose tag is not the pass's) are cleared once reported: the
 * mirrors here, each device word by the next call on its rank (mok__cuda_error_word_clear), so the
 * next pass with good arguments works. A timeout or a stall leaves the group unusable (and the
 * words set). */
mok_status mok__cuda_check_error_word(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        volatile int *mirror = cw->ranks[lr].error_mirror;
        int code = mirror[MIRROR_CODE];
        if (!code) continue;
        const int rank = cw->ranks[lr].rank;
        const int tag =
            code > MOK_KERR_TAG_BASE && code <= MOK_KERR_CONTEXT_BUILD ? code - MOK_KERR_TAG_BASE : MOK_TAG_OK;
        if (code == MOK_KERR_EXPERT_ID || code == MOK_KERR_TOKENS || code == MOK_KERR_SCHEDULE ||
            code == MOK_KERR_MISMATCH || code == MOK_KERR_PEER_FAILED || code == MOK_KERR_FP8_WEIGHTS ||
            tag != MOK_TAG_OK) {
            char theirs[160] = "", mine[160] = "";
            const int peer = mirror[MIRROR_PEER];
            const long long found = (long long)((unsigned long long)(unsigned)mirror[MIRROR_THEIRS] |
                                                (unsigned long long)(unsigned)mirror[MIRROR_THEIRS + 1] << 32);
            const long long expected = (long long)((unsigned long long)(unsigned)mirror[MIRROR_MINE] |
                                                   (unsigned long long)(unsigned)mirror[MIRROR_MINE + 1] << 32);
            if (code == MOK_KERR_MISMATCH || code == MOK_KERR_PEER_FAILED) {
                mok__cuda_describe_call_word((unsigned long long)(unsigned)mirror[MIRROR_THEIRS] |
                                                 (unsigned long long)(unsigned)mirror[MIRROR_THEIRS + 1] << 32,
                                             theirs, sizeof theirs);
                mok__cuda_describe_call_word((unsigned long long)(unsigned)mirror[MIRROR_MINE] |
                                                 (unsigned long long)(unsigned)mirror[MIRROR_MINE + 1] << 32,
                                             mine, sizeof mine);
            }
            for (int other = 0; other < cw->num_local; ++other) {
                *(volatile int *)cw->ranks[other].error_mirror = 0;
                cw->ranks[other].error_clear_pending = 1;
            }
            if (tag != MOK_TAG_OK) {
                /* the message names the argument of the pass the device refused, as the cpu's does */
                char args[32], message[1024];
                snprintf(args, sizeof args, "args[%d]", lr);
                mok__tag_refuse(ws, args, lr, tag, found, expected);
                snprintf(message, sizeof message, "%s", mok_last_error());
                return mok__fail(MOK_ERR_INVALID_ARGUMENT, "rank %d's pass did nothing: %s", rank, message);
            }
            if (code == MOK_KERR_EXPERT_ID)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                 "topk_ids: rank %d's kernel found an expert id outside [-1, E = %lld)", rank,
                                 (long long)ws->shape.num_experts);
            if (code == MOK_KERR_TOKENS)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT, "num_tokens: a peer of rank %d published T outside [0, T_max]",
                                 rank);
            if (code == MOK_KERR_FP8_WEIGHTS)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                 "args[%d].fp8_weights: rank %d's pass did nothing: the buffer was not written by "
                                 "mok_quantize_weights for this workspace's shape",
                                 lr, rank);
            if (code == MOK_KERR_PEER_FAILED)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                 "call: rank %d's part of %s failed (it reports its own error), so rank %d's part "
                                 "did not complete either",
                                 peer, mine, rank);
            if (code == MOK_KERR_MISMATCH)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                 "call: rank %d was in %s while rank %d was in %s (call numbers mod 2^20, the "
                                 "workspace mod 256); every rank makes the same collective calls in the same order, "
                                 "on the same schedule build; neither pass ran",
                                 peer, theirs, rank, mine);
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "schedule: rank %d's pass got a schedule that was not built (successfully) for this "
                             "rank and num_tokens",
                             rank);
        }
        /* A timeout or a stalled wait: peers may be out of step, and may still be inside a pass
           that touches this rank's window (mok__cuda_workspace_destroy keeps it then). */
        ws->failed = 1;
        ws->group->failed = 1;
        if (code == MOK_KERR_TIMEOUT) {
            return mok__fail(MOK_ERR_TIMEOUT, "rank %d: a peer did not reach a barrier within peer_timeout_ms = %.0f",
                             rank, ws->config.peer_timeout_ms);
        }
        return mok__fail(MOK_ERR_DEVICE_FAULT, "rank %d: the kernel reported error %d (a counter wait timed out)", rank,
                         code);
    }
    return MOK_OK;
}

mok_status mok__cuda_error_word_clear(mok_workspace *ws, int lr, cudaStream_t stream) {
    cuda_rank *R = &((cuda_workspace *)ws->impl)->ranks[lr];
    if (!R->error_clear_pending) return MOK_OK;
    CUDA_TRY(cudaMemsetAsync(&R->error_word->word, 0, sizeof(int), stream));
    R->error_clear_pending = 0;
    return MOK_OK;
}
