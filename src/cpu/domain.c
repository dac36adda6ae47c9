/* domain.c — how emulated ranks find each other and wait for each other: the process-wide
 * registry of domains (one per unique id), group creation, and the cross-rank barrier.
 *
 * NOTE: the barrier is an epoch counter per rank that only grows. A rank publishes "reached
 * epoch e" with a release store and waits for every peer's counter to reach e with acquire
 * loads, so everything a peer wrote before its arrival (staged inputs, pushed rows) is visible
 * after the barrier. Every wait is bounded by config.peer_timeout_ms. */
#include <sched.h>
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
    if (--d->refs == 0) {
        if (d->registered) {
            cpu_domain **p = &registry;
            while (*p && *p != d) p = &(*p)->next;
            if (*p) *p = d->next;
        }
        free(d);
    }
    pthread_mutex_unlock(&registry_lock);
    free(cg);
    g->impl = NULL;
}

mok_status mok__cpu_barrier(mok_group *g, int local_rank, int ok) {
    cpu_group *cg = g->impl;
    cpu_domain *d = cg->domain;
    int rank = g->first_rank + local_rank;
    uint64_t epoch = ++cg->epoch[local_rank];
    if (!ok) atomic_store_explicit(&d->rejected[rank], epoch, memory_order_relaxed);
    atomic_store_explicit(&d->arrived[rank], epoch, memory_order_release);
    int64_t deadline = mok__cpu_now_ns() + (int64_t)(g->config.peer_timeout_ms * 1e6);
    for (int p = 0; p < d->nranks; ++p) {
        int round = 0;
        while (atomic_load_explicit(&d->arrived[p], memory_order_acquire) < epoch) {
            if (mok__cpu_now_ns() > deadline) {
                g->failed = 1;
                return mok__fail(MOK_ERR_TIMEOUT, "rank %d: rank %d did not arrive within peer_timeout_ms = %.0f",
                                 rank, p, g->config.peer_timeout_ms);
            }
            backoff(&round);
        }
    }
    if (!ok) return MOK_ERR_INVALID_ARGUMENT; /* the caller has set the message */
    for (int p = 0; p < d->nranks; ++p)
        if (atomic_load_explicit(&d->rejected[p], memory_order_relaxed) == epoch)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT, "rank %d: peer rank %d rejected its arguments of this call", rank,
                             p);
    return MOK_OK;
}
