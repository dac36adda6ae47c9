/* cpu.h — the cpu backend: P ranks emulated by threads of one process. Each rank has a
 * symmetric region in host memory that its peers reach through one peer-pointer table (the
 * same offsets on every rank, as NCCL windows on the GPU), a ring of routed rows, and workers
 * that play the SMs: comm workers pull and push rows, compute workers run plain-C tiles, and
 * they hand work over through counters (release add / acquire load), in the task order of
 * core/tasks.h. */
#ifndef MOK_CPU_H
#define MOK_CPU_H

#include <pthread.h>
#include <stdatomic.h>

#include "core/tasks.h"
#include "internal.h"

#define CPU_N_TILE 64     /* output columns per GEMM task */
#define CPU_WGRAD_TILE 64 /* weight-gradient tiles are CPU_WGRAD_TILE square */
#define CPU_MAX_WORKSPACES 64

/* What ranks of one group share: the rendezvous, the cross-rank barrier, and the table of
 * each workspace's symmetric regions. In one-process-per-rank mode it is found by unique id in
 * a process-wide registry; in local mode it belongs to the one group handle. */
typedef struct cpu_domain {
    mok_unique_id id;
    int nranks;
    int registered;                              /* in the registry (per-rank mode) */
    int refs;                                    /* handles attached; guarded by the registry lock */
    _Atomic int joined;
    _Atomic uint64_t arrived[MOK_MAX_RANKS];     /* barrier epoch each rank has reached */
    _Atomic uint64_t rejected[MOK_MAX_RANKS];    /* epoch at which a rank rejected its arguments */
    _Atomic(char *) regions[CPU_MAX_WORKSPACES][MOK_MAX_RANKS];
    mok_shape shapes[CPU_MAX_WORKSPACES][MOK_MAX_RANKS];
    struct cpu_domain *next;
} cpu_domain;

typedef struct cpu_group {
    cpu_domain *domain;
    uint64_t epoch[MOK_MAX_RANKS];  /* barriers passed by each local rank */
    int workspaces[MOK_MAX_RANKS];  /* workspaces created by each local rank (collective order) */
} cpu_group;

/* Byte offsets inside a symmetric region (equal on every rank). */
typedef struct cpu_sym_layout {
    size_t x;        /* bf16 [T_max, H]: this rank's x; peers pull from it */
    size_t router_w; /* f32 [T_max * k] */
    size_t ids;      /* i32 [T_max * k]: read by peers' schedule builds */
    size_t comb;     /* bf16 [T_max * k, H]: expert outputs pushed in by their owners */
    size_t dy;       /* bf16 [T_max, H] */
    size_t dxbuf;    /* bf16 [T_max * k, H]: routed dx parts pushed in by the experts' owners */
    size_t drw;      /* f32 [T_max * k]: router-weight gradients pushed in likewise */
    size_t tokens;   /* i64: this rank's T for the current pass */
    /* Read by peers only when a transfer direction other than the default is on (core/tasks.h): */
    size_t ring_x;   /* bf16 [ring, H]: the rank's ring of routed x rows (cpu_rank.ring_x) */
    size_t ring_dy;  /* bf16 [ring, H]: routed dy rows (cpu_rank.ring_dy) */
    size_t ring_w;   /* f32 [ring]: their router weights (cpu_rank.ring_w) */
    size_t ring_y;   /* bf16 [ring, H]: the rank's ring of expert outputs / dx parts (cpu_rank.ring_y) */
    size_t ring_rdot; /* f32 [ring, I / CPU_N_TILE]: partial router-weight gradients (cpu_rank.ring_rdot) */
    size_t counters; /* i64 [counters_cap]: the rank's counters (cpu_rank.counters) */
    size_t sched;    /* the rank's schedule of the current pass, copied in before the start barrier */
    size_t failed;   /* i32: set when this rank's pass stops early; peers waiting on it stop too */
    size_t bytes;
} cpu_sym_layout;

