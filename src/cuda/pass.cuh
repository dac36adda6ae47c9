/* pass.cuh — what the forward and backward megakernels share: the parameters of a pass, the
 * facts of a row tile, bounded counter waits, row copies, the plan, the one-thread kernel that
 * builds the pass's task groups, and the loop by which every CTA claims its role's tasks.
 *
 * NOTE: a CTA takes tickets of its role (comm or compute) in increasing order and maps each to a
 * task of its role's groups in the global order of core/tasks.c; a task waits only on counters
 * bumped by earlier tasks. With every CTA resident (cooperative launch) the pass cannot deadlock. */
#ifndef MOK_CUDA_PASS_CUH
#define MOK_CUDA_PASS_CUH

#include <string.h>

#include "cuda_common.cuh"
#include "tile_operands.cuh"

struct pass_params {
    mok_sched_layout layout;
    const void *schedule;
    int num_local_experts, topk, rank, recompute, backward, accumulate, n_tile, n_tile_h;
    /* comm CTAs: the shape's count (comm_ctas()); with comm_auto (config 0) groups_kernel scales it
       by the rows this rank's comm tasks move per FLOP of its compute (mok__comm_workers), up to
       comm_max, and every CTA reads the pass's count from comm_dev at its start (pass_start) */
    int comm_ctas, comm_auto, comm_max;
    int *comm_dev;
    long long hidden, inter, shared_inter, num_tokens, ring_rows, minibatch_rows, context_rows;
    char *const *peers;
    /* x, dy and router_w: the caller's buffers, which this rank's own reads use; the copies at
       off_x, off_dy, off_router_w of every window are there for the peers (input_row_base) */
    size_t off_x, off_comb, off_dy, off_router_w, off_dxbuf, off_drw;
    const uint16_t *x, *dy, *w_gate, *w_up, *w_down, *s_gate, *s_up, *s_down;
    const float *router_w;
    uint16_t *ring_x, *ring_h, *ring_y, *sh_h, *sh_out, *context, *context_shared;
    /* backward */
    uint16_t *ring_dy, *ring_dyw, *ring_gu, *ring_dgu, *sh_dgu;
    float *ring_w, *ring_rdot, *carry;
    void *dw[3], *ds[3];
    float limit;
    unsigned long long *counters;
    long long counters_cap;
    /* Transfers in other than their default direction (docs/design.md §2.4a): the plan's switches
       (this pass's: a recompute pass turns none), every rank's copy of its schedule and counters at
       these offsets of its window, and `turned` (the counters are in the window: their releases
       and acquires are system-scope) */
    int combine_pull, dispatch_pull, dispatch_push, combine_push, nranks, turned;
    size_t off_sched, off_counters, off_ring_x, off_ring_y, off_ring_dy, off_ring_dyw, off_ring_w, off_ring_rdot;
    int *error;        /* the rank's cuda_error_word, as its first member (set_error, cuda_common.cuh) */
    long long timeout_ns;
    unsigned tma_mask; /* bit m: map m of the kernel's pass_maps is usable (tma.cuh) */
    int raster;        /* GEMM groups' walk (mok__group_tile): mok__raster or MOK_CUDA_RASTER */
    mok_task_group *groups; /* built by groups_kernel */
    long long groups_cap;
    long long *num_groups;
    mok_trace_event *trace; /* config.trace: one event per task; NULL when off */
    long long trace_cap;
    unsigned long long *trace_count;
};

struct tile_info {
    long long row0, ring0;
    int nreal, expert;
};

static __device__ tile_info row_tile(const pass_params &p, const mok_sched_view &v, long long rt) {
    tile_info t;
    t.row0 = rt * MOK_ROW_TILE;
    t.ring0 = t.row0 % p.ring_rows;
    t.expert = mok__sched_row_expert(&v, p.num_local_experts, t.row0);
    long long end = v.expert_start[t.expert] + v.expert_rows[t.expert] - t.row0;
    t.nreal = (int)(end < 0 ? 0 : end > MOK_ROW_TILE ? MOK_ROW_TILE : end);
    return t;
}

