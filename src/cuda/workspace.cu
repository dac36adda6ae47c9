/* workspace.cu — the cuda backend's memory per rank: the symmetric region (ncclMemAlloc,
 * registered once as a window; peer pointers fetched once into a device table), the ring, the
 * shared expert's buffers, counters, the barrier epoch, the schedule build's scratch and the
 * error word with its mapped host mirror; and the cross-GPU barrier kernel. */
#include <string.h>
#include <time.h>

#include <nccl_device.h>

#include "cuda_common.cuh"

static size_t align256(size_t v) { return (v + 255u) & ~(size_t)255u; }

/* What every rank's workspace must agree on, as it publishes it at creation (workspace_agree). */
typedef struct cuda_blob {
    mok_shape shape;
    mok_config config;
} cuda_blob;

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
#define CALL_SLOTS 4
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

/* The call a word names, for messages (call numbers and builds as the word keeps them). */
static void describe_word(unsigned long long w, char *out, size_t size) {
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
 * cuda_common.cuh). */
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

/* Whether a transfer runs in other than its default direction: then the rings, counters and the
 * schedule's copy go into the window (cuda_sym_layout). */
static int turned(const mok_config *c) {
    return c->fwd_dispatch != MOK_PULL || c->fwd_combine != MOK_PUSH || c->bwd_combine != MOK_PULL ||
           c->bwd_dispatch != MOK_PUSH;
}

static void sym_layout(cuda_sym_layout *L, const mok_workspace *ws, int64_t counters_cap) {
    const mok_shape *s = &ws->shape;
    size_t T = (size_t)s->max_tokens, H = (size_t)s->hidden, k = (size_t)s->topk, off = 0;
    const size_t ring = (size_t)ws->config.ring_rows, I = (size_t)s->intermediate;
    L->flags = off; off = align256(off + 8 * MOK_MAX_RANKS);
    L->calls = off; off = align256(off + 8 * CALL_SLOTS * MOK_MAX_RANKS);
    L->blob = off; off = align256(off + sizeof(cuda_blob));
    L->tokens = off; off = align256(off + 8);
    L->x = off; off = align256(off + T * H * 2);
    L->router_w = off; off = align256(off + T * k * 4);
    L->ids = off; off = align256(off + T * k * 4);
    L->comb = off; off = align256(off + T * k * H * 2);
    L->dy = off; off = align256(off + T * H * 2);
    L->dxbuf = off; off = align256(off + T * k * H * 2);
    L->drw = off; off = align256(off + T * k * 4);
    L->turned = turned(&ws->config);
    L->sched = L->counters = L->ring_x = L->ring_y = L->ring_dy = L->ring_dyw = L->ring_w = L->ring_rdot = 0;
    if (L->turned) {
        L->sched = off; off = align256(off + ws->sched_layout.bytes);
        L->counters = off; off = align256(off + sizeof(unsigned long long) * (size_t)(counters_cap + 8));
        L->ring_x = off; off = align256(off + ring * H * 2);
        L->ring_y = off; off = align256(off + ring * H * 2);
        L->ring_dy = off; off = align256(off + ring * H * 2);
        L->ring_dyw = off; off = align256(off + ring * H * 2);
        L->ring_w = off; off = align256(off + ring * 4);
        L->ring_rdot = off; off = align256(off + ring * (I / 64) * 4);
    }
    L->bytes = off;
}

__global__ void peer_table_kernel(ncclWindow_t win, int nranks, char **peers) {
    int p = threadIdx.x;
    if (p < nranks) peers[p] = (char *)ncclGetLsaPointer(win, 0, p);
}

/* NOTE: every rank runs the same sequence of barriers, so the epochs agree. The epoch lives in
 * device memory and is bumped by the kernel itself, so a captured CUDA graph replays correctly.
 * With the epoch each rank publishes its call word (the NOTE above); a peer in another call sets
 * MOK_KERR_MISMATCH on every rank that sees it (all do), and the pass behind the barrier skips its
 * work (pass_start), as for any error. */
__global__ void barrier_kernel(char *const *peers, size_t off_flags, size_t off_calls, size_t off_tokens, int rank,
                               int nranks, unsigned long long *epoch, long long tokens, int publish_tokens, int *error,
                               long long timeout_ns, unsigned long long call) {
    __shared__ unsigned long long e;
    __shared__ int failed;
    __threadfence_system();
    if (threadIdx.x == 0) {
        if (publish_tokens) *(volatile long long *)(peers[rank] + off_tokens) = tokens;
        e = *epoch + 1;
        *epoch = e;
        failed = *(volatile int *)error != 0;
        __threadfence_system();
    }
    __syncthreads();
    if (failed) call = CALL_FAILED;
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

mok_status mok__cuda_barrier(mok_workspace *ws, int lr, cudaStream_t stream, int64_t tokens_to_publish, int step) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    cuda_rank *R = &cw->ranks[lr];
    const unsigned long long call = call_word(&ws->call, step, ws->call_build[lr]);
    LAUNCH_TRY(barrier_kernel<<<1, 128, 0, stream>>>(R->peers, cw->sym.flags, cw->sym.calls, cw->sym.tokens, R->rank,
                                                      ws->group->nranks, R->epoch, (long long)tokens_to_publish,
                                                      tokens_to_publish >= 0, (int *)R->error_word,
                                                      (long long)(ws->config.peer_timeout_ms * 1e6), call));
    return MOK_OK;
}

