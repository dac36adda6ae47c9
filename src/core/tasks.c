/* tasks.c — the task list for the host library: the portable definitions (tasks.inc) with
 * external linkage, and the host-only checks that replay a list (mok__tasks_check,
 * mok__tasks_check_ranks) for the cpu backend and the tests. */
#include "tasks.inc"

int64_t mok__tasks_check(const mok_task *tasks, int64_t count, int64_t num_counters, int64_t *scratch) {
    /* Replays the list in order with counters that only grow: a wait whose target is not met by
       the tasks before it would wait on a later task (or forever). */
    for (int64_t c = 0; c < num_counters; ++c) scratch[c] = 0;
    for (int64_t i = 0; i < count; ++i) {
        for (int w = 0; w < 2; ++w) {
            int32_t c = tasks[i].wait[w];
            if (c < 0) continue;
            if (c >= num_counters || scratch[c] < tasks[i].target[w]) return i + 1;
        }
        for (int d = 0; d < 2; ++d) {
            int32_t c = tasks[i].done[d];
            if (c >= num_counters) return i + 1;
            if (c >= 0) scratch[c] += 1;
        }
    }
    return 0;
}

/* One worker per (rank, role): the head of each role's subsequence runs when its waits are met.
 * Rounds over all heads until a round makes no progress. */
int64_t mok__tasks_check_ranks(int nranks, const mok_task *const *tasks, const int64_t *counts,
                               const int64_t *num_counters, int64_t *const *counters,
                               void (*on_run)(void *ctx, int rank, int64_t index), void *ctx) {
    int64_t cursor[MOK_MAX_RANKS][2], done = 0;
    for (int r = 0; r < nranks; ++r) {
        cursor[r][0] = cursor[r][1] = 0;
        for (int64_t c = 0; c < num_counters[r]; ++c) counters[r][c] = 0;
    }
    for (int progress = 1; progress;) {
        progress = 0;
        for (int r = 0; r < nranks; ++r)
            for (int role = 0; role < 2; ++role) {
                for (;;) {
                    int64_t *i = &cursor[r][role];
                    while (*i < counts[r] && tasks[r][*i].role != role) ++*i;
                    if (*i >= counts[r]) break;
                    const mok_task *t = &tasks[r][*i];
                    int ready = 1;
                    for (int w = 0; w < 2 && ready; ++w) {
                        if (t->wait[w] < 0) continue;
                        const int q = w == 0 && t->wait_peer >= 0 ? t->wait_peer : r;
                        ready = q < nranks && t->wait[w] < num_counters[q] && counters[q][t->wait[w]] >= t->target[w];
                    }
                    if (!ready) break;
                    if (on_run) on_run(ctx, r, *i);
                    for (int d = 0; d < 2; ++d) {
                        if (t->done[d] < 0) continue;
                        const int q = d == 0 && t->done_peer >= 0 ? t->done_peer : r;
                        if (q < nranks && t->done[d] < num_counters[q]) counters[q][t->done[d]] += 1;
                    }
                    ++*i;
                    ++done;
                    progress = 1;
                }
            }
    }
    return done;
}
