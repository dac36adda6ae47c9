/* domain.c — how emulated ranks find each other and wait for each other: the process-wide
 * registry of domains (one per unique id), group creation, and the cross-rank barrier.
 *
 * NOTE: the barrier is an epoch counter per rank that only grows. A rank publishes "reached
 * epoch e" with a release store and waits for every peer's counter to reach e with acquire
 * loads, so everything a peer wrote before its arrival (staged inputs, pushed rows) is visible
 * after the barrier. Every wait is bounded by config.peer_timeout_ms.
 *
 * NOTE: a barrier is a consensus. Each rank publishes, with its arrival, the call it is in
 * (mok_call) and whether it rejected its arguments; once every rank has arrived, every rank reads
 * the same calls and flags and so takes the same decision: go on, or fail the call (a peer
 * rejected, or a peer is in another call). Nothing of a peer's region is touched before a barrier
 * that all ranks passed with the same call, so a mismatch costs nothing but the call. Only a
 * timeout breaks the consensus (a peer may arrive just after this rank gave up): it poisons the
 * domain (cpu.h). */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu.h"

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static cpu_domain *registry;

int64_t mok__cpu_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* Spin politely: yield first, then sleep a little longer each round (ranks are threads that
 * may outnumber the cores). */
static void backoff(int *round) {
    if (*round < 64) {
        sched_yield();
    } else {
        struct timespec ts = {0, *round < 1024 ? 20000 : 200000};
        nanosleep(&ts, NULL);
    }
    ++*round;
}

static cpu_domain *domain_new(int nranks, const mok_unique_id *id) {
    cpu_domain *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->nranks = nranks;
    if (id) d->id = *id;
    return d;
}

mok_status mok__cpu_group_create(mok_group *g, int rank, const mok_unique_id *id, const int *devices) {
    (void)devices;
    cpu_group *cg = calloc(1, sizeof *cg);
    if (!cg) return mok__fail(MOK_ERR_OUT_OF_MEMORY, "group: out of host memory");
    if (!id) {
        cg->domain = domain_new(g->nranks, NULL);
        if (!cg->domain) {
            free(cg);
            return mok__fail(MOK_ERR_OUT_OF_MEMORY, "group: out of host memory");
        }
        cg->domain->refs = 1;
        atomic_store(&cg->domain->joined, g->nranks);
        g->impl = cg;
        return MOK_OK;
    }
    pthread_mutex_lock(&registry_lock);
    cpu_domain *d = registry;
    while (d && memcmp(&d->id, id, sizeof *id) != 0) d = d->next;
    if (d && d->nranks != g->nranks) {
        pthread_mutex_unlock(&registry_lock);
        free(cg);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "nranks: %d differs from the %d that another rank joined with",
                         g->nranks, d->nranks);
    }
    if (d && d->claimed[rank]) {
        pthread_mutex_unlock(&registry_lock);
        free(cg);
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "rank: %d is already held by another mok_group_create with this id (each rank joins once)",
                         rank);
    }
    if (!d) {
        d = domain_new(g->nranks, id);
        if (!d) {
            pthread_mutex_unlock(&registry_lock);
            free(cg);
            return mok__fail(MOK_ERR_OUT_OF_MEMORY, "group: out of host memory");
        }
        d->registered = 1;
        d->next = registry;
        registry = d;
    }
    d->refs += 1;
    d->claimed[rank] = 1;
    atomic_fetch_add(&d->joined, 1);
    pthread_mutex_unlock(&registry_lock);
    cg->domain = d;
    g->impl = cg;

    /* Wait for every rank to join. */
    int64_t deadline = mok__cpu_now_ns() + (int64_t)(g->config.peer_timeout_ms * 1e6);
    int round = 0;
    while (atomic_load(&d->joined) < g->nranks) {
        if (mok__cpu_now_ns() > deadline) {
            int joined = atomic_load(&d->joined);
            mok__cpu_group_destroy(g);
            g->impl = NULL;
            return mok__fail(MOK_ERR_TIMEOUT, "group: only %d of %d ranks joined within peer_timeout_ms = %.0f", joined,
                             g->nranks, g->config.peer_timeout_ms);
        }
        backoff(&round);
    }
    return MOK_OK;
}

void mok__cpu_group_destroy(mok_group *g) {
    cpu_group *cg = g->impl;
    if (!cg) return;
    cpu_domain *d = cg->domain;
    pthread_mutex_lock(&registry_lock);
    if (d->registered) d->claimed[g->first_rank] = 0;
    if (--d->refs == 0) {
        if (d->registered) {
            cpu_domain **p = &registry;
            while (*p && *p != d) p = &(*p)->next;
            if (*p) *p = d->next;
        }
        /* No handle is left, so no rank can be inside a pass: the kept regions can go. */
        while (d->graveyard) {
            cpu_grave *grave = d->graveyard;
            d->graveyard = grave->next;
            free(grave->region);
            free(grave);
        }
        free(d);
    }
    pthread_mutex_unlock(&registry_lock);
    free(cg);
    g->impl = NULL;
}

void mok__cpu_poison(mok_group *g, int rank, int reason) {
    cpu_domain *d = ((cpu_group *)g->impl)->domain;
    int none = 0;
    atomic_compare_exchange_strong(&d->poisoned, &none, CPU_POISON_WORD(rank, reason));
    g->failed = 1;
}