/* What producer thread 0 works out once per compute task, before it posts the task (walk_ws.cuh),
 * for the loaders and the consumers alike: a routed row tile (a binary search over the experts'
 * starts, each step a dependent global load, and a 64-bit remainder), or a weight-gradient tile's
 * matrix, tile indices and rows. Each role used to work these out for itself, the consumers two
 * or three times per task (gemm, preset, epilogue), in front of their main loop and in their
 * epilogue. walk_ws.cuh fills grp; the runner's prepare() fills the fields its task kind uses,
 * the rest stay zero. */
struct task_prep {
    mok_task_group grp;       /* the task's group, a copy of p.groups[g] */
    tile_info tile;           /* routed row tiles */
    long long wg_i, wg_j;     /* weight gradients: the tile's row and column tile in its matrix */
    long long wg_ring0;       /* routed: the macrobatch's first row of the expert, in the ring */
    long long wg_rows;        /* routed: its rows in this macrobatch; shared: the tokens */
    long long wg_carry;       /* routed: the carry slot (the macrobatch the expert began in) */
    int wg_matrix;            /* MOK_WGRAD_GATE, _UP or _DOWN */
    int wg_began, wg_continues; /* routed: rows of the expert before / after this macrobatch */
};

/* At a megakernel's start: whether the rank's error word is set (the pass must not run), and the
 * pass's comm CTA count into *comm (CTAs below it move rows). One read of each per CTA, broadcast
 * through shared memory (when the word was mapped host memory, a read per thread cost ~1.1 ms of
 * PCIe reads at the kernel's start). */
static __device__ __forceinline__ bool pass_start(const pass_params &p, int *comm) {
    __shared__ int s_error, s_comm;
    if (threadIdx.x == 0) {
        s_error = *(volatile int *)p.error;
        s_comm = *(volatile int *)p.comm_dev;
    }
    __syncthreads();
    *comm = s_comm;
    return s_error != 0;
}

/* An input of rank `peer` (x, dy or router_w): this rank's own from the caller's buffer `own`, a
 * peer's from the copy at `off` in its window. With one rank the pass makes no copies. */
static __device__ __forceinline__ const char *input_row_base(const pass_params &p, int peer, size_t off,
                                                            const void *own) {
    return peer == p.rank ? (const char *)own : p.peers[peer] + off;
}

/* The counters of rank `peer` (-1: this rank's own). A peer's are reached through its window. */
static __device__ __forceinline__ unsigned long long *counters_of(const pass_params &p, int peer) {
    return peer < 0 ? p.counters : (unsigned long long *)(p.peers[peer] + p.off_counters);
}

static __device__ __forceinline__ unsigned long long counter_acquire(const pass_params &p, const unsigned long long *c) {
    return p.turned ? ld_acquire_sys(c) : ld_acquire_gpu(c);
}

/* One thread: spins until counter c of rank `peer` (-1: this rank) is >= target (c < 0: no wait).
 * False if the pass was aborted, here or on that peer, or the wait outlived the timeout (then it
 * sets MOK_KERR_STALL and the abort flag; a peer whose pass aborted, whatever its cause, stops
 * this one the same way, so a rank never waits on a peer that has given up). */
static __device__ bool wait_counter_thread(const pass_params &p, long long c, long long target, int peer = -1,
                                           long long *seen = nullptr) {
    if (c < 0) return true;
    long long start = globaltimer_ns();
    unsigned long long *abort = p.counters + p.counters_cap + 2;
    const unsigned long long *base = counters_of(p, peer);
    const volatile unsigned long long *peer_abort = base + p.counters_cap + 2;
    long long v;
    while ((v = (long long)counter_acquire(p, base + c)) < target) {
        if (*(volatile unsigned long long *)abort) return false;
        const bool gave_up = peer >= 0 && *peer_abort;
        if (gave_up || globaltimer_ns() - start > p.timeout_ns) {
            set_error(p.error, MOK_KERR_STALL);
            atomicExch(abort, 1ull);
            return false;
        }
    }
    if (seen) *seen = v;
    return true;
}

