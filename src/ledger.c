/* ledger.c — which schedule build each caller buffer holds, so that a pass refuses a schedule and a
 * context that do not belong together (a backward with no forward, or after the schedule was built
 * again, or with a context another workspace wrote) instead of computing garbage or reading past a
 * smaller context.
 *
 * The one idea: the record lives on the host, beside the workspace, not in the buffers. The buffers'
 * layouts stay as mok.h describes them, and no call waits for the device to read a tag. Each local
 * rank of a workspace keeps the MOK_LEDGER_ENTRIES schedules and contexts it used last; a buffer
 * the ledger does not know (an older one, or a copy) is let through unchecked, never refused.
 * A build is named by the number of its mok_schedule_build call on the workspace (every local
 * rank's part of one call has the same), so a pass's build also travels with its call to the peers
 * (mok_call.build). */
#include <stdio.h>

#include "internal.h"

typedef enum { SCHEDULES, CONTEXTS } table_kind;

static mok_ledger_entry *table(mok_ledger *ledger, table_kind kind) {
    return kind == SCHEDULES ? ledger->schedules : ledger->contexts;
}

static mok_ledger_entry *find(mok_ledger *ledger, table_kind kind, const void *ptr) {
    mok_ledger_entry *t = table(ledger, kind);
    for (int i = 0; i < MOK_LEDGER_ENTRIES; ++i)
        if (t[i].ptr == ptr) return &t[i];
    return NULL;
}

/* The same local rank's ledger of every other live workspace of the group that knows ptr. */
static const mok_workspace *elsewhere(const mok_workspace *ws, int r, table_kind kind, const void *ptr) {
    for (const mok_workspace *o = ws->group->workspaces; o; o = o->next)
        if (o != ws && find(&o->ledgers[r], kind, ptr)) return o;
    return NULL;
}

/* Forgets ptr in rank r's tables of every workspace of the group: its buffer now holds something
 * else. */
static void forget(mok_workspace *ws, int r, const void *ptr) {
    for (mok_workspace *o = ws->group->workspaces; o; o = o->next)
        for (int kind = SCHEDULES; kind <= CONTEXTS; ++kind) {
            mok_ledger_entry *e = find(&o->ledgers[r], (table_kind)kind, ptr);
            if (e) e->ptr = NULL;
        }
}

static mok_ledger_entry *insert(mok_ledger *ledger, table_kind kind, const void *ptr) {
    mok_ledger_entry *t = table(ledger, kind), *slot = &t[0];
    for (int i = 0; i < MOK_LEDGER_ENTRIES; ++i) {
        if (!t[i].ptr) {
            slot = &t[i];
            break;
        }
        if (t[i].stamp < slot->stamp) slot = &t[i];
    }
    slot->ptr = ptr;
    slot->build = 0;
    slot->forwarded = 0;
    slot->stamp = ++ledger->stamp;
    return slot;
}

void mok__ledger_schedule_built(mok_workspace *ws, int r, const void *schedule, int64_t build, int ok) {
    forget(ws, r, schedule);
    if (!ok) return;
    mok_ledger_entry *e = insert(&ws->ledgers[r], SCHEDULES, schedule);
    e->build = build;
}

mok_status mok__ledger_check(mok_workspace *ws, int r, const void *schedule, const void *context, int backward,
                             int64_t *build) {
    mok_ledger *ledger = &ws->ledgers[r];
    *build = 0;
    mok_ledger_entry *s = find(ledger, SCHEDULES, schedule);
    if (s) {
        s->stamp = ++ledger->stamp;
        *build = s->build;
    } else {
        const mok_workspace *o = elsewhere(ws, r, SCHEDULES, schedule);
        if (o)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "args[%d].schedule: built on workspace #%lld of this group, not on this one (#%lld)", r,
                             (long long)o->index, (long long)ws->index);
    }
    if (!backward) return MOK_OK;
    if (s && !s->forwarded)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "args[%d].schedule: no mok_forward or mok_recompute_context ran with this schedule (build "
                         "#%lld) on this workspace; the backward reads the context such a pass writes (was the "
                         "schedule built again after its forward?)",
                         r, (long long)s->build);
    mok_ledger_entry *c = find(ledger, CONTEXTS, context);
    if (c) {
        c->stamp = ++ledger->stamp;
        if (s && c->build && c->build != s->build)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "args[%d].context: written by a pass with schedule build #%lld, but args[%d].schedule "
                             "holds build #%lld (was the schedule built again, or the context written again, after "
                             "the forward?)",
                             r, (long long)c->build, r, (long long)s->build);
        return MOK_OK;
    }
    const mok_workspace *o = elsewhere(ws, r, CONTEXTS, context);
    if (o)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "args[%d].context: written by a pass on workspace #%lld of this group, not on this one "
                         "(#%lld); its size and layout are that workspace's",
                         r, (long long)o->index, (long long)ws->index);
    return MOK_OK;
}

void mok__ledger_pass_done(mok_workspace *ws, int r, const void *schedule, const void *context, int64_t build,
                           int ok) {
    forget(ws, r, context);
    if (!ok) return; /* the context holds part of a pass: unknown, as a buffer never written */
    mok_ledger_entry *s = find(&ws->ledgers[r], SCHEDULES, schedule);
    if (s) s->forwarded = 1;
    mok_ledger_entry *c = insert(&ws->ledgers[r], CONTEXTS, context);
    c->build = build;
}
