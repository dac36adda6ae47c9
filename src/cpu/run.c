/* run.c — one collective pass on the cpu backend. Per local rank: stage the inputs into the
 * symmetric region, cross-rank barrier, workers walk the task list (comm and compute roles),
 * cross-rank barrier (every push into this rank has landed), then the fixed-order epilogue.
 * In local mode one thread per rank runs this concurrently; the ranks only meet at barriers. */
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

typedef struct rank_job {
    mok_workspace *ws;
    int local_rank;
    int kind; /* enum mok_pass_kind (core/plan.h), or -1 for a schedule build */
    const void *args;
    mok_status status;
    char message[1024];
} rank_job;

/* ---- task execution ------------------------------------------------------------------------ */

/* The counters a task's wait[0] / done[0] names: this rank's, or peer q's (in q's region). */
static _Atomic int64_t *counters_of(const cpu_pass *pass, int q) {
    return q < 0 ? pass->R->counters : (_Atomic int64_t *)(pass->R->peers[q] + pass->cw->sym.counters);
}

/* Stops this rank's pass: its workers stop waiting, and so do peers' workers waiting on it. */
static void abort_pass(const cpu_pass *pass) {
    atomic_store(&pass->R->abort, 1);
    atomic_store((_Atomic int32_t *)(pass->R->region + pass->cw->sym.failed), 1);
}

/* Records why a wait gave up (the first reason wins) and stops the pass. */
static int give_up(const cpu_pass *pass, int why, int q, int32_t counter) {
    int none = CPU_WAIT_OK;
    if (atomic_compare_exchange_strong(&pass->R->wait_failed, &none, why)) {
        atomic_store(&pass->R->wait_counter, counter);
        atomic_store(&pass->R->wait_peer, q);
    }
    abort_pass(pass);
    return 0;
}

/* Spins until counters[counter] >= target (peer q's counters for q >= 0); 0 if this rank's pass
 * stopped, peer q's pass failed, the group was poisoned or the wait outlived its deadline.
 * NOTE: a wait on a peer's counter gives up peer_timeout_ms after it began. A wait on this rank's
 * own counters gives up when, for peer_timeout_ms, neither that counter moved nor this rank
 * finished a task: the rank's own work, however long, is not a peer's hang, while a rank that
 * makes no progress at all is stuck (its own counters may wait on peers too, with turned
 * transfers). */
static int wait_counter(const cpu_pass *pass, int q, int32_t counter, int32_t target) {
    if (counter < 0) return 1;
    cpu_rank *R = pass->R;
    _Atomic int64_t *counters = counters_of(pass, q);
    _Atomic int32_t *peer_failed = q < 0 ? NULL : (_Atomic int32_t *)(R->peers[q] + pass->cw->sym.failed);
    const cpu_domain *d = ((const cpu_group *)pass->ws->group->impl)->domain;
    const int64_t timeout_ns = (int64_t)(pass->ws->config.peer_timeout_ms * 1e6);
    int64_t since = 0, seen = -1, value;
    int round = 0;
    while ((value = atomic_load_explicit(&counters[counter], memory_order_acquire)) < target) {
        if (atomic_load_explicit(&R->abort, memory_order_relaxed)) return 0;
        if (peer_failed && atomic_load_explicit(peer_failed, memory_order_relaxed))
            return give_up(pass, CPU_WAIT_PEER_FAILED, q, counter);
        if (++round <= 64) continue;
        sched_yield();
        if ((round & 63) != 0) continue;
        if (atomic_load_explicit(&d->poisoned, memory_order_relaxed)) return give_up(pass, CPU_WAIT_POISONED, q, counter);
        const int64_t now = mok__cpu_now_ns();
        if (!since) since = now;
        if (q < 0 || q == R->rank) {
            const int64_t progress = atomic_load_explicit(&R->progress_ns, memory_order_relaxed);
            if (value != seen) seen = value, since = now;
            if (progress > since) since = progress;
        }
        if (now - since > timeout_ns) return give_up(pass, CPU_WAIT_TIMEOUT, q, counter);
    }
    return 1;
}

