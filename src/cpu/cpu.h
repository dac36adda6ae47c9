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

#include "core/fp8.h"
#include "core/layout.h"
#include "core/plan.h"
#include "core/tasks.h"
#include "backend.h"
#include "internal.h"

#define CPU_N_TILE 64     /* output columns per GEMM task */
#define CPU_WGRAD_TILE 64 /* weight-gradient tiles are CPU_WGRAD_TILE square */
#define CPU_MAX_WORKSPACES 64

/* What ranks of one group share: the rendezvous, the cross-rank barrier, and the table of
 * each workspace's symmetric regions. In one-process-per-rank mode it is found by unique id in
 * a process-wide registry; in local mode it belongs to the one group handle. */
/* NOTE (failures): a rank that gives up on a peer (a barrier timeout) or leaves a workspace out of
 * step (its destroy met a peer in another call) poisons the domain: every rank's next barrier, and
 * every wait of a pass in progress, fails at once. A peer may still be inside a pass that reads and
 * writes the poisoning rank's region (it passed the barrier the poisoning rank timed out at), so
 * after a poisoning no region of a per-rank group is freed while any handle is attached: a workspace
 * destroyed then hands its regions to the graveyard, freed with the domain. */
typedef struct cpu_grave {
    void *region;
    struct cpu_grave *next;
} cpu_grave;

enum { CPU_POISON_TIMEOUT = 1, CPU_POISON_DESTROY = 2 };
#define CPU_POISON_WORD(rank, reason) ((rank) + 1 + ((reason) << 16))
#define CPU_POISON_RANK(word) (((word) & 0xffff) - 1)
#define CPU_POISON_REASON(word) ((word) >> 16)

typedef struct cpu_domain {
    mok_unique_id id;
    int nranks;
    int registered;                              /* in the registry (per-rank mode) */
    int refs;                                    /* handles attached; guarded by the registry lock */
    int claimed[MOK_MAX_RANKS];                  /* per-rank mode: a handle holds this rank (registry lock) */
    _Atomic int joined;
    _Atomic uint64_t arrived[MOK_MAX_RANKS];     /* barrier epoch each rank has reached */
    _Atomic uint64_t rejected[MOK_MAX_RANKS];    /* epoch at which a rank rejected its arguments */
    /* The call each rank is in at its latest barrier, by the epoch's parity: a rank writes its slot
       before it publishes its arrival at epoch e, peers read it after they see that arrival, and
       the rank can reach epoch e + 2 (this slot again) only once every peer has arrived at e + 1,
       after it read the slot of e. */
    mok_call calls[2][MOK_MAX_RANKS];
    /* 0, or who poisoned the domain and why in one word, CPU_POISON_WORD(rank, reason): set once
       (compare-and-swap from 0), so a peer that sees it nonzero reads the reason with it */
    _Atomic int poisoned;
    cpu_grave *graveyard;                        /* regions kept until the domain goes (registry lock) */
    _Atomic(char *) regions[CPU_MAX_WORKSPACES][MOK_MAX_RANKS];
    mok_shape shapes[CPU_MAX_WORKSPACES][MOK_MAX_RANKS];
    mok_config configs[CPU_MAX_WORKSPACES][MOK_MAX_RANKS];
    struct cpu_domain *next;
} cpu_domain;

typedef struct cpu_group {
    cpu_domain *domain;
    uint64_t epoch[MOK_MAX_RANKS];  /* barriers passed by each local rank */
} cpu_group;