/* One thread's wait on one of its own rank's counters, remembering the last counter it waited on
 * and the value it read there (a counter never falls during a pass): a wait that value already
 * meets is skipped. Consecutive tasks of one group wait on the same counter (every weight-gradient
 * tile of an expert and macrobatch on its dh tiles), and each acquire costs an L2 round trip and
 * the SM's L1 (the acquire invalidates it), on the producer's path to posting the task. The
 * earlier acquire already ordered everything the bumps up to that value released. */
struct counter_seen { /* 32 bits each (counter indices and values are far below 2^31): the
                         producer runs on few registers (setmaxnreg) */
    int c, v;
};

static __device__ __forceinline__ bool wait_counter_seen(const pass_params &p, long long c, long long target,
                                                         counter_seen *seen) {
    if (c < 0 || (c == seen->c && target <= seen->v)) return true;
    long long v = 0;
    if (!wait_counter_thread(p, c, target, -1, &v)) return false;
    seen->c = (int)c;
    seen->v = (int)(v < 0x7fffffff ? v : 0x7fffffff);
    return true;
}

/* The CTA waits until counter c of rank `peer` (-1: this rank) is >= target (thread 0 spins, the
 * CTA then proceeds together). Returns false if the pass was aborted. */
static __device__ bool wait_counter(const pass_params &p, long long c, long long target, volatile int *s_flag,
                                    int peer = -1) {
    if (threadIdx.x == 0) *s_flag = wait_counter_thread(p, c, target, peer);
    __syncthreads();
    bool ok = *s_flag;
    __syncthreads();
    return ok;
}

static __device__ void make_plan(const pass_params &p, const mok_sched_view &v, mok_plan *plan) {
    memset(plan, 0, sizeof *plan);
    plan->recompute = p.recompute;
    plan->backward = p.backward;
    plan->accumulate = p.accumulate;
    plan->padded_rows = v.header->padded_rows;
    plan->context_rows = p.context_rows;
    plan->num_tokens = p.num_tokens;
    plan->hidden = p.hidden;
    plan->intermediate = p.inter;
    plan->shared_intermediate = p.shared_inter;
    plan->num_local_experts = p.num_local_experts;
    plan->minibatch_rows = (int)p.minibatch_rows;
    plan->ring_rows = (int)p.ring_rows;
    plan->n_tile = p.n_tile;
    plan->n_tile_h = p.n_tile_h;
    plan->wgrad_tile = CUDA_WGRAD_M;
    plan->wgrad_tile_n = CUDA_WGRAD_N;
    plan->raster = p.raster;
    plan->expert_start = v.expert_start;
    plan->expert_rows = v.expert_rows;
    plan->combine_pull = p.combine_pull;
    plan->dispatch_pull = p.dispatch_pull;
    plan->dispatch_push = p.dispatch_push;
    plan->combine_push = p.combine_push;
    plan->nranks = p.nranks;
    plan->rank = p.rank;
}

static __device__ bool schedule_ok(const pass_params &p, const mok_sched_view &v) {
    return v.header->magic == MOK_SCHED_MAGIC && v.header->rank == p.rank && !v.header->error &&
           v.header->num_tokens[p.rank] == p.num_tokens;
}

/* One thread: the pass's groups in the global order (core/tasks.c), for the megakernel, and its
 * comm CTA count. */