static void *worker_main(void *arg) {
    cpu_worker *job = arg;
    cpu_pass *pass = job->pass;
    cpu_rank *R = pass->R;
    const cpu_domain *domain = ((const cpu_group *)pass->ws->group->impl)->domain;
    float *scratch = R->scratch + (size_t)job->worker * R->scratch_floats;
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&R->cursor[job->role], 1, memory_order_relaxed);
        if (i >= R->num_tasks) break;
        const mok_task *t = &R->tasks[i];
        if (t->role != job->role) continue;
        /* A failed pass (here, on a peer whose counter a wait named, or a poisoned group) runs
           no more tasks: its peers are stopping too. */
        if (atomic_load_explicit(&R->abort, memory_order_relaxed)) break;
        if (atomic_load_explicit(&domain->poisoned, memory_order_relaxed)) {
            give_up(pass, CPU_WAIT_POISONED, -1, -1);
            break;
        }
        if (!wait_counter(pass, t->wait_peer, t->wait[0], t->target[0]) ||
            !wait_counter(pass, -1, t->wait[1], t->target[1])) {
            abort_pass(pass); /* a task of this rank will not run: the pass has failed */
            break;
        }
        int64_t start = R->trace ? mok__cpu_now_ns() : 0;
        if (pass->kind == MOK_PASS_BACKWARD) mok__cpu_run_backward_task(pass, t, scratch);
        else mok__cpu_run_forward_task(pass, t, scratch);
        if (R->trace) {
            const int slot = cpu_trace_pass(pass->kind);
            int64_t n = atomic_fetch_add(&R->trace_count[slot], 1);
            if (n < R->trace_cap)
                R->trace[slot * R->trace_cap + n] = (mok_trace_event){.kind = t->kind,
                                                .worker = (int16_t)job->worker,
                                                .minibatch = t->minibatch,
                                                .rank = (int16_t)R->rank,
                                                .comm = job->role == MOK_ROLE_COMM,
                                                .gemm_ns = 0,
                                                .epi_ns = 0,
                                                .start_ns = start,
                                                .end_ns = mok__cpu_now_ns()};
        }
        atomic_store_explicit(&R->progress_ns, mok__cpu_now_ns(), memory_order_relaxed);
        /* NOTE: release: the tile's writes are visible to whoever acquires this counter (a peer's
           counter too, with combine_pull). */
        for (int d = 0; d < 2; ++d)
            if (t->done[d] >= 0)
                atomic_fetch_add_explicit(&counters_of(pass, d == 0 ? t->done_peer : -1)[t->done[d]], 1,
                                          memory_order_release);
    }
    return NULL;
}

static mok_status run_workers(cpu_pass *pass) {
    cpu_workspace *cw = pass->cw;
    cpu_worker *jobs = pass->R->jobs;
    pthread_t *threads = pass->R->threads;
    int n = cw->workers;
    for (int w = 0; w < n; ++w) jobs[w] = (cpu_worker){pass, w, w < cw->comm_workers ? MOK_ROLE_COMM : MOK_ROLE_COMPUTE};
    int started = 1;
    for (int w = 1; w < n; ++w, ++started)
        if (pthread_create(&threads[w], NULL, worker_main, &jobs[w]) != 0) break;
    if (started < n) {
        /* Too few threads for both roles would leave tasks unclaimed: stop the ones we have. */
        abort_pass(pass);
        for (int w = 1; w < started; ++w) pthread_join(threads[w], NULL);
        return mok__fail(MOK_ERR_BACKEND, "cpu backend: could not start %d worker threads", n);
    }
    worker_main(&jobs[0]);
    for (int w = 1; w < n; ++w) pthread_join(threads[w], NULL);
    return MOK_OK;
}

/* ---- passes ---------------------------------------------------------------------------------- */

/* What of a schedule's contents breaks the bounds the tasks rely on (every index they take from it
 * stays inside the ring, the peers' buffers and the task list's capacity), or NULL. A buffer that
 * was written after its build must not make a pass read or write out of bounds; this costs one
 * pass over the padded rows. */
