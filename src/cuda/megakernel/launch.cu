/* launch.cu — the launch sequence every pass shares on one rank's stream (mok__cuda_launch_pass),
 * and its two small kernels: sched_publish_kernel (the pass's schedule into the window, for
 * turned transfers) and spans_kernel (one thread: the checks of the pass's schedule and context,
 * the context's tag, and the pass's task list unless the megakernel builds it). */
#include "cuda/megakernel/task_list.cuh"

/* One thread: the pass's spans in the global order (core/tasks.inc), for the megakernel, unless it
 * builds them itself (stream_spans, task_list.cuh), and its comm CTA count; before them the checks
 * of the schedule (and a backward's context) against the pass (pass_refusal) and of the peers'
 * padded rows (pass_plan), and in a forward or recompute the context's tag. A refused pass, or one
 * behind an error already in the word, runs nothing (pass_start) and leaves the context's tag as
 * it was: the pass writes none of the context. */
__global__ void spans_kernel(pass_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    *p.spans_published = 0;
    *p.comm_dev = p.comm_ctas;
    long long found = 0, expected = 0;
    const int refusal = pass_refusal(p, v, &found, &expected);
    if (refusal) {
        set_error_values(p.error, refusal, found, expected);
        /* peers waiting on this rank's counters stop */
        atomicExch(p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT, 1ull);
        return;
    }
    if (*(volatile int *)p.error) return;
    mok_plan plan;
    int64_t padded[MOK_MAX_RANKS];
    if (!pass_plan(p, v, &plan, padded)) { /* a peer's padded rows out of range */
        set_error(p.error, MOK_KERR_SCHEDULE);
        /* peers waiting on this rank stop */
        atomicExch(p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT, 1ull);
        return;
    }
    if (!p.stream_spans && !list_build(p, &plan, false)) set_error(p.error, MOK_KERR_SCHEDULE);
    if (p.comm_auto) /* scaled by the rows this rank moves per FLOP, with turned transfers */
        *p.comm_dev = mok__cuda_comm_ctas_scaled(&plan, p.comm_ctas, p.comm_max, p.num_tokens * p.topk, v.header->routed_rows);
    /* NOTE: the tag of a context the megakernel is about to write (it runs when the word is clear
       here, this thread being the only one of the pass before it), ahead of its rows in stream
       order. A megakernel that stops in the middle (a timeout, a stall, a streamed list that
       does not fit) leaves the group unusable, so no backward reads a context whose tag is
       ahead of its rows. */
    if (!p.backward && *(volatile int *)p.error == 0)
        mok__context_tag_write(p.context_tag, p.workspace_tag, v.header->build, p.rank);
}

/* The schedule a pass runs, into the rank's window, where peers read it (turned transfers):
 * the arrays before the rows whole, the rows' peers and slots up to padded_rows. A schedule that
 * is not this workspace's gets its header only (spans_kernel refuses it on every rank): another
 * workspace's may be smaller than this one's layout. */
__global__ void sched_publish_kernel(mok_sched_layout layout, const char *schedule, char *out,
                                     unsigned long long workspace_tag) {
    const mok_sched_header *h = (const mok_sched_header *)schedule;
    const bool ours = h->magic == MOK_SCHED_MAGIC && h->workspace == workspace_tag;
    long long rows = ours ? h->padded_rows : 0;
    rows = rows < 0 ? 0 : rows > layout.max_rows ? layout.max_rows : rows;
    const long long head = ours ? (long long)layout.off_row_peer / 16 : (long long)(sizeof(mok_sched_header) + 15) / 16;
    const long long n = rows * 4 / 16;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < head + 2 * n; i += stride) {
        const long long b = i < head ? 16 * i
                            : i < head + n ? (long long)layout.off_row_peer + 16 * (i - head)
                                           : (long long)layout.off_row_slot + 16 * (i - head - n);
        *(int4 *)(out + b) = *(const int4 *)(schedule + b);
    }
    if (blockIdx.x == 0 && threadIdx.x < (rows * 4 % 16) / 4) { /* the rows past the last 16 bytes */
        const long long r = n * 4 + threadIdx.x;
        ((int32_t *)(out + layout.off_row_peer))[r] = ((const int32_t *)(schedule + layout.off_row_peer))[r];
        ((int32_t *)(out + layout.off_row_slot))[r] = ((const int32_t *)(schedule + layout.off_row_slot))[r];
    }
}

/* The launch sequence every pass shares, on one rank's stream, after its inputs are staged:
 * a pending clear of the error word (error_word.cu's NOTE), fresh counters (before the barrier:
 * with a turned transfer peers bump them once past it; the previous pass's closing barrier keeps
 * every peer off them until then), the schedule into the window (turned transfers), barrier (every
 * rank's inputs are in place; publishes T), the span list, the megakernel on every SM at once,
 * barrier (every push into this rank has landed, no peer reads its rings any more). `maps`: the
 * kernel's tensor maps (its second parameter), or NULL for a kernel that takes none. */
mok_status mok__cuda_launch_pass(mok_workspace *ws, int lr, const cuda_rank *R, pass_params *p, const void *kernel,
                                 int threads, size_t smem, cudaStream_t stream, int64_t num_tokens, const void *maps) {
    mok_status st = mok__cuda_error_word_clear(ws, lr, stream);
    if (st != MOK_OK) return st;
    CUDA_TRY(cudaMemsetAsync(R->counters, 0,
                             sizeof(unsigned long long) * (size_t)(R->counters_cap + MOK_COUNTER_EXTRA_SLOTS), stream));
    if (p->trace_count) CUDA_TRY(cudaMemsetAsync(p->trace_count, 0, sizeof(unsigned long long), stream));
    if (p->combine_pull || p->dispatch_pull || p->dispatch_push || p->combine_push)
        LAUNCH_TRY(sched_publish_kernel<<<R->num_sms, 256, 0, stream>>>(p->layout, (const char *)p->schedule,
                                                                        R->sym + p->off_sched, p->workspace_tag));
    st = mok__cuda_barrier(ws, lr, stream, num_tokens, 0, p->schedule);
    if (st != MOK_OK) return st;
    LAUNCH_TRY(spans_kernel<<<1, 1, 0, stream>>>(*p));
    void *kargs[] = {p, (void *)maps}; /* the kernel's second parameter, when it has one */
    CUDA_TRY(cudaLaunchCooperativeKernel(kernel, dim3(R->num_sms), dim3(threads), kargs, smem, stream));
    return mok__cuda_barrier(ws, lr, stream, -1, 1, p->schedule);
}