int mok__cpu_poisoned(const mok_group *g) {
    const cpu_group *cg = g->impl;
    return cg ? atomic_load(&cg->domain->poisoned) : 0;
}

mok_status mok__cpu_poisoned_error(const mok_group *g, int rank) {
    cpu_domain *d = ((cpu_group *)g->impl)->domain;
    const int word = atomic_load(&d->poisoned), by = CPU_POISON_RANK(word), reason = CPU_POISON_REASON(word);
    ((mok_group *)g)->failed = 1;
    if (by == rank)
        return mok__fail(MOK_ERR_STATE, "rank %d: the group is unusable after this rank's earlier %s; destroy its "
                         "workspaces and the group", rank,
                         reason == CPU_POISON_DESTROY ? "workspace destroy out of step with its peers" : "timeout");
    return mok__fail(MOK_ERR_STATE,
                     "rank %d: the group is unusable: rank %d %s; destroy its workspaces and the group", rank, by,
                     reason == CPU_POISON_DESTROY ? "destroyed a workspace out of step with its peers"
                                                  : "timed out waiting for a peer");
}

void mok__cpu_bury(mok_group *g, void *region) {
    if (!region) return;
    cpu_domain *d = ((cpu_group *)g->impl)->domain;
    cpu_grave *grave = malloc(sizeof *grave);
    pthread_mutex_lock(&registry_lock);
    if (grave) {
        grave->region = region;
        grave->next = d->graveyard;
        d->graveyard = grave;
    }
    pthread_mutex_unlock(&registry_lock);
    /* Without a node the region is leaked for good rather than freed under a peer. */
}

mok_status mok__cpu_settle(mok_status own, const char *own_message, mok_status barrier) {
    const int own_fatal = own == MOK_ERR_TIMEOUT || own == MOK_ERR_STATE;
    if (!own_fatal && (barrier == MOK_ERR_TIMEOUT || barrier == MOK_ERR_STATE)) {
        char theirs[1024];
        snprintf(theirs, sizeof theirs, "%s", mok_last_error());
        return mok__fail(barrier, "%s (this rank had refused the call: %s)", theirs, own_message);
    }
    return mok__fail(own, "%s", own_message);
}

static int calls_agree(const mok_call *a, const mok_call *b) {
    return a->kind == b->kind && a->step == b->step && a->workspace == b->workspace && a->seq == b->seq &&
           a->digest == b->digest && (a->build == 0 || b->build == 0 || a->build == b->build);
}

mok_status mok__cpu_barrier(mok_group *g, int local_rank, const mok_call *call, int ok) {
    cpu_group *cg = g->impl;
    cpu_domain *d = cg->domain;
    int rank = g->first_rank + local_rank;
    uint64_t epoch = ++cg->epoch[local_rank];
    d->calls[epoch & 1][rank] = *call;
    if (!ok) atomic_store_explicit(&d->rejected[rank], epoch, memory_order_relaxed);
    atomic_store_explicit(&d->arrived[rank], epoch, memory_order_release);
    int64_t deadline = mok__cpu_now_ns() + (int64_t)(g->config.peer_timeout_ms * 1e6);
    for (int p = 0; p < d->nranks; ++p) {
        int round = 0;
        while (atomic_load_explicit(&d->arrived[p], memory_order_acquire) < epoch) {
            if (atomic_load_explicit(&d->poisoned, memory_order_relaxed)) return mok__cpu_poisoned_error(g, rank);
            if (mok__cpu_now_ns() > deadline) {
                char what[160];
                mok__call_describe(call, what, sizeof what);
                mok__cpu_poison(g, rank, CPU_POISON_TIMEOUT);
                return mok__fail(MOK_ERR_TIMEOUT,
                                 "rank %d: rank %d did not arrive within peer_timeout_ms = %.0f (this rank is in %s)",
                                 rank, p, g->config.peer_timeout_ms, what);
            }
            backoff(&round);
        }
    }
    /* The consensus of this epoch first: a peer that poisons the domain after this barrier (its
       destroy met another call here) has read the same calls. */
    for (int p = 0; p < d->nranks; ++p) {
        const mok_call *theirs = &d->calls[epoch & 1][p];
        if (calls_agree(theirs, call)) continue;
        char mine[160], other[160];
        mok__call_describe(call, mine, sizeof mine);
        mok__call_describe(theirs, other, sizeof other);
        if (theirs->digest != call->digest && theirs->kind == call->kind && theirs->workspace == call->workspace)
            snprintf(other + strlen(other), sizeof other - strlen(other), " of another shape or config");
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "call: rank %d is in %s while this rank (%d) is in %s; every rank makes the same collective "
                         "calls in the same order",
                         p, other, rank, mine);
    }
    /* A peer that timed out here had arrived before it gave up: its region may go at any time. */
    if (atomic_load(&d->poisoned)) return mok__cpu_poisoned_error(g, rank);
    if (!ok) return MOK_ERR_INVALID_ARGUMENT; /* the caller has set the message */
    for (int p = 0; p < d->nranks; ++p)
        if (atomic_load_explicit(&d->rejected[p], memory_order_relaxed) == epoch)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT, "rank %d: peer rank %d rejected its arguments of this call", rank,
                             p);
    return MOK_OK;
}