static const char *schedule_rows_broken(const cpu_pass *pass) {
    const mok_workspace *ws = pass->ws;
    const mok_sched_view *v = &pass->sched;
    const mok_sched_header *h = v->header;
    const int P = ws->group->nranks, L = (int)ws->num_local_experts;
    const int64_t k = ws->shape.topk, padded = h->padded_rows;
    /* a build of this workspace is one of its calls before this one; the call's barriers carry it */
    if (h->build < 1 || h->build >= ws->calls) return "its build number";
    if (padded < 0 || padded > ws->sched_layout.max_rows || padded % MOK_ROW_TILE != 0) return "padded_rows";
    for (int p = 0; p < P; ++p)
        if (h->num_tokens[p] < 0 || h->num_tokens[p] > ws->shape.max_tokens) return "a rank's num_tokens";
    if (v->expert_start[0] != 0 || v->expert_start[L] != padded) return "the experts' segments";
    for (int l = 0; l < L; ++l) {
        const int64_t start = v->expert_start[l], n = v->expert_rows[l];
        if (n < 0 || n > padded || v->expert_start[l + 1] - start != (n + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE)
            return "the experts' segments";
        for (int64_t row = start; row < start + n; ++row) {
            const int32_t p = v->row_peer[row], slot = v->row_slot[row];
            if (p < 0 || p >= P || slot < 0 || slot >= h->num_tokens[p] * k) return "a row's source rank or slot";
        }
        for (int64_t row = start + n; row < v->expert_start[l + 1]; ++row)
            if (v->row_peer[row] != -1) return "a padding row";
    }
    return NULL;
}

static mok_status refuse_tag(const cpu_pass *pass, int code, int64_t found, int64_t expected) {
    char args[32];
    snprintf(args, sizeof args, "args[%d]", pass->local_rank);
    return mok__tag_refuse(pass->ws, args, pass->local_rank, code, found, expected);
}

static mok_status read_schedule(cpu_pass *pass, const void *schedule, int64_t num_tokens) {
    mok_workspace *ws = pass->ws;
    pass->sched = mok__sched_view(&ws->sched_layout, (void *)schedule);
    const mok_sched_header *h = pass->sched.header;
    int rank = pass->R->rank;
    if (h->magic != MOK_SCHED_MAGIC)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].schedule: not built by mok_schedule_build",
                         pass->local_rank);
    int64_t found = 0, expected = 0;
    const int tag = mok__sched_tag_check(h, ws->tag, rank, &found, &expected);
    if (tag != MOK_TAG_OK) return refuse_tag(pass, tag, found, expected);
    /* This workspace's: its build is the one the call's barriers carry to the peers. */
    ws->call_build[pass->local_rank] = h->build;
    if (h->nranks != ws->group->nranks || h->num_local_experts != ws->num_local_experts ||
        h->topk != ws->shape.topk || h->max_rows != ws->sched_layout.max_rows)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].schedule: built for another workspace shape",
                         pass->local_rank);
    if (h->error) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].schedule: its build failed", pass->local_rank);
    if (h->num_tokens[rank] != num_tokens)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args[%d].num_tokens: %lld differs from the %lld of the schedule",
                         pass->local_rank, (long long)num_tokens, (long long)h->num_tokens[rank]);
    const char *broken = schedule_rows_broken(pass);
    if (broken)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "args[%d].schedule: changed since its build (%s); build it again with mok_schedule_build",
                         pass->local_rank, broken);
    return MOK_OK;
}

/* A backward's context: written by a forward or recompute of this workspace and rank with the
 * schedule's build (its tag, core/schedule.h). */
static mok_status read_context_tag(const cpu_pass *pass) {
    int64_t found = 0, expected = 0;
    const int tag = mok__context_tag_check((const mok_context_tag *)pass->ba->context, pass->ws->tag,
                                           pass->sched.header->build, pass->R->rank, &found, &expected);
    return tag == MOK_TAG_OK ? MOK_OK : refuse_tag(pass, tag, found, expected);
}

/* The pass's task list and counter layout from its plan. With combine_pull it also needs every
 * rank's padded rows, from the schedules the ranks copied into their regions: call it after the
 * start barrier then (dispatch_pull likewise). */
static mok_status build_list(cpu_pass *pass) {
    cpu_rank *R = pass->R;
    mok_plan *p = &pass->plan;
    int64_t *padded = pass->peer_padded_rows;
    if (mok__plan_names_peers(p)) {
        for (int q = 0; q < p->nranks; ++q)
            padded[q] = ((const mok_sched_header *)(R->peers[q] + pass->cw->sym.sched))->padded_rows;
        p->peer_padded_rows = padded;
    }
    mok__counters_layout(p, &pass->counters);
    R->num_tasks = mok__tasks_build(p, R->tasks, R->tasks_cap);
    if (R->num_tasks < 0 || pass->counters.total > R->counters_cap)
        return mok__fail(MOK_ERR_INTERNAL, "cpu backend: task list larger than its bound");
    return MOK_OK;
}