static __global__ void groups_kernel(pass_params p) {
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    *p.num_groups = 0;
    *p.comm_dev = p.comm_ctas;
    if (!schedule_ok(p, v)) {
        set_error(p.error, MOK_KERR_SCHEDULE);
        atomicExch(p.counters + p.counters_cap + 2, 1ull); /* peers waiting on this rank's counters stop */
        return;
    }
    mok_plan plan;
    make_plan(p, v, &plan);
    int64_t padded[MOK_MAX_RANKS];
    if (mok__plan_names_peers(&plan)) {
        /* every rank's padded rows, from the schedules the ranks published before the start
           barrier (sched_publish_kernel); a peer's that is out of range stops the pass */
        for (int q = 0; q < p.nranks; ++q) {
            const mok_sched_header *h = (const mok_sched_header *)(p.peers[q] + p.off_sched);
            padded[q] = *(volatile const int64_t *)&h->padded_rows;
            if (padded[q] < 0 || padded[q] > p.layout.max_rows || padded[q] % MOK_ROW_TILE) {
                set_error(p.error, MOK_KERR_SCHEDULE);
                atomicExch(p.counters + p.counters_cap + 2, 1ull); /* peers waiting on this rank stop */
                return;
            }
        }
        plan.peer_padded_rows = padded;
    }
    long long n = mok__groups_build(&plan, p.groups, p.groups_cap);
    if (n < 0) {
        set_error(p.error, MOK_KERR_SCHEDULE);
        n = 0;
    }
    *p.num_groups = n;
    if (p.comm_auto) /* scaled by the rows this rank moves per FLOP, with turned transfers */
        *p.comm_dev = mok__comm_workers(&plan, p.comm_ctas, p.comm_max, p.num_tokens * p.topk, v.header->routed_rows);
}

/* Where a role's tickets stand in the group list: group g holds tickets [g_first, g_first + g_size). */
struct task_cursor {
    long long g, g_first, g_size;
};

/* Moves the cursor to the group of ticket t (tickets only grow). False past the role's last group. */
static __device__ bool cursor_seek(const pass_params &p, int role, long long num_groups, task_cursor &c, long long t) {
    while (t >= c.g_first + c.g_size) {
        c.g_first += c.g_size;
        c.g_size = 0;
        while (++c.g < num_groups && p.groups[c.g].role != role) {
        }
        if (c.g >= num_groups) return false;
        c.g_size = (long long)p.groups[c.g].num_tiles * p.groups[c.g].n_tiles;
    }
    return true;
}

/* Task `local` of a group: its row tile, sub-tile and the counter it waits on first. */
static __device__ __forceinline__ void task_decode(const mok_task_group &grp, long long local, long long *rt,
                                                   long long *nt, long long *wait) {
    int64_t tile, sub;
    mok__group_tile(&grp, local, &tile, &sub);
    *rt = tile;
    *nt = sub;
    *wait = grp.wait[0] < 0 ? -1 : grp.wait[0] + (grp.wait_per_tile ? *rt - grp.first_tile : 0);
}

/* One thread, after the task's writes are ordered before it (bar.sync, or an mbarrier after
 * one): the trace event (start, end), then the release of the task's done counters. */
static __device__ void finish_task(const pass_params &p, const mok_task_group &grp, long long rt, int role,
                                   long long start, long long end, long long gemm_ns = 0, long long epi_ns = 0) {
    if (TRACE_ON(p)) {
        unsigned long long n = atomicAdd(p.trace_count, 1ull);
        if ((long long)n < p.trace_cap) {
            mok_trace_event e;
            e.kind = (int16_t)grp.kind;
            e.worker = (int16_t)blockIdx.x;
            e.minibatch = grp.minibatch;
            e.rank = p.rank;
            e.comm = role == MOK_ROLE_COMM;
            e.gemm_ns = (int32_t)gemm_ns;
            e.epi_ns = (int32_t)epi_ns;
            e.start_ns = start;
            e.end_ns = end;
            p.trace[n] = e;
        }
    }
    if (p.turned) { /* peers wait on these counters, or this counter is a peer's */
        __threadfence_system();
        if (grp.done[0] >= 0)
            red_release_sys(counters_of(p, grp.done_peer) + grp.done[0] + (grp.done_per_tile ? rt - grp.first_tile : 0),
                            1ull);
        if (grp.done[1] >= 0) red_release_sys(p.counters + grp.done[1], 1ull);
        return;
    }
    __threadfence();
    if (grp.done[0] >= 0) red_release_gpu(p.counters + grp.done[0] + (grp.done_per_tile ? rt - grp.first_tile : 0), 1ull);
    if (grp.done[1] >= 0) red_release_gpu(p.counters + grp.done[1], 1ull);
}