/* One local rank's workspace state. */
typedef struct cpu_rank {
    int rank;                     /* global rank */
    int slot;                     /* index into domain->regions */
    char *region;                 /* own symmetric region */
    char *peers[MOK_MAX_RANKS];   /* every rank's region (peers[rank] == region) */
    /* ring: row i of a pass lives in slot i % ring_rows */
    uint16_t *ring_x;   /* [ring, H]; in the region (peers write it with dispatch_push); NULL for FP8 */
    uint8_t *ring_x8;   /* FP8: the x rows' E4M3 codes [ring, H], in the region like ring_x; else NULL */
    float *ring_x_scale; /* FP8: their scales [ring, H / MOK_FP8_BLOCK], in the region; else NULL */
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
    _Atomic int wait_failed;      /* why: CPU_WAIT_* of the first wait that gave up */
    _Atomic int64_t wait_counter, wait_peer; /* and on which counter of which rank (-1: this one) */
    _Atomic int64_t progress_ns;  /* when a task of the pass last finished (run.c's wait_counter) */
    pthread_t *threads;           /* [workers]: the pass's worker threads (thread 0 is the rank's own) */
    struct cpu_worker *jobs;      /* [workers] */
    float *scratch;               /* [workers, scratch_floats] */
    size_t scratch_floats;
    mok_trace_event *trace;       /* [MOK_TRACE_PASSES * trace_cap]: pass p's from p * trace_cap */
    _Atomic int64_t trace_count[MOK_TRACE_PASSES];
    int64_t trace_cap;            /* events of one pass */
} cpu_rank;

typedef struct cpu_workspace {
    mok_plan_workspace plan; /* what the workspace fixes of every pass's plan (core/plan.h) */
    mok_region_layout sym;   /* every rank's symmetric region (core/layout.h) */
    int workers, comm_workers;
    int num_local;
    cpu_rank *ranks; /* [num_local] */
} cpu_workspace;

/* domain.c */
int64_t mok__cpu_now_ns(void);
/* The cross-rank barrier: carries `call` to the peers and compares theirs (ok = 0:
 * this rank rejected its arguments). mok__cpu_poisoned: nonzero (CPU_POISON_WORD of the rank whose
 * failure made the group unusable, and why) or 0. */
mok_status mok__cpu_barrier(mok_group *group, int local_rank, const mok_call *call, int ok);
int mok__cpu_poisoned(const mok_group *group);
/* The MOK_ERR_STATE a call gets in a poisoned group, naming who poisoned it and why. */
mok_status mok__cpu_poisoned_error(const mok_group *group, int rank);
/* The status of a call this rank refused or failed (own, own_message) after the barrier where it
 * told its peers: the barrier's timeout or MOK_ERR_STATE, which leave the group unusable, win over
 * an argument error (the message keeps both); else the rank's own error. */
mok_status mok__cpu_settle(mok_status own, const char *own_message, mok_status barrier);

/* Makes the group unusable for every rank (the NOTE above); `reason` is a CPU_POISON_*. */
void mok__cpu_poison(mok_group *group, int rank, int reason);
/* Keeps `region` allocated until the domain is freed (the NOTE above). */
void mok__cpu_bury(mok_group *group, void *region);

/* Everything one pass needs on one rank, shared by its workers. */
typedef struct cpu_pass {
    mok_workspace *ws;
    cpu_workspace *cw;
    cpu_rank *R;
    int local_rank;
    int kind; /* enum mok_pass_kind (core/plan.h) */
    const mok_forward_args *fa;
    const mok_backward_args *ba;
    mok_sched_view sched;
    mok_plan plan;
    mok_counters_layout counters;
    int64_t peer_padded_rows[MOK_MAX_RANKS]; /* plan.peer_padded_rows with combine_pull */
} cpu_pass;

/* The trace buffer a pass records into (internal.h: forward and recompute 0, backward 1). */
static inline int cpu_trace_pass(int kind) { return kind == MOK_PASS_BACKWARD; }

/* Why a counter wait of a pass gave up (cpu_rank.wait_failed). */
enum { CPU_WAIT_OK = 0, CPU_WAIT_TIMEOUT, CPU_WAIT_PEER_FAILED, CPU_WAIT_POISONED };