static mok_status prepare(cpu_pass *pass, int64_t num_tokens, const void *schedule, int accumulate) {
    mok_workspace *ws = pass->ws;
    cpu_rank *R = pass->R;
    mok_status st = read_schedule(pass, schedule, num_tokens);
    if (st == MOK_OK && pass->kind == MOK_PASS_BACKWARD) st = read_context_tag(pass);
    if (st != MOK_OK) return st;
    const mok_plan_pass this_pass = {
        .kind = pass->kind, .accumulate = accumulate, .rank = R->rank, .num_tokens = num_tokens, .sched = &pass->sched};
    pass->plan = mok__plan_pass(&pass->cw->plan, &this_pass);
    const mok_plan *p = &pass->plan;
    /* every counter, before the start barrier: after it, peers may bump this rank's */
    for (int64_t c = 0; c < R->counters_cap; ++c) atomic_store_explicit(&R->counters[c], 0, memory_order_relaxed);
    atomic_store((_Atomic int32_t *)(R->region + pass->cw->sym.failed), 0);
    if (mok__plan_names_peers(p)) { /* peers read the schedule; the list needs theirs (build_list) */
        memcpy(R->region + pass->cw->sym.sched, schedule, ws->sched_layout.bytes);
    } else {
        mok_status bst = build_list(pass);
        if (bst != MOK_OK) return bst;
    }
    atomic_store(&R->cursor[0], 0);
    atomic_store(&R->cursor[1], 0);
    atomic_store(&R->abort, 0);
    atomic_store(&R->wait_failed, CPU_WAIT_OK);
    atomic_store(&R->progress_ns, 0);
    atomic_store(&R->trace_count[cpu_trace_pass(pass->kind)], 0);
    return MOK_OK;
}

/* Barrier `step` of the job's call (api.c set ws->call; the schedule build is this rank's). */
static mok_status barrier(const rank_job *job, int step, int ok) {
    mok_call call = job->ws->call;
    call.step = step;
    call.build = job->ws->call_build[job->local_rank];
    return mok__cpu_barrier(job->ws->group, job->local_rank, &call, ok);
}

static void stage(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}

static mok_status run_schedule_build(rank_job *job) {
    mok_workspace *ws = job->ws;
    cpu_workspace *cw = ws->impl;
    cpu_rank *R = &cw->ranks[job->local_rank];
    const mok_schedule_args *a = job->args;
    const int64_t k = ws->shape.topk, P = ws->group->nranks;
    *(int64_t *)(R->region + cw->sym.tokens) = a->num_tokens;
    stage(R->region + cw->sym.ids, a->topk_ids, (size_t)(a->num_tokens * k) * 4);
    mok_status st = barrier(job, 0, 1);
    if (st != MOK_OK) return st;
    int64_t tokens[MOK_MAX_RANKS];
    const int32_t *ids[MOK_MAX_RANKS];
    for (int p = 0; p < P; ++p) {
        tokens[p] = *(const int64_t *)(R->peers[p] + cw->sym.tokens);
        ids[p] = (const int32_t *)(R->peers[p] + cw->sym.ids);
    }
    int err = mok__sched_build(&ws->sched_layout, a->schedule, R->rank, ws->shape.num_experts, tokens, ids);
    mok__sched_tag(a->schedule, ws->tag, ws->call_build[job->local_rank]);
    if (err == MOK_SCHED_ERR_EXPERT_ID) {
        /* Name the first bad id, of whichever rank; every rank reports the same one. */
        for (int p = 0; p < P; ++p)
            for (int64_t s = 0; s < tokens[p] * k; ++s)
                if (ids[p][s] < -1 || ids[p][s] >= ws->shape.num_experts) {
                    st = mok__fail(MOK_ERR_INVALID_ARGUMENT,
                                   "topk_ids: rank %d token %lld slot %lld holds expert id %d, not in [-1, E = %lld)", p,
                                   (long long)(s / k), (long long)(s % k), ids[p][s],
                                   (long long)ws->shape.num_experts);
                    p = (int)P;
                    break;
                }
    } else if (err) {
        st = mok__fail(MOK_ERR_INTERNAL, "schedule: build error %d", err);
    }
    /* Peers read this rank's ids until they pass this barrier. */
    mok_status bst = barrier(job, 1, 1);
    return st != MOK_OK ? st : bst;
}

