/* barrier.cu — the cross-GPU barrier every collective step of a pass runs on a rank's stream:
 * each rank writes its epoch into every peer's flag (system-scope release) and waits, bounded by
 * the peer timeout, until every peer's flag holds it (system-scope acquire); optionally it first
 * publishes this rank's T into its symmetric region. With its epoch each rank publishes the call
 * it is in, so that ranks in different calls fail instead of matching the wrong barriers. */
#include <string.h>

#include "cuda/backend.cuh"

/* NOTE (call words): each barrier carries the call its rank is in (mok_call), packed into 64 bits
 * so that one store reaches each peer: kind (bits 0-2), step (3), workspace index (4-11, mod 256),
 * call number (12-31, mod 2^20), the workspace's digest (32-47, its low bits) and the schedule
 * build (48-63: 0 unknown, else 1 + build mod 65535). Two words agree when every field does, the
 * build only when both know it; the wrapped fields can hide a mismatch between calls 2^20 apart,
 * never invent one. A rank writes its word into every peer's slot of the epoch, then (same thread,
 * release) its flag; a peer reads the slot after it acquires the flag. The slots go by epoch mod
 * CALL_SLOTS = 4: a rank whose error word is set passes the rest of its failed call's barriers
 * without waiting, so it can be two epochs ahead of a peer that still reads its slot, never four
 * (the next call clears the word first, and its opening barrier waits). */
#define CALL_LOW_BITS ((1ull << 48) - 1)
/* The word of a rank whose error word is set when it reaches the barrier: its part of the call has
 * failed (a timeout, a bad argument found on the device), so its peers' parts cannot complete
 * either; they report MOK_KERR_PEER_FAILED instead of a result that lacks that rank's rows. */
#define CALL_FAILED (~0ull)

static unsigned long long call_word(const mok_call *c, int step, int64_t build) {
    const unsigned long long packed_build = build > 0 ? 1ull + (unsigned long long)(build % 65535) : 0ull;
    return ((unsigned long long)c->kind & 7ull) | ((unsigned long long)(step & 1) << 3) |
           (((unsigned long long)c->workspace & 0xffull) << 4) | (((unsigned long long)c->seq & 0xfffffull) << 12) |
           ((c->digest & 0xffffull) << 32) | (packed_build << 48);
}

static __device__ __forceinline__ bool words_agree(unsigned long long a, unsigned long long b) {
    if (a == CALL_FAILED || b == CALL_FAILED) return a == b;
    const unsigned long long ba = a >> 48, bb = b >> 48;
    return ((a ^ b) & CALL_LOW_BITS) == 0 && (ba == 0 || bb == 0 || ba == bb);
}

void mok__cuda_describe_call_word(unsigned long long w, char *out, size_t size) {
    mok_call c;
    memset(&c, 0, sizeof c);
    c.kind = (int32_t)(w & 7ull);
    c.step = (int32_t)((w >> 3) & 1ull);
    c.workspace = (int64_t)((w >> 4) & 0xffull);
    c.seq = (int64_t)((w >> 12) & 0xfffffull);
    c.build = (w >> 48) ? (int64_t)(w >> 48) - 1 : 0;
    mok__call_describe(&c, out, size);
}

/* Sets `code` (MOK_KERR_MISMATCH, MOK_KERR_PEER_FAILED) unless an earlier error is there; the winner
 * writes the peer and both words into the mirror before the code (set_error's rules,
 * error_word.cuh). */
static __device__ void set_peer_error(int *error, int code, int peer, unsigned long long theirs,
                                      unsigned long long mine) {
    cuda_error_word *e = (cuda_error_word *)error;
    if (atomicCAS(&e->word, 0, code) != 0) return;
    int *m = e->mirror;
    st_relaxed_sys(m + MIRROR_PEER, peer);
    st_relaxed_sys(m + MIRROR_THEIRS, (int)(theirs & 0xffffffffull));
    st_relaxed_sys(m + MIRROR_THEIRS + 1, (int)(theirs >> 32));
    st_relaxed_sys(m + MIRROR_MINE, (int)(mine & 0xffffffffull));
    st_relaxed_sys(m + MIRROR_MINE + 1, (int)(mine >> 32));
    __threadfence_system();
    st_relaxed_sys(m + MIRROR_CODE, code);
    __threadfence_system();
}

