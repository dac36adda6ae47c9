/* task_list.cuh — the pass's task list on the device: spans_kernel builds its spans in the
 * global order (core/tasks.inc) with one thread, and every CTA maps the tickets it claims to
 * tasks of its role's spans.
 *
 * NOTE: a CTA takes tickets of its role (comm or compute) in increasing order and maps each to a
 * task of its role's spans in the global order; a task waits only on counters bumped by earlier
 * tasks. With every CTA resident (cooperative launch) the pass cannot deadlock. */
#ifndef MOK_CUDA_MEGAKERNEL_TASK_LIST_CUH
#define MOK_CUDA_MEGAKERNEL_TASK_LIST_CUH

#include "cuda/megakernel/counters.cuh"

/* Where a role's tickets stand in the span list: span g holds tickets [g_first, g_first + g_size). */
struct task_cursor {
    long long g, g_first, g_size;
};

/* Moves the cursor to the span of ticket t (tickets only grow). False past the role's last span. */
static __device__ bool cursor_seek(const pass_params &p, int role, long long num_spans, task_cursor &c, long long t) {
    while (t >= c.g_first + c.g_size) {
        c.g_first += c.g_size;
        c.g_size = 0;
        while (++c.g < num_spans && p.spans[c.g].role != role) {
        }
        if (c.g >= num_spans) return false;
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