/* The error of a pass whose workers stopped early (cpu_rank.wait_failed). A wait that timed out
 * poisons the group: a peer's pass may be stuck in a way no barrier will settle. */
static mok_status wait_failure(const cpu_pass *pass) {
    const cpu_rank *R = pass->R;
    const int why = atomic_load(&R->wait_failed);
    const long long counter = (long long)atomic_load(&R->wait_counter), q = (long long)atomic_load(&R->wait_peer);
    if (why == CPU_WAIT_POISONED) return mok__cpu_poisoned_error(pass->ws->group, R->rank);
    if (why == CPU_WAIT_TIMEOUT) {
        mok__cpu_poison(pass->ws->group, R->rank, CPU_POISON_TIMEOUT);
        if (q < 0)
            return mok__fail(MOK_ERR_TIMEOUT,
                             "rank %d: a task waited more than peer_timeout_ms = %.0f for this rank's counter %lld",
                             R->rank, pass->ws->config.peer_timeout_ms, counter);
        return mok__fail(MOK_ERR_TIMEOUT, "rank %d: a task waited more than peer_timeout_ms = %.0f for rank %lld's "
                         "counter %lld", R->rank, pass->ws->config.peer_timeout_ms, q, counter);
    }
    if (why == CPU_WAIT_PEER_FAILED)
        return mok__fail(MOK_ERR_BACKEND, "rank %d: the pass stopped early: rank %lld's pass failed", R->rank, q);
    return mok__fail(MOK_ERR_BACKEND, "rank %d: the pass stopped early (a worker of this rank failed)", R->rank);
}

static mok_status run_pass(rank_job *job) {
    mok_workspace *ws = job->ws;
    cpu_workspace *cw = ws->impl;
    cpu_pass pass;
    memset(&pass, 0, sizeof pass);
    pass.ws = ws;
    pass.cw = cw;
    pass.R = &cw->ranks[job->local_rank];
    pass.local_rank = job->local_rank;
    pass.kind = job->kind;
    cpu_rank *R = pass.R;
    const mok_shape *s = &ws->shape;
    const size_t H = (size_t)s->hidden, k = (size_t)s->topk;
    int64_t T;
    mok_status st;
    if (job->kind == MOK_PASS_BACKWARD) {
        pass.ba = job->args;
        T = pass.ba->num_tokens;
        st = prepare(&pass, T, pass.ba->schedule, pass.ba->accumulate);
        if (st == MOK_OK) {
            mok__cpu_stage_x(&pass, pass.ba->x, T);
            stage(R->region + cw->sym.dy, pass.ba->dy, (size_t)T * H * 2);
            stage(R->region + cw->sym.router_w, pass.ba->router_w, (size_t)T * k * 4);
        }
    } else {
        pass.fa = job->args;
        T = pass.fa->num_tokens;
        st = prepare(&pass, T, pass.fa->schedule, 0);
        if (st == MOK_OK) {
            mok__cpu_stage_x(&pass, pass.fa->x, T);
            stage(R->region + cw->sym.router_w, pass.fa->router_w, (size_t)T * k * 4);
        }
    }
    /* Start barrier: every rank's inputs are staged before anyone pulls. A rank that rejected its
       arguments makes every rank return an error here instead of waiting for it. */
    char message[1024] = "";
    if (st != MOK_OK) snprintf(message, sizeof message, "%s", mok_last_error());
    mok_status bst = barrier(job, 0, st == MOK_OK);
    if (st != MOK_OK) return mok__cpu_settle(st, message, bst);
    if (bst != MOK_OK) return bst;
    if (mok__plan_names_peers(&pass.plan)) {
        st = build_list(&pass);
        if (st != MOK_OK) abort_pass(&pass); /* its workers run nothing; peers waiting on it stop */
    }
    /* A forward's context holds no tag while its workers write it, and this pass's once they all
       succeeded: a pass that stops early leaves no context a backward would take for whole. */
    void *context = job->kind == MOK_PASS_BACKWARD ? NULL : pass.fa->context;
    if (st == MOK_OK) {
        if (context) ((mok_context_tag *)context)->magic = 0;
        st = run_workers(&pass);
    }
    if (st == MOK_OK && atomic_load(&R->abort)) st = wait_failure(&pass);
    if (st != MOK_OK) snprintf(message, sizeof message, "%s", mok_last_error());
    /* End barrier: every push into this rank's buffers has landed, and no peer still reads from
       this rank's region. */
    bst = barrier(job, 1, st == MOK_OK);
    if (st != MOK_OK) return mok__cpu_settle(st, message, bst);
    if (bst != MOK_OK) return bst;
    if (job->kind == MOK_PASS_FORWARD) mok__cpu_forward_epilogue(&pass, 0, T);
    else if (job->kind == MOK_PASS_BACKWARD) mok__cpu_backward_epilogue(&pass, 0, T);
    if (context) mok__context_tag_write(context, ws->tag, pass.sched.header->build, R->rank);
    return MOK_OK;
}

