/* tags.c — the host's side of the tags that tie a schedule and a context to the pass that reads
 * them (core/schedule.h says what each holds): a workspace's tag, and the message of a check that
 * failed, for both backends (the cpu checks on the host before a pass, the cuda device reports
 * its finding through the error word).
 *
 * The one idea: what a buffer holds is written in the buffer, not remembered beside its address,
 * so a copy is accepted and an address that another buffer had before means nothing (allocators
 * hand freed addresses out again all the time). */
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

#include "internal.h"

/* NOTE: unique in the process for the life of every workspace: a counter that never repeats (2^40
 * creations), above it the process id (below 2^22 on Linux), so that a buffer another process
 * wrote is not taken for this one's either. Never 0, the tag of no workspace. */
uint64_t mok__workspace_tag(void) {
    static _Atomic uint64_t created;
    const uint64_t count = atomic_fetch_add(&created, 1) + 1;
    return ((uint64_t)getpid() << 40) | (count & ((1ull << 40) - 1));
}

/* "workspace #i of this group" for a workspace tag, or what it can say of a tag no live
 * workspace of the group has. */
static void describe_workspace(const mok_workspace *ws, uint64_t tag, char *out, size_t size) {
    for (const mok_workspace *o = ws->group->workspaces; o; o = o->next)
        if (o->tag == tag) {
            snprintf(out, size, "workspace #%lld of this group", (long long)o->index);
            return;
        }
    snprintf(out, size, "a workspace that is not one of this group's live workspaces (destroyed, or of another group)");
}

mok_status mok__tag_refuse(const mok_workspace *ws, const char *args, int local_rank, int code, int64_t found,
                           int64_t expected) {
    char schedule[64], context[64], other[160];
    snprintf(schedule, sizeof schedule, "%s%sschedule", args ? args : "", args ? "." : "");
    snprintf(context, sizeof context, "%s%scontext", args ? args : "", args ? "." : "");
    const long long index = (long long)ws->index, rank = (long long)(ws->group->first_rank + local_rank);
    switch (code) {
    case MOK_TAG_SCHEDULE_WORKSPACE:
        describe_workspace(ws, (uint64_t)found, other, sizeof other);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: built on %s, not on this one (#%lld)", schedule, other, index);
    case MOK_TAG_SCHEDULE_RANK:
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: built for rank %lld, not for local rank %d (rank %lld) of this "
                         "workspace", schedule, (long long)found, local_rank, rank);
    case MOK_TAG_CONTEXT_MISSING:
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "%s: holds no context tag: no mok_forward or mok_recompute_context wrote it (the backward "
                         "reads the context such a pass writes with its schedule build)",
                         context);
    case MOK_TAG_CONTEXT_WORKSPACE:
        describe_workspace(ws, (uint64_t)found, other, sizeof other);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "%s: written by a pass on %s, not on this one (#%lld); its size and layout are that "
                         "workspace's",
                         context, other, index);
    case MOK_TAG_CONTEXT_RANK:
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "%s: written by rank %lld's pass, not by local rank %d's (rank %lld)", context,
                         (long long)found, local_rank, rank);
    case MOK_TAG_CONTEXT_BUILD:
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "%s: written by a forward (or recompute) with schedule build #%lld, but %s holds build #%lld "
                         "(was the schedule built again after the forward, or is the context another layer call's?)",
                         context, (long long)found, schedule, (long long)expected);
    }
    return mok__fail(MOK_ERR_INTERNAL, "%s, %s: tag check %d", schedule, context, code);
}