/* One worker of a pass: its role (MOK_ROLE_*) and index. */
typedef struct cpu_worker {
    cpu_pass *pass;
    int worker, role;
} cpu_worker;

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
/* FP8 operands (include/mok.h, FP8 section): E4M3 values widened to fp32 beside their scales.
 * A: a [rows, cols] and a_scale [rows, cols / MOK_FP8_BLOCK], from bf16 rows (quantized here) or
 * from stored codes and scales. B: bt [k][nt] from an E4M3 [N, K] matrix (K-major, ld K) with its
 * 128 x 128 block scales [N / 128, K / 128]; columns n0 .. n0 + nt lie in one block row, so B has
 * one scale per 128 of K (b_scale [K / 128]). */
void mok__cpu_rows_quantize(float *a, float *a_scale, const uint16_t *src, int rows, int64_t cols);
void mok__cpu_rows_from_e4m3(float *a, float *a_scale, const uint8_t *codes, const float *scales, int rows,
                             int64_t cols);
void mok__cpu_bt_from_e4m3(float *bt, float *b_scale, const uint8_t *w, const float *w_scale, int64_t n0, int nt,
                           int64_t k);
/* acc[r][n] = sum over 128-blocks b of K, in order, of (sum_{k in b} a[r][k] · bt[k][n]) · (a_scale[r][b] ·
 * b_scale[b]), every sum in fp32: the partial sums promoted every 128 of K. */
void mok__cpu_gemm_fp8(float *acc, const float *a, const float *a_scale, int rows, int64_t k, const float *bt,
                       const float *b_scale, int nt);

/* FP8: the matrices of one rank's FP8 weights buffer (args fp8_weights), by mok_fp8_matrix. */
typedef struct cpu_fp8_weights {
    const uint8_t *codes[MOK_FP8_NUM_MATRICES];
    const float *scales[MOK_FP8_NUM_MATRICES];
} cpu_fp8_weights;
cpu_fp8_weights mok__cpu_fp8_weights(const cpu_pass *pass);
/* FP8: expert e's matrix m (rows x cols, e = 0 for the shared ones): its codes and its scales. */
const uint8_t *mok__cpu_fp8_codes(const cpu_fp8_weights *w, int m, int64_t e, int64_t rows, int64_t cols);
const float *mok__cpu_fp8_scales(const cpu_fp8_weights *w, int m, int64_t e, int64_t rows, int64_t cols);

/* tasks_fwd.c: x of this rank's T tokens into its region before the start barrier: copied (bf16)
 * or quantized per token per 128 of H (FP8: the dispatch then moves E4M3 rows and scales). */
void mok__cpu_stage_x(const cpu_pass *pass, const void *x, int64_t num_tokens);
/* One x row (bf16, or FP8 codes and scales) from token `token` of rank p's region into ring slot
 * `slot` of rank q's ring. */
void mok__cpu_copy_x_row(const cpu_pass *pass, int q, int64_t slot, int p, int64_t token);

/* tasks_fwd.c: the facts of row tile rt (first row, real rows, local expert, ring slot of the
 * first row) and the gate/up tile shared by the forward and the backward's replay. */
typedef struct cpu_tile {
    int64_t row0, ring0;
    int nreal, expert;
} cpu_tile;
cpu_tile mok__cpu_tile(const cpu_pass *pass, int64_t rt);
/* FP8 tiles' scratch: the A operand's values go where a bf16 tile's do (the scratch's start), its
 * scales here. */
float *mok__cpu_scratch_a_scale(const cpu_pass *pass, float *scratch);
/* FP8: acc [rows][CPU_N_TILE] = the A operand in scratch (K = k) times columns n0 .. n0 + CPU_N_TILE
 * of FP8 weight matrix m of expert e (0 for the shared expert), an [N, k] matrix (K-major). */
void mok__cpu_gemm_fp8_weight(const cpu_pass *pass, float *scratch, float *acc, int rows, int64_t k, int m, int64_t e,
                              int64_t N, int64_t n0);
void mok__cpu_gateup(const cpu_pass *pass, const cpu_tile *tile, int64_t n0, float *scratch, float *g, float *u);

static inline uint16_t *sym_bf16(const cpu_rank *R, const mok_region_layout *L, int rank, size_t off) {
    return (uint16_t *)(R->peers[rank] + off);
}

#endif