static void *rank_main(void *arg) {
    rank_job *job = arg;
    job->status = job->kind < 0 ? run_schedule_build(job) : run_pass(job);
    if (job->status != MOK_OK) snprintf(job->message, sizeof job->message, "%s", mok_last_error());
    return NULL;
}

/* Runs one job per local rank: in this thread when there is one, else one thread each (the
 * ranks wait for each other at barriers, so they must run at the same time). */
static mok_status run_ranks(mok_workspace *ws, int kind, const void *args, size_t arg_size) {
    int n = ws->group->num_local_ranks;
    rank_job jobs[MOK_MAX_RANKS];
    pthread_t threads[MOK_MAX_RANKS];
    for (int r = 0; r < n; ++r)
        jobs[r] = (rank_job){ws, r, kind, (const char *)args + (size_t)r * arg_size, MOK_OK, ""};
    if (n == 1) {
        rank_main(&jobs[0]);
    } else {
        int started = 0;
        for (; started < n; ++started)
            if (pthread_create(&threads[started], NULL, rank_main, &jobs[started]) != 0) break;
        for (int r = 0; r < started; ++r) pthread_join(threads[r], NULL);
        if (started < n) return mok__fail(MOK_ERR_BACKEND, "cpu backend: could not start a thread for each rank");
    }
    /* Report the most telling failure: an argument error over the peers' echo of it. */
    int pick = -1;
    for (int r = 0; r < n; ++r) {
        if (jobs[r].status == MOK_OK) continue;
        if (pick < 0 || (strstr(jobs[pick].message, "rejected its arguments") && !strstr(jobs[r].message, "rejected")))
            pick = r;
    }
    if (pick >= 0) {
        if (jobs[pick].status == MOK_ERR_TIMEOUT) ws->failed = 1;
        return mok__fail(jobs[pick].status, "%s", jobs[pick].message);
    }
    return MOK_OK;
}

mok_status mok__cpu_schedule_build(mok_workspace *ws, const mok_schedule_args *args) {
    return run_ranks(ws, -1, args, sizeof *args);
}

mok_status mok__cpu_schedule_read(mok_workspace *ws, const void *schedule, int local_rank, mok_sched_header *header) {
    (void)ws;
    (void)local_rank;
    memcpy(header, schedule, sizeof *header);
    return MOK_OK;
}

mok_status mok__cpu_forward(mok_workspace *ws, const mok_forward_args *args, int recompute) {
    return run_ranks(ws, recompute ? MOK_PASS_RECOMPUTE : MOK_PASS_FORWARD, args, sizeof *args);
}

mok_status mok__cpu_backward(mok_workspace *ws, const mok_backward_args *args) {
    return run_ranks(ws, MOK_PASS_BACKWARD, args, sizeof *args);
}

mok_status mok__cpu_trace_write(mok_workspace *ws, const char *path) {
    cpu_workspace *cw = ws->impl;
    const mok_trace_event *events[MOK_TRACE_PASSES * MOK_MAX_RANKS];
    int64_t counts[MOK_TRACE_PASSES * MOK_MAX_RANKS];
    for (int pass = 0; pass < MOK_TRACE_PASSES; ++pass)
        for (int lr = 0; lr < cw->num_local; ++lr) {
            const cpu_rank *R = &cw->ranks[lr];
            int64_t n = atomic_load(&R->trace_count[pass]);
            events[pass * cw->num_local + lr] = R->trace + pass * R->trace_cap;
            counts[pass * cw->num_local + lr] = n < R->trace_cap ? n : R->trace_cap;
        }
    return mok__trace_write_json(path, events, counts, cw->num_local);
}