/* Thread 0 of a CTA, at its end (config.trace): its residency from `entry`, as one event. */
static __device__ void trace_resident(const pass_params &p, long long entry, int comm) {
    if (!TRACE_ON(p)) return;
    unsigned long long n = atomicAdd(p.trace_count, 1ull);
    if ((long long)n >= p.trace_cap) return;
    mok_trace_event e;
    e.kind = MOK_TRACE_RESIDENT;
    e.worker = (int16_t)blockIdx.x;
    e.minibatch = -1;
    e.rank = p.rank;
    e.comm = blockIdx.x < comm;
    e.gemm_ns = 0;
    e.epi_ns = 0;
    e.start_ns = entry;
    e.end_ns = globaltimer_ns();
    p.trace[n] = e;
}

/* The CTA loop: claim a ticket of this CTA's role, find its group and task, wait, run, bump. */
template <typename Runner>
static __device__ void walk_tasks(const pass_params &p, const mok_sched_view &v, uint16_t *smem) {
    __shared__ long long s_ticket;
    __shared__ int s_flag;
    const int role = MOK_ROLE_COMM; /* compute CTAs run walk_compute_ws (walk_ws.cuh) */
    unsigned long long *ticket = p.counters + p.counters_cap + role;
    const long long num_groups = *p.num_groups;
    task_cursor cur = {-1, 0, 0};
    for (;;) {
        if (threadIdx.x == 0) s_ticket = (long long)atomicAdd(ticket, 1ull);
        __syncthreads();
        const long long t = s_ticket;
        __syncthreads();
        if (!cursor_seek(p, role, num_groups, cur, t)) break;
        const mok_task_group grp = p.groups[cur.g];
        long long rt, nt, wait;
        task_decode(grp, t - cur.g_first, &rt, &nt, &wait);
        if (!wait_counter(p, wait, grp.target[0], &s_flag, grp.wait_peer)) break;
        if (!wait_counter(p, grp.wait[1], grp.target[1], &s_flag)) break;
        const long long start = TRACE_ON(p) ? globaltimer_ns() : 0;
        Runner::run(p, v, grp, rt, nt, smem);
        __syncthreads();
        if (threadIdx.x == 0) finish_task(p, grp, rt, role, start, TRACE_ON(p) ? globaltimer_ns() : 0);
    }
}