/* One local rank's workspace state. */
typedef struct cpu_rank {
    int rank;                     /* global rank */
    int slot;                     /* index into domain->regions */
    char *region;                 /* own symmetric region */
    char *peers[MOK_MAX_RANKS];   /* every rank's region (peers[rank] == region) */
    /* ring: row i of a pass lives in slot i % ring_rows */
    uint16_t *ring_x;   /* [ring, H]; in the region (peers write it with dispatch_push) */
    uint16_t *ring_h;   /* [ring, I] */
    uint16_t *ring_y;   /* [ring, H]: expert outputs (forward), dx parts (backward); in the region */
    uint16_t *ring_dy;  /* [ring, H]; in the region (peers write it with combine_push) */
    float *ring_w;      /* [ring] router weight of each row; in the region */
    uint16_t *ring_dgu; /* [ring, 2I]: dg then du */
    float *ring_rdot;   /* [ring, I / CPU_N_TILE]: partial router-weight gradients; in the region */
    /* shared expert, over local tokens */
    uint16_t *sh_h;     /* [T_max, I_s] */
    uint16_t *sh_out;   /* [T_max, H]: output (forward), dx part (backward) */
    uint16_t *sh_dgu;   /* [T_max, 2 I_s] */
    float *carry;       /* [carry_slots, 3 I H]: fp32 weight-gradient accumulators of experts that
                           span macrobatches (bf16 mode); slot = the macrobatch the expert starts in */
    int64_t carry_slots;
    /* the pass */
    mok_task *tasks;
    int64_t tasks_cap, num_tasks;
    _Atomic int64_t *counters;    /* in the region: peers wait on and bump them (combine_pull) */
    int64_t counters_cap;
    _Atomic int64_t cursor[2];
    _Atomic int abort;            /* a worker failed: the others stop waiting */
    float *scratch;               /* [workers, scratch_floats] */
    size_t scratch_floats;
    mok_trace_event *trace;       /* [MOK_TRACE_PASSES * trace_cap]: pass p's from p * trace_cap */
    _Atomic int64_t trace_count[MOK_TRACE_PASSES];
    int64_t trace_cap;            /* events of one pass */
} cpu_rank;

typedef struct cpu_workspace {
    cpu_sym_layout sym;
    int workers, comm_workers;
    int num_local;
    cpu_rank *ranks; /* [num_local] */
} cpu_workspace;

/* domain.c */
int64_t mok__cpu_now_ns(void);

/* Everything one pass needs on one rank, shared by its workers. */
typedef struct cpu_pass {
    mok_workspace *ws;
    cpu_workspace *cw;
    cpu_rank *R;
    int local_rank;
    int kind; /* CPU_PASS_* */
    const mok_forward_args *fa;
    const mok_backward_args *ba;
    mok_sched_view sched;
    mok_plan plan;
    mok_counters_layout counters;
    int64_t peer_padded_rows[MOK_MAX_RANKS]; /* plan.peer_padded_rows with combine_pull */
} cpu_pass;

enum { CPU_PASS_FORWARD = 0, CPU_PASS_RECOMPUTE = 1, CPU_PASS_BACKWARD = 2 };

/* The trace buffer a pass records into (internal.h: forward and recompute 0, backward 1). */
static inline int cpu_trace_pass(int kind) { return kind == CPU_PASS_BACKWARD; }

/* tasks_fwd.c / tasks_bwd.c: run one task on one worker. */
void mok__cpu_run_forward_task(cpu_pass *pass, const mok_task *task, float *scratch);
void mok__cpu_run_backward_task(cpu_pass *pass, const mok_task *task, float *scratch);
void mok__cpu_forward_epilogue(cpu_pass *pass, int64_t t0, int64_t t1);
void mok__cpu_backward_epilogue(cpu_pass *pass, int64_t t0, int64_t t1);

/* tiles.c: plain-C GEMM pieces. Every reduction runs in one fixed sequential order per output
 * element, so results do not depend on which worker runs a tile. */
void mok__cpu_rows_to_f32(float *dst, const uint16_t *src, int64_t ld, int rows, int64_t cols);
void mok__cpu_bt_from_nk(float *bt, const uint16_t *w, int64_t ldw, int64_t n0, int nt, int64_t k);
void mok__cpu_bt_from_kn(float *bt, const uint16_t *w, int64_t ldw, int64_t n0, int nt, int64_t k);
void mok__cpu_gemm(float *acc, const float *a, int rows, int64_t k, const float *bt, int nt);

/* tasks_fwd.c: the facts of row tile rt (first row, real rows, local expert, ring slot of the
 * first row) and the gate/up tile shared by the forward and the backward's replay. */
typedef struct cpu_tile {
    int64_t row0, ring0;
    int nreal, expert;
} cpu_tile;
cpu_tile mok__cpu_tile(const cpu_pass *pass, int64_t rt);
void mok__cpu_gateup(const cpu_pass *pass, const cpu_tile *tile, int64_t n0, float *scratch, float *g, float *u);

static inline uint16_t *sym_bf16(const cpu_rank *R, const cpu_sym_layout *L, int rank, size_t off) {
    return (uint16_t *)(R->peers[rank] + off);
}

#endif
