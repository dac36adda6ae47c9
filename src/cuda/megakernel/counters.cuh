/* counters.cuh — the pass's counters as the megakernels use them: bounded waits (one thread reads
 * with an acquire load, then spins relaxed and ends with an acquire fence; a wait that outlives the
 * timeout, or a peer's abort, stops the pass) and the release of a finished task's counters, with
 * its trace event. device.cuh's NOTE says which memory order, and why system scope when the
 * counters are in the window. */
#ifndef MOK_CUDA_MEGAKERNEL_COUNTERS_CUH
#define MOK_CUDA_MEGAKERNEL_COUNTERS_CUH

#include "cuda/megakernel/params.cuh"

/* The counters of rank `peer` (-1: this rank's own). A peer's are reached through its window. */
static __device__ __forceinline__ unsigned long long *counters_of(const pass_params &p, int peer) {
    return peer < 0 ? p.counters : (unsigned long long *)(p.peers[peer] + p.off_counters);
}

static __device__ __forceinline__ unsigned long long counter_acquire(const pass_params &p, const unsigned long long *c) {
    return p.turned ? ld_acquire_sys(c) : ld_acquire_gpu(c);
}
static __device__ __forceinline__ unsigned long long counter_relaxed(const pass_params &p, const unsigned long long *c) {
    return p.turned ? ld_relaxed_sys(c) : ld_relaxed_gpu(c);
}

/* One thread: spins until counter c of rank `peer` (-1: this rank) is >= target (c < 0: no wait).
 * False if the pass was aborted, here or on that peer, or the wait outlived the timeout (then it
 * sets MOK_KERR_STALL and the abort flag; a peer whose pass aborted, whatever its cause, stops
 * this one the same way, so a rank never waits on a peer that has given up).
 * One acquire load first (a counter already met costs what it always did); the spin after it is
 * relaxed and ends with one acquire fence. An acquire per spin would invalidate the SM's L1 every
 * round trip, and a compute CTA's producer spins on the next task's counters while its consumers
 * still run the current task, reading their scales, contexts and spilled registers through L1. */
static __device__ bool wait_counter_thread(const pass_params &p, long long c, long long target, int peer = -1,
                                           long long *seen = nullptr) {
    if (c < 0) return true;
    long long start = globaltimer_ns();
    unsigned long long *abort = p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT;
    const unsigned long long *base = counters_of(p, peer);
    const volatile unsigned long long *peer_abort = base + p.counters_cap + MOK_COUNTER_SLOT_ABORT;
    long long v = (long long)counter_acquire(p, base + c);
    if (v < target) {
        while ((v = (long long)counter_relaxed(p, base + c)) < target) {
            if (*(volatile unsigned long long *)abort) return false;
            const bool gave_up = peer >= 0 && *peer_abort;
            if (gave_up || globaltimer_ns() - start > p.timeout_ns) {
                set_error(p.error, MOK_KERR_STALL);
                atomicExch(abort, 1ull);
                return false;
            }
        }
        if (p.turned) fence_acq_rel_sys();
        else fence_acq_rel_gpu();
    }
    if (seen) *seen = v;
    return true;
}

/* One thread's wait on one of its own rank's counters, remembering the last counter it waited on
 * and the value it read there (a counter never falls during a pass): a wait that value already
 * meets is skipped. Consecutive tasks of one span wait on the same counter (every weight-gradient
 * tile of an expert and macrobatch on its dh tiles), and each acquire costs an L2 round trip and
 * the SM's L1 (the acquire invalidates it), on the producer's path to posting the task. The
 * earlier acquire already ordered everything the bumps up to that value released. */
struct counter_seen { /* 32 bits each (counter indices and values are far below 2^31): the
                         producer runs on few registers (setmaxnreg) */
    int c, v;
};

static __device__ __forceinline__ bool wait_counter_seen(const pass_params &p, long long c, long long target,
                                                         counter_seen *seen) {
    if (c < 0 || (c == seen->c && target <= seen->v)) return true;
    long long v = 0;
    if (!wait_counter_thread(p, c, target, -1, &v)) return false;
    seen->c = (int)c;
    seen->v = (int)(v < 0x7fffffff ? v : 0x7fffffff);
    return true;
}

/* The CTA waits until counter c of rank `peer` (-1: this rank) is >= target (thread 0 spins, the
 * CTA then proceeds together). Returns false if the pass was aborted. */
static __device__ bool wait_counter(const pass_params &p, long long c, long long target, volatile int *s_flag,
                                    int peer = -1) {
    if (threadIdx.x == 0) *s_flag = wait_counter_thread(p, c, target, peer);
    __syncthreads();
    bool ok = *s_flag;
    __syncthreads();
    return ok;
}

/* One thread, after the task's writes are ordered before it (bar.sync, or an mbarrier after
 * one): the trace event (start, end), then the release of the task's done counters. */
static __device__ void finish_task(const pass_params &p, const mok_task_span &span, long long rt, int role,
                                   long long start, long long end, long long gemm_ns = 0, long long epi_ns = 0) {
    if (TRACE_ON(p)) {
        unsigned long long n = atomicAdd(p.trace_count, 1ull);
        if ((long long)n < p.trace_cap) {
            mok_trace_event e;
            e.kind = (int16_t)span.kind;
            e.worker = (int16_t)blockIdx.x;
            e.minibatch = span.minibatch;
            e.rank = p.rank;
            e.comm = role == MOK_ROLE_COMM;
            e.gemm_ns = (int32_t)gemm_ns;
            e.epi_ns = (int32_t)epi_ns;
            e.start_ns = start;
            e.end_ns = end;
            e.cycles = 0;
            p.trace[n] = e;
        }
    }
    if (p.turned) { /* peers wait on these counters, or this counter is a peer's */
        __threadfence_system();
        if (span.done[0] >= 0)
            red_release_sys(counters_of(p, span.done_peer) + span.done[0] + (span.done_per_tile ? rt - span.first_tile : 0),
                            1ull);
        if (span.done[1] >= 0) red_release_sys(p.counters + span.done[1], 1ull);
        return;
    }
    __threadfence();
    if (span.done[0] >= 0) red_release_gpu(p.counters + span.done[0] + (span.done_per_tile ? rt - span.first_tile : 0), 1ull);
    if (span.done[1] >= 0) red_release_gpu(p.counters + span.done[1], 1ull);
}

/* Thread 0 of a CTA, at its end (config.trace): its residency from `entry` (globaltimer) and the
 * SM's cycles since `entry_cycles` (clock64), as one event. */
static __device__ void trace_resident(const pass_params &p, long long entry, long long entry_cycles, int comm) {
    if (!TRACE_ON(p)) return;
    unsigned long long n = atomicAdd(p.trace_count, 1ull);
    if ((long long)n >= p.trace_cap) return;
    mok_trace_event e;
    e.kind = MOK_TRACE_RESIDENT;
    e.worker = (int16_t)blockIdx.x;
    e.minibatch = -1;
    e.rank = p.rank;
    e.comm = blockIdx.x < comm;
    e.gemm_ns = 0;
    e.epi_ns = 0;
    e.start_ns = entry;
    e.end_ns = globaltimer_ns();
    e.cycles = clock64() - entry_cycles;
    p.trace[n] = e;
}

#endif