/* The fields every pass shares: layer, schedule, buffers, counters. */
static void pass_params_init(pass_params *p, const mok_workspace *ws, const cuda_rank *R, int64_t num_tokens,
                             const void *schedule, int backward) {
    const cuda_workspace *cw = (const cuda_workspace *)ws->impl;
    const mok_shape *s = &ws->shape;
    memset(p, 0, sizeof *p);
    p->layout = ws->sched_layout;
    p->schedule = schedule;
    p->num_local_experts = (int)ws->num_local_experts;
    p->topk = (int)s->topk;
    p->rank = R->rank;
    p->backward = backward;
    p->n_tile_h = mok_cuda_cols_h(s->hidden);
    p->hidden = s->hidden;
    p->inter = s->intermediate;
    p->shared_inter = s->shared_intermediate;
    p->num_tokens = num_tokens;
    p->ring_rows = ws->config.ring_rows;
    p->minibatch_rows = ws->config.minibatch_rows;
    p->context_rows = ws->context_rows;
    p->peers = R->peers;
    p->off_x = cw->sym.x;
    p->off_comb = cw->sym.comb;
    p->off_dy = cw->sym.dy;
    p->off_router_w = cw->sym.router_w;
    p->off_dxbuf = cw->sym.dxbuf;
    p->off_drw = cw->sym.drw;
    p->ring_x = R->ring_x;
    p->ring_h = R->ring_h;
    p->ring_y = R->ring_y;
    p->sh_h = R->sh_h;
    p->sh_out = R->sh_out;
    p->ring_dy = R->ring_dy;
    p->ring_dyw = R->ring_dyw;
    p->ring_gu = R->ring_gu;
    p->ring_dgu = R->ring_dgu;
    p->sh_dgu = R->sh_dgu;
    p->ring_w = R->ring_w;
    p->ring_rdot = R->ring_rdot;
    p->carry = R->carry;
    p->limit = ws->config.swiglu_limit;
    p->counters = R->counters;
    p->counters_cap = R->counters_cap;
    p->nranks = ws->group->nranks;
    p->turned = cw->sym.turned;
    p->off_sched = cw->sym.sched;
    p->off_counters = cw->sym.counters;
    p->off_ring_x = cw->sym.ring_x;
    p->off_ring_y = cw->sym.ring_y;
    p->off_ring_dy = cw->sym.ring_dy;
    p->off_ring_dyw = cw->sym.ring_dyw;
    p->off_ring_w = cw->sym.ring_w;
    p->off_ring_rdot = cw->sym.ring_rdot;
    p->error = (int *)R->error_word;
    p->timeout_ns = (long long)(ws->config.peer_timeout_ms * 1e6);
    p->groups = R->groups;
    p->groups_cap = R->groups_cap;
    p->num_groups = R->num_groups;
    /* the pass's own trace buffer: the forward's (or recompute's) or the backward's (internal.h) */
    p->trace = R->trace ? R->trace + (backward ? R->trace_cap : 0) : nullptr;
    p->trace_cap = R->trace_cap;
    p->trace_count = R->trace_count ? R->trace_count + (backward ? 1 : 0) : nullptr;
    /* tiles per run of the GEMM groups' walk: the shape's choice (mok__raster), or an
       experiment's switch read at every pass (MOK_CUDA_RASTER, 1..64; other values: the choice) */
    const char *raster = getenv("MOK_CUDA_RASTER");
    p->raster = raster ? atoi(raster) : 0;
    if (p->raster < 1 || p->raster > 64) p->raster = mok__raster(s->hidden);
}

/* Comm CTAs of a pass: the config's count, or for 0 the measured choice (mok__comm_ctas,
 * core/tasks.h). With one rank and the default combine (forward) or reverse-dispatch (backward)
 * direction the down / dx tiles store their rows themselves (fwd_epilogue, bwd_epilogue). */
static int comm_ctas(const mok_workspace *ws, const cuda_rank *R, int configured, int backward) {
    if (configured > 0) return configured < R->num_sms - 1 ? configured : R->num_sms - 1;
    const int direct = backward ? ws->config.bwd_dispatch == MOK_PUSH : ws->config.fwd_combine == MOK_PUSH;
    return mok__comm_ctas(ws->shape.intermediate, ws->shape.shared_intermediate, ws->shape.topk, ws->group->nranks,
                          backward, direct, R->num_sms);
}

/* A pass's comm CTAs (pass_params): the shape's count, and with configured = 0 the bounds of the
 * count groups_kernel picks per pass from the routing. */