/* NOTE: every rank runs the same sequence of barriers, so the epochs agree. The epoch lives in
 * device memory and is bumped by the kernel itself, so a captured CUDA graph replays correctly.
 * With the epoch each rank publishes its call word (the NOTE above); a peer in another call sets
 * MOK_KERR_MISMATCH on every rank that sees it (all do), and the pass behind the barrier skips its
 * work (pass_start), as for any error. */
__global__ void barrier_kernel(char *const *peers, size_t off_flags, size_t off_calls, size_t off_tokens, int rank,
                               int nranks, unsigned long long *epoch, long long tokens, int publish_tokens, int *error,
                               long long timeout_ns, unsigned long long call, const mok_sched_header *schedule) {
    __shared__ unsigned long long e, word;
    __threadfence_system();
    if (threadIdx.x == 0) {
        if (publish_tokens) *(volatile long long *)(peers[rank] + off_tokens) = tokens;
        e = *epoch + 1;
        *epoch = e;
        word = call;
        /* a pass's barrier: the build of the schedule it runs, which only the device can read (the
           host does not wait for the schedule); one that is not a schedule is refused after the
           barrier (spans_kernel) */
        if (schedule && schedule->magic == MOK_SCHED_MAGIC && schedule->build > 0)
            word = (word & CALL_LOW_BITS) | (1ull + (unsigned long long)(schedule->build % 65535)) << 48;
        if (*(volatile int *)error != 0) word = CALL_FAILED;
        __threadfence_system();
    }
    __syncthreads();
    call = word;
    const size_t slot = (size_t)(e % CALL_SLOTS) * MOK_MAX_RANKS;
    for (int p = threadIdx.x; p < nranks; p += blockDim.x) {
        *(volatile unsigned long long *)((unsigned long long *)(peers[p] + off_calls) + slot + rank) = call;
        st_release_sys((unsigned long long *)(peers[p] + off_flags) + rank, e);
    }
    const unsigned long long *mine = (const unsigned long long *)(peers[rank] + off_flags);
    const volatile unsigned long long *calls = (const volatile unsigned long long *)(peers[rank] + off_calls) + slot;
    long long start = globaltimer_ns();
    for (int p = threadIdx.x; p < nranks; p += blockDim.x) {
        bool arrived = true;
        while (ld_acquire_sys(mine + p) < e) {
            if (*(volatile int *)error) { /* the device word (cuda_error_word's first member) */
                arrived = false;
                break;
            }
            if (globaltimer_ns() - start > timeout_ns) {
                set_error(error, MOK_KERR_TIMEOUT);
                __threadfence_system();
                arrived = false;
                break;
            }
        }
        const unsigned long long theirs = arrived ? calls[p] : call;
        if (theirs == CALL_FAILED && call != CALL_FAILED) set_peer_error(error, MOK_KERR_PEER_FAILED, p, theirs, call);
        else if (!words_agree(theirs, call)) set_peer_error(error, MOK_KERR_MISMATCH, p, theirs, call);
    }
    __syncthreads();
}

mok_status mok__cuda_barrier(mok_workspace *ws, int lr, cudaStream_t stream, int64_t tokens_to_publish, int step,
                             const void *schedule) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    cuda_rank *R = &cw->ranks[lr];
    const unsigned long long call = call_word(&ws->call, step, ws->call_build[lr]);
    LAUNCH_TRY(barrier_kernel<<<1, 128, 0, stream>>>(R->peers, cw->sym.flags, cw->sym.calls, cw->sym.tokens, R->rank,
                                                      ws->group->nranks, R->epoch, (long long)tokens_to_publish,
                                                      tokens_to_publish >= 0, (int *)R->error_word,
                                                      (long long)(ws->config.peer_timeout_ms * 1e6), call,
                                                      (const mok_sched_header *)schedule));
    return MOK_OK;
}
