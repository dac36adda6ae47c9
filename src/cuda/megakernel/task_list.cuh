/* task_list.cuh — the pass's task list on the device: its spans in the global order (core/tasks.inc),
 * built by one thread, and every CTA maps the tickets it claims to tasks of its role's spans.
 *
 * The list is published through one word, p.spans_published = count << 1 | complete: span g may
 * be read once g < count (the builder's release store after writing it, the reader's acquire
 * load), and complete says there are no more. spans_kernel builds the whole list before the
 * megakernel starts, or with stream_spans (tuning.h) thread 0 of the megakernel's last CTA builds
 * it while the other CTAs take up its first tasks (stream_spans below), so the build (one thread,
 * some hundred nanoseconds a span) leaves the pass's critical path.
 *
 * NOTE: a CTA takes tickets of its role (comm or compute) in increasing order and maps each to a
 * task of its role's spans in the global order; a task waits only on counters bumped by earlier
 * tasks, and a span only on the builder, which waits on nothing. With every CTA resident
 * (cooperative launch) the pass cannot deadlock. */
#ifndef MOK_CUDA_MEGAKERNEL_TASK_LIST_CUH
#define MOK_CUDA_MEGAKERNEL_TASK_LIST_CUH

#include "cuda/megakernel/counters.cuh"

/* The pass's plan for building its list: make_plan, and where transfers name peers every rank's
 * padded rows (padded: the caller's [MOK_MAX_RANKS], which the plan points to), from the
 * schedules the ranks published before the start barrier (sched_publish_kernel). They stay as
 * they are until every rank has passed the end barrier. False if a peer's is out of range. */
static __device__ bool pass_plan(const pass_params &p, const mok_sched_view &v, mok_plan *plan, int64_t *padded) {
    make_plan(p, v, plan);
    if (!mok__plan_names_peers(plan)) return true;
    for (int q = 0; q < p.nranks; ++q) {
        const mok_sched_header *h = (const mok_sched_header *)(p.peers[q] + p.off_sched);
        padded[q] = *(volatile const int64_t *)&h->padded_rows;
        if (padded[q] < 0 || padded[q] > p.layout.max_rows || padded[q] % MOK_ROW_TILE) return false;
    }
    plan->peer_padded_rows = padded;
    return true;
}

/* One thread: the list into p.spans, published as it grows when `stream` (readers run beside the
 * build), then the complete word. False if it does not fit spans_cap: the word then holds the
 * spans that fit (streamed: some of their tasks may have run) or none, and the caller stops the
 * pass. */
static __device__ __noinline__ long long spans_build_call(const mok_plan *plan, mok_task_span *spans, long long cap,
                                                         uint64_t *published) {
    /* a call, not inlined: the megakernels' own code keeps its registers and stack (stream_spans) */
    return mok__spans_build_published(plan, spans, cap, published);
}

static __device__ bool list_build(const pass_params &p, const mok_plan *plan, bool stream) {
    long long n = spans_build_call(plan, p.spans, p.spans_cap, stream ? (uint64_t *)p.spans_published : nullptr);
    const bool ok = n >= 0;
    if (!ok) n = stream ? p.spans_cap : 0;
    st_release_gpu(p.spans_published, (unsigned long long)n << 1 | 1ull);
    return ok;
}

/* stream_spans: thread 0 of the pass's last CTA (a compute CTA: the comm CTAs come first, at most a
 * quarter of them) builds the list before it takes up its role, the rest of its CTA waiting; a
 * list that does not fit stops the pass (MOK_KERR_SCHEDULE and the abort flag). The pass's checks,
 * its comm CTA count and the context's tag stay in spans_kernel, ahead of the megakernel. The plan
 * and the peers' padded rows live in the CTA's dynamic shared memory (smem, before the CTA's role
 * lays it out), not on the stack, which every thread of the megakernel would reserve. */
struct stream_scratch {
    mok_plan plan;
    int64_t padded[MOK_MAX_RANKS];
};

static __device__ void stream_spans(const pass_params &p, const mok_sched_view &v, uint8_t *smem) {
    if (!p.stream_spans || blockIdx.x != gridDim.x - 1) return;
    if (threadIdx.x == 0) {
        stream_scratch *s = (stream_scratch *)smem;
        if (!pass_plan(p, v, &s->plan, s->padded) || !list_build(p, &s->plan, true)) {
            set_error(p.error, MOK_KERR_SCHEDULE);
            atomicExch(p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT, 1ull);
        }
    }
    __syncthreads();
}

/* Where a role's tickets stand in the span list: span g holds tickets [g_first, g_first + g_size);
 * spans [0, known) are published, all of them if complete. One thread's. */
struct task_cursor {
    long long g, g_first, g_size;
    int known, complete;
};
#define TASK_CURSOR_START {-1, 0, 0, 0, 0}

/* One thread: waits until span c.g is published, or the list is complete without it. False then,
 * or if the pass was aborted or the wait outlived the timeout (MOK_KERR_STALL and the abort flag,
 * as wait_counter_thread). One acquire load first (a list built before the pass is complete at
 * once); the spin while it is built is relaxed and ends with one acquire fence, as the counters'
 * (counters.cuh says why). */
static __device__ bool span_published(const pass_params &p, task_cursor &c) {
    unsigned long long w = ld_acquire_gpu(p.spans_published);
    if (!(w & 1) && (long long)(w >> 1) <= c.g) {
        const long long start = globaltimer_ns();
        unsigned long long *abort = p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT;
        while (!((w = ld_relaxed_gpu(p.spans_published)) & 1) && (long long)(w >> 1) <= c.g) {
            if (*(volatile unsigned long long *)abort) return false;
            if (globaltimer_ns() - start > p.timeout_ns) {
                set_error(p.error, MOK_KERR_STALL);
                atomicExch(abort, 1ull);
                return false;
            }
        }
        fence_acq_rel_gpu();
    }
    c.known = (int)(w >> 1);
    c.complete = (int)(w & 1);
    return c.g < c.known;
}

/* Moves the cursor to the span of ticket t (tickets only grow). False past the role's last span,
 * or if the pass stopped while it waited for the list. */
static __device__ bool cursor_seek(const pass_params &p, int role, task_cursor &c, long long t) {
    while (t >= c.g_first + c.g_size) {
        c.g_first += c.g_size;
        c.g_size = 0;
        do {
            if (++c.g >= c.known && !span_published(p, c)) return false;
        } while (p.spans[c.g].role != role);
        c.g_size = (long long)p.spans[c.g].num_tiles * p.spans[c.g].n_tiles;
    }
    return true;
}

/* Task `local` of a span: its row tile, sub-tile and the counter it waits on first. */
static __device__ __forceinline__ void task_decode(const mok_task_span &span, long long local, long long *rt,
                                                   long long *nt, long long *wait) {
    int64_t tile, sub;
    mok__span_tile(&span, local, &tile, &sub);
    *rt = tile;
    *nt = sub;
    *wait = span.wait[0] < 0 ? -1 : span.wait[0] + (span.wait_per_tile ? *rt - span.first_tile : 0);
}

#endif
