/* ops.c — the cpu backend's table of entry points (backend.h), and the entry points that belong
 * to no other file: its group ids, the group's poisoning as a call sees it, and the refusal of a
 * collective call that the peers must hear of. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu.h"

int mok__cpu_device_count(void) { return 1; }

/* Ranks are threads of this process: the id only has to be unique within it. */
mok_status mok__cpu_unique_id(mok_unique_id *id) {
    static _Atomic unsigned long long counter;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long words[4] = {0x6d6f6b6370750000ull, (unsigned long long)getpid(),
                                   (unsigned long long)now.tv_sec * 1000000000ull + (unsigned long long)now.tv_nsec,
                                   ++counter};
    memcpy(id->bytes, words, sizeof words);
    return MOK_OK;
}

mok_status mok__cpu_group_check(const mok_group *g) {
    return mok__cpu_poisoned(g) ? mok__cpu_poisoned_error(g, g->first_rank) : MOK_OK;
}

/* One rank of several per handle: its peers are (or soon will be) waiting in the call's first
 * barrier; it arrives there with "rejected". In local mode every rank refuses alike in one
 * thread, and after a timeout the barrier is not met again. */
mok_status mok__cpu_refuse(mok_group *g, const mok_call *call, mok_status status) {
    if (!(g->num_local_ranks == 1 && g->nranks > 1) || g->failed) return status;
    char message[1024];
    snprintf(message, sizeof message, "%s", mok_last_error());
    return mok__cpu_settle(status, message, mok__cpu_barrier(g, 0, call, 0));
}

const mok_backend_ops mok__cpu_ops = {
    .backend = MOK_BACKEND_CPU,
    .device_count = mok__cpu_device_count,
    .unique_id = mok__cpu_unique_id,
    .group_create = mok__cpu_group_create,
    .group_destroy = mok__cpu_group_destroy,
    .group_check = mok__cpu_group_check,
    .refuse = mok__cpu_refuse,
    .workspace_create = mok__cpu_workspace_create,
    .workspace_destroy = mok__cpu_workspace_destroy,
    .schedule_build = mok__cpu_schedule_build,
    .schedule_read = mok__cpu_schedule_read,
    .forward = mok__cpu_forward,
    .backward = mok__cpu_backward,
    .quantize_weights = mok__cpu_quantize_weights,
    .trace_write = mok__cpu_trace_write,
    .memory_alloc = mok__cpu_memory_alloc,
    .memory_free = mok__cpu_memory_free,
    .memory_copy = mok__cpu_memory_copy,
    .synchronize = mok__cpu_synchronize,
};