/* Reports the first error word set on a local rank, as its host mirror shows it (no
 * synchronisation). Argument errors found on the device (a bad expert id, a schedule that does not
 * fit the pass) are cleared once reported: the mirrors here, each device word by the next call on
 * its rank (mok__cuda_error_word_clear), so the next pass with good arguments works. A timeout or
 * a stall leaves the group unusable (and the words set). */
mok_status mok__cuda_check_error_word(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    for (int lr = 0; lr < cw->num_local; ++lr) {
        volatile int *mirror = cw->ranks[lr].error_mirror;
        int code = mirror[MIRROR_CODE];
        if (!code) continue;
        const int rank = cw->ranks[lr].rank;
        if (code == MOK_KERR_EXPERT_ID || code == MOK_KERR_TOKENS || code == MOK_KERR_SCHEDULE ||
            code == MOK_KERR_MISMATCH || code == MOK_KERR_PEER_FAILED) {
            char theirs[160] = "", mine[160] = "";
            const int peer = mirror[MIRROR_PEER];
            if (code == MOK_KERR_MISMATCH || code == MOK_KERR_PEER_FAILED) {
                describe_word((unsigned long long)(unsigned)mirror[MIRROR_THEIRS] |
                                  (unsigned long long)(unsigned)mirror[MIRROR_THEIRS + 1] << 32,
                              theirs, sizeof theirs);
                describe_word((unsigned long long)(unsigned)mirror[MIRROR_MINE] |
                                  (unsigned long long)(unsigned)mirror[MIRROR_MINE + 1] << 32,
                              mine, sizeof mine);
            }
            for (int other = 0; other < cw->num_local; ++other) {
                *(volatile int *)cw->ranks[other].error_mirror = 0;
                cw->ranks[other].error_clear_pending = 1;
            }
            if (code == MOK_KERR_EXPERT_ID)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                 "topk_ids: rank %d's kernel found an expert id outside [-1, E = %lld)", rank,
                                 (long long)ws->shape.num_experts);
            if (code == MOK_KERR_TOKENS)
                return mok__fail(MOK_ERR_INVALID_ARGUMENT, "num_tokens: a peer of rank %d published T outside [0, T_max]",
                                 rank);
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
    cudaFree(R->groups);
    cudaFree(R->num_groups);
    cudaFree(R->comm_dev);
    R->comm_dev = NULL;
    R->groups = NULL;
    R->num_groups = NULL;
    cudaFree(R->error_word);
    if (R->error_mirror) cudaFreeHost(R->error_mirror);
    R->peers = NULL;
    R->ring_x = R->ring_h = R->ring_y = R->sh_h = R->sh_out = NULL;
    R->counters = R->epoch = NULL;
    R->error_word = NULL;
    R->error_mirror = NULL;
    R->error_clear_pending = 0;
}

#define ALLOC(ptr, bytes)                                               \
    do {                                                                \
        size_t b_ = (bytes) ? (bytes) : 256;                            \
        CUDA_TRY(cudaMalloc((void **)&(ptr), b_));                      \
        *total += b_;                                                   \
    } while (0)

static mok_status rank_alloc(mok_workspace *ws, cuda_workspace *cw, cuda_rank *R, size_t *total) {
    const mok_shape *s = &ws->shape;
    const size_t ring = (size_t)ws->config.ring_rows, H = (size_t)s->hidden, I = (size_t)s->intermediate;
    const size_t Is = (size_t)s->shared_intermediate, T = (size_t)s->max_tokens;
    const mok_plan worst = mok__plan_worst(ws, CUDA_N_TILE, CUDA_N_TILE, CUDA_WGRAD_M);
    R->counters_cap = cw->counters_cap;
    ALLOC(R->peers, sizeof(char *) * MOK_MAX_RANKS);
    if (!cw->sym.turned) { /* otherwise in the window (window_buffers) */
        ALLOC(R->ring_x, ring * H * 2);
        ALLOC(R->ring_y, ring * H * 2);
        ALLOC(R->counters, sizeof(unsigned long long) * (size_t)(R->counters_cap + 8));
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
    R->groups_cap = mok__groups_max(&worst, ws->sched_layout.max_rows, s->max_tokens);
    ALLOC(R->groups, sizeof(mok_task_group) * (size_t)R->groups_cap);
    ALLOC(R->num_groups, sizeof(long long));
    ALLOC(R->comm_dev, sizeof(int));
    CUDA_TRY(cudaMemset(R->epoch, 0, sizeof(unsigned long long)));
    /* NOTE (the error word): who writes it, who reads it, who clears it, in which order.
     * - Set: only set_error, on the device: atomicCAS(word, 0, code) at device scope; the one
     *   thread whose CAS succeeds then stores the code into the mirror (st.relaxed.sys + a system
     *   fence). So between two clears the mirror is written at most once, with the first code.
     * - Read on the device: the device word, never the mirror (kernels skip their work while it
     *   is set; waits give up). Read on the host: the mirror only, without synchronising
     *   (mok__cuda_check_error_word at the start of every call, and after mok_synchronize).
     * - Clear, for argument errors only (a timeout or a stall leaves the group unusable): the host
     *   first zeroes the mirror when it reports the error and marks the rank; the next call on
     *   the rank then zeroes the word with a cudaMemsetAsync on that call's stream, before any of
     *   its kernels (mok__cuda_error_word_clear, from launch_pass and the schedule build). In
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
    CUDA_TRY(cudaHostAlloc((void **)&R->error_mirror, sizeof(int) * MIRROR_INTS, cudaHostAllocMapped));
    memset(R->error_mirror, 0, sizeof(int) * MIRROR_INTS);
    cuda_error_word word = {0, 0, NULL};
    CUDA_TRY(cudaHostGetDevicePointer((void **)&word.mirror, R->error_mirror, 0));
    ALLOC(R->error_word, sizeof(cuda_error_word));
    CUDA_TRY(cudaMemcpy(R->error_word, &word, sizeof word, cudaMemcpyHostToDevice));
    R->error_clear_pending = 0;
    return MOK_OK;
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
    mok_status st = mok__cuda_barrier(ws, 0, 0, -1, 0);
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
    /* Every rank refuses alike, before any collective call, so none waits on another. */
    if (ws->shape.precision == MOK_PRECISION_FP8)
        return mok__fail(MOK_ERR_UNSUPPORTED,
                         "shape.precision: the cuda backend has no FP8 GEMM tiles yet; FP8 workspaces run on the cpu "
                         "backend");
    cuda_workspace *cw = (cuda_workspace *)calloc(1, sizeof *cw);
    if (!cw) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: out of host memory");
    {
        /* weight-gradient tiles square 128 x 128: more tiles than the real 128 x 256 */
        const mok_plan worst = mok__plan_worst(ws, CUDA_N_TILE, CUDA_N_TILE, CUDA_WGRAD_M);
        cw->counters_cap = mok__counters_max(&worst, ws->sched_layout.max_rows, ws->shape.max_tokens);
    }
    sym_layout(&cw->sym, ws, cw->counters_cap);
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
        if (st == MOK_OK) {
            ncclResult_t r = ncclMemAlloc((void **)&R->sym, cw->sym.bytes);
            if (r != ncclSuccess) st = mok__fail(MOK_ERR_OUT_OF_MEMORY, "workspace: ncclMemAlloc(%zu): %s",
                                                 cw->sym.bytes, ncclGetErrorString(r));
            else if (cudaMemset(R->sym, 0, cw->sym.bytes) != cudaSuccess)
                st = mok__fail(MOK_ERR_BACKEND, "workspace: clearing the symmetric region failed");
            else
                window_buffers(cw, R);
        }
    }
    /* Collective: every rank registers its region (one group call for all local ranks). */
    if (st == MOK_OK) {
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
            st = mok__fail(MOK_ERR_TIMEOUT, "workspace: window registration did not finish within peer_timeout_ms");
        else if (r != ncclSuccess)
            st = mok__fail(MOK_ERR_BACKEND, "workspace: ncclCommWindowRegister: %s", ncclGetErrorString(r));
    }
    for (int lr = 0; lr < cw->num_local && st == MOK_OK; ++lr) {
        cuda_rank *R = &cw->ranks[lr];
        cudaSetDevice(R->device);
        peer_table_kernel<<<1, MOK_MAX_RANKS>>>(R->win, g->nranks, R->peers);
        if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
            st = mok__fail(MOK_ERR_BACKEND, "workspace: fetching the peer pointers failed on rank %d", R->rank);
    }
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

/* NOTE (freeing the window): after a timeout or a stall (group->failed, ws->failed), a rank of a
 * group of one process per rank cannot know that its peers' kernels have left its window: their
 * barrier and pass may still write into it until their own waits give up. Its window then stays
 * allocated (and registered) for the life of the process, as mok.h says; so does it when the
 * collective deregistration does not finish (a peer is not destroying the workspace with this
 * rank). Otherwise every rank has synchronised its devices before it deregisters, so no kernel of
 * any rank touches the window when it is freed. In local mode the synchronisation of every local
 * device suffices. */
extern "C" mok_status mok__cuda_workspace_destroy(mok_workspace *ws) {
    cuda_workspace *cw = (cuda_workspace *)ws->impl;
    if (!cw) return MOK_OK;
    mok_group *g = ws->group;
    cuda_group *cg = (cuda_group *)g->impl;
    const int per_rank = g->num_local_ranks < g->nranks;
    int keep = per_rank && (g->failed || ws->failed);
    mok_status st = MOK_OK;
    int previous = 0;
    cudaGetDevice(&previous);
    /* No kernel of this rank may still use this memory. */
    for (int lr = 0; lr < cw->num_local; ++lr) {
        cudaSetDevice(cw->ranks[lr].device);
        cudaDeviceSynchronize();
    }
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