static void pass_params_comm(pass_params *p, const mok_workspace *ws, const cuda_rank *R, int configured,
                             int backward) {
    p->comm_ctas = comm_ctas(ws, R, configured, backward);
    p->comm_auto = configured <= 0;
    const int cap = R->num_sms / 4 > 1 ? R->num_sms / 4 : 1;
    p->comm_max = cap < R->num_sms - 1 ? cap : R->num_sms - 1;
    if (p->comm_max < p->comm_ctas) p->comm_max = p->comm_ctas;
    p->comm_dev = R->comm_dev;
}

/* The layer a pass reads, as both passes' arguments name it: x, the weights, the context (the
 * forward writes it, the backward reads it). */
static void pass_params_layer(pass_params *p, const mok_workspace *ws, const void *x, const void *w_gate,
                              const void *w_up, const void *w_down, const void *s_gate, const void *s_up,
                              const void *s_down, const void *context) {
    p->x = (const uint16_t *)x;
    p->w_gate = (const uint16_t *)w_gate;
    p->w_up = (const uint16_t *)w_up;
    p->w_down = (const uint16_t *)w_down;
    p->s_gate = (const uint16_t *)s_gate;
    p->s_up = (const uint16_t *)s_up;
    p->s_down = (const uint16_t *)s_down;
    p->context = (uint16_t *)context;
    p->context_shared = (uint16_t *)((const char *)context + ws->context_shared_offset);
}

/* The schedule a pass runs, into the rank's window, where peers read it (turned transfers):
 * the arrays before the rows whole, the rows' peers and slots up to padded_rows (a schedule that
 * is not one gets its header only; groups_kernel refuses it on every rank). */
static __global__ void sched_publish_kernel(mok_sched_layout layout, const char *schedule, char *out) {
    const mok_sched_header *h = (const mok_sched_header *)schedule;
    long long rows = h->magic == MOK_SCHED_MAGIC ? h->padded_rows : 0;
    rows = rows < 0 ? 0 : rows > layout.max_rows ? layout.max_rows : rows;
    const long long head = (long long)layout.off_row_peer / 16, n = rows * 4 / 16;
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
 * a pending clear of the error word (workspace.cu's NOTE), fresh counters (before the barrier:
 * with a turned transfer peers bump them once past it; the previous pass's closing barrier keeps
 * every peer off them until then), the schedule into the window (turned transfers), barrier (every
 * rank's inputs are in place; publishes T), the group list, the megakernel on every SM at once,
 * barrier (every push into this rank has landed, no peer reads its rings any more). `maps`: the
 * kernel's tensor maps (its second parameter), or NULL for a kernel that takes none. */
static mok_status launch_pass(mok_workspace *ws, int lr, const cuda_rank *R, pass_params *p, const void *kernel,
                              int threads, size_t smem, cudaStream_t stream, int64_t num_tokens,
                              const void *maps) {
    mok_status st = mok__cuda_error_word_clear(ws, lr, stream);
    if (st != MOK_OK) return st;
    CUDA_TRY(cudaMemsetAsync(R->counters, 0, sizeof(unsigned long long) * (size_t)(R->counters_cap + 8), stream));
    if (p->trace_count) CUDA_TRY(cudaMemsetAsync(p->trace_count, 0, sizeof(unsigned long long), stream));
    if (p->combine_pull || p->dispatch_pull || p->dispatch_push || p->combine_push)
        LAUNCH_TRY(sched_publish_kernel<<<R->num_sms, 256, 0, stream>>>(p->layout, (const char *)p->schedule,
                                                                        R->sym + p->off_sched));
    st = mok__cuda_barrier(ws, lr, stream, num_tokens, 0);
    if (st != MOK_OK) return st;
    LAUNCH_TRY(groups_kernel<<<1, 1, 0, stream>>>(*p));
    void *kargs[] = {p, (void *)maps}; /* the kernel's second parameter, when it has one */
    CUDA_TRY(cudaLaunchCooperativeKernel(kernel, dim3(R->num_sms), dim3(threads), kargs, smem, stream));
    return mok__cuda_barrier(ws, lr, stream, -1, 1);
}


#endif
