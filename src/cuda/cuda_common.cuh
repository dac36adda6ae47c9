/* cuda_common.cuh — what the cuda backend's files share: the checked-call path, the per-rank
 * state, and the device helpers for memory order and bounded waits.
 *
 * NOTE (memory order): within a GPU a producer CTA writes its rows, bar.syncs, and one thread
 * makes a gpu-scope release add on the counter; a consumer thread spins with gpu-scope acquire
 * loads, then bar.syncs before the CTA reads the rows (through L2: ld.global / cp.async.cg, never
 * the non-coherent path). Across GPUs the barrier kernel orders memory (system-scope release
 * stores of the epoch into every peer's flag, system-scope acquire loads of its own), and with a
 * turned transfer (cuda_sym_layout.turned) the pass's counters too: they live in the window,
 * where peers wait on and bump them, and every release and acquire on them is system-scope
 * (pass.cuh: counter_acquire, finish_task). */
#ifndef MOK_CUDA_COMMON_CUH
#define MOK_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <nccl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "cuda/task_cols.h"
#include "internal.h"
}
/* The portable core, compiled into this translation unit for host and device. */
#include "core/schedule.c"
#include "core/tasks.c"

#define CUDA_TRY(call)                                                                                   \
    do {                                                                                                 \
        cudaError_t e_ = (call);                                                                         \
        if (e_ != cudaSuccess)                                                                           \
            return mok__fail(MOK_ERR_BACKEND, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
    } while (0)

#define NCCL_TRY(call)                                                                                   \
    do {                                                                                                 \
        ncclResult_t r_ = (call);                                                                        \
        if (r_ != ncclSuccess)                                                                           \
            return mok__fail(MOK_ERR_BACKEND, "%s:%d: %s: %s", __FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
    } while (0)

/* Every launch goes through here: the launch error is checked at once. */
#define LAUNCH_TRY(...)                                                                                  \
    do {                                                                                                 \
        __VA_ARGS__;                                                                                     \
        CUDA_TRY(cudaGetLastError());                                                                    \
    } while (0)

/* GPU tile constants (the tile is 128 x 256, tile_operands.cuh). Column counts are picked per
 * pass from the shape (task_cols.h): gate/up tasks cover n_tile columns of gate and of up (128
 * or 64); SwiGLU-backward tasks n_tile columns of I (256, 128 or 64); down and dx tasks n_tile_h
 * columns of H (256, 128 or 64). CUDA_N_TILE is the smallest, which
 * sizes the task lists. Weight-gradient tiles are CUDA_WGRAD_M x CUDA_WGRAD_N (the last ones may
 * be narrower, in steps of 64). */
#define CUDA_N_TILE 64
#define CUDA_WGRAD_M 128
#define CUDA_WGRAD_N 256
#define CUDA_THREADS 256

/* Whether a pass records its tasks (config.trace). A build with NO_TRACE=1 (MOK_CUDA_NO_TRACE)
 * compiles the trace's code out, to measure what tracing off costs against it; its workspaces
 * refuse config.trace. */
#ifdef MOK_CUDA_NO_TRACE
#define TRACE_ON(p) false
#else
#define TRACE_ON(p) ((p).trace != nullptr)
#endif

/* Error word codes (the kernel never traps; the host reports these). */
#define MOK_KERR_TIMEOUT 1       /* a peer did not reach a barrier in time */
#define MOK_KERR_EXPERT_ID 2     /* topk_ids held an id outside [-1, E) */
#define MOK_KERR_TOKENS 3        /* a peer's T outside [0, T_max] */
#define MOK_KERR_STALL 4         /* a local counter wait timed out (an internal inconsistency) */
#define MOK_KERR_SCHEDULE 5      /* the schedule buffer was not built for this pass */
#define MOK_KERR_MISMATCH 6      /* a peer's barrier carried another call (workspace.cu: call words) */
#define MOK_KERR_PEER_FAILED 7   /* a peer reached a barrier of this call after its own error */

/* The host mirror of a rank's error word: the code, then (MOK_KERR_MISMATCH) the peer and both
 * call words, written by the thread that set the code, before it. */
enum { MIRROR_CODE = 0, MIRROR_PEER = 1, MIRROR_THEIRS = 2, MIRROR_MINE = 4, MIRROR_INTS = 6 };

/* A rank's error word (the NOTE in workspace.cu says who writes and who clears it, in which
 * order): device memory, so that the first-error-wins CAS is a device-scope atomic, with a mirror
 * in mapped pinned host memory that the host reads without synchronising (a system-scope atomic
 * on host memory is not supported over PCIe). Kernels take it as `int *error`: `word` is the first
 * member, so `*(volatile int *)error` reads the device word and set_error keeps its signature. */
typedef struct cuda_error_word {
    int word;    /* 0, or the MOK_KERR_* code of the first error since the word was last cleared */
    int pad;
    int *mirror; /* device address of the host mirror; written by the CTA that wins the CAS */
} cuda_error_word;
static_assert(offsetof(cuda_error_word, word) == 0, "kernels read the error word through an int *");

typedef struct cuda_group {
    ncclComm_t comm[MOK_MAX_RANKS];
    int device[MOK_MAX_RANKS];
    int num_sms[MOK_MAX_RANKS];
} cuda_group;

/* Byte offsets in a symmetric region; equal on every rank. */
typedef struct cuda_sym_layout {
    size_t flags;    /* u64 [MOK_MAX_RANKS]: barrier epoch written by each peer */
    size_t calls;    /* u64 [2][MOK_MAX_RANKS]: the call word of each peer's latest barrier, by the
                        epoch's parity (workspace.cu: barrier_kernel) */
    size_t blob;     /* the rank's shape and config, read by the peers once, at workspace creation */
    size_t tokens;   /* i64: this rank's T for the current pass */
    size_t x;        /* bf16 [T_max, H] */
    size_t router_w; /* f32 [T_max * k] */
    size_t ids;      /* i32 [T_max * k] */
    size_t comb;     /* bf16 [T_max * k, H]: expert outputs pushed in by the experts' owners */
    size_t dy;       /* bf16 [T_max, H] */
    size_t dxbuf;    /* bf16 [T_max * k, H]: routed dx parts pushed in likewise */
    size_t drw;      /* f32 [T_max * k]: router-weight gradients pushed in likewise */
    /* With a transfer turned from its default direction (docs/design.md §2.4a), what peers reach
       besides: the pass's copy of the schedule, the counters and the rings (0 otherwise: they are
       then cudaMalloc'ed, cuda_rank) */
    int turned;
    size_t sched;      /* the rank's schedule as the pass runs it (sched_publish_kernel) */
    size_t counters;   /* u64 [counters_cap + 8] */
    size_t ring_x, ring_y, ring_dy, ring_dyw, ring_w, ring_rdot;
    size_t bytes;
} cuda_sym_layout;

/* Scratch of one rank's schedule build (schedule.cu says which kernel writes what, and when).
 * Each peer's T * k slots are cut into chunks of chunk_slots; num_chunks covers T_max * k. Every
 * build writes all it later reads, so nothing carries over from one build to the next. */
typedef struct cuda_sched_scratch {
    long long chunk_slots; /* slots of one peer per count / place block: PLACE_THREADS * 2^j */
    long long num_chunks;  /* ceil(T_max * k / chunk_slots); 0 when the build cannot run at all */
    int32_t *chunk_counts; /* [num_chunks][P][E_local]: rows of each (chunk, peer) per local expert,
                              then (after the scan) the rows of that peer in the chunks before */
    int32_t *chunk_error;  /* [num_chunks][P]: MOK_SCHED_ERR_* a count block found, or 0 */
    int16_t *slot_expert;  /* [P][T_max * k]: each slot's local expert, -1 for none */
} cuda_sched_scratch;

typedef struct cuda_rank {
    int device, rank, num_sms;
    char *sym;             /* ncclMemAlloc'd, registered as window `win` */
    ncclWindow_t win;
    char **peers;          /* device [P]: every rank's symmetric region */
    uint16_t *ring_x, *ring_h, *ring_y; /* [ring, H], [ring, I], [ring, H] */
    uint16_t *sh_h, *sh_out;            /* [T_max, I_s], [T_max, H] (output, or dx part) */
    /* backward */
    uint16_t *ring_dy, *ring_dyw;       /* [ring, H]: dy rows, bf16(w * dy) rows */
    uint16_t *ring_gu, *ring_dgu;       /* [ring, 2I]: replayed g|u, dg|du */
    float *ring_w, *ring_rdot;          /* [ring], [ring, I / 64] */
    uint16_t *sh_dgu;                   /* [T_max, 2 I_s] */
    float *carry;                       /* [carry_slots, 3 I H]: weight-gradient accumulators of experts
                                           that span macrobatches (bf16 mode) */
    long long carry_slots;
    mok_trace_event *trace;             /* config.trace: [MOK_TRACE_PASSES * trace_cap] events of the last
                                           forward (from 0) and the last backward (from trace_cap) */
    long long trace_cap;                /* events of one pass */
    unsigned long long *trace_count;    /* [MOK_TRACE_PASSES] */
    unsigned long long *counters;       /* [counters_cap + 8]: pass counters, then tickets/abort */
    int64_t counters_cap;
    unsigned long long *epoch;          /* device: barriers passed by this rank */
    mok_task_group *groups;             /* device [groups_cap]: the pass's groups */
    long long groups_cap;
    long long *num_groups;
    int *comm_dev;                      /* device: the pass's comm CTA count (groups_kernel) */
    cuda_error_word *error_word;        /* device: the error word (NOTE in workspace.cu) */
    int *error_mirror;                  /* mapped pinned [MIRROR_INTS]: its mirror, the host's view of it */
    int error_clear_pending;            /* host: an argument error was reported, and the device
                                           word is cleared by the next call on this rank */
    int in_window;                      /* counters and ring_{x,y,dy,dyw,w,rdot} point into sym
                                           (cuda_sym_layout.turned), so they are not cudaFree'd */
    char *sched_mem;                    /* device: backs `sched` */
    cuda_sched_scratch sched;
} cuda_rank;

typedef struct cuda_workspace {
    cuda_sym_layout sym;
    int64_t counters_cap; /* every rank's: the worst plan's counters (mok__counters_max) */
    int num_local;
    cuda_rank ranks[MOK_MAX_RANKS];
} cuda_workspace;

/* ---- device helpers ------------------------------------------------------------------------- */
#ifdef __CUDACC__
static __device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void red_release_gpu(unsigned long long *p, unsigned long long v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void red_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void st_relaxed_sys(int *p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
/* Sets the rank's error word (a cuda_error_word, passed as its first member) to `code` unless an
 * earlier error is there. The CAS is on device memory at device scope; the one thread that wins it
 * copies the code into the host mirror with a plain system-scope store, fenced so that it leaves
 * the GPU before anything this thread writes after it. A thread that loses the CAS writes nothing:
 * the mirror holds the first code, and nothing rewrites it until the word is cleared. */
static __device__ __forceinline__ void set_error(int *error, int code) {
    cuda_error_word *e = (cuda_error_word *)error;
    if (atomicCAS(&e->word, 0, code) != 0) return;
    st_relaxed_sys(e->mirror, code);
    __threadfence_system();
}

static __device__ __forceinline__ long long globaltimer_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Two fp32 to bf16, packed (lo in bits 0-15), by one cvt.rn.bf16x2.f32: round to nearest even,
 * the bits of mok__bf16_from_f32 for every non-NaN value (subnormals and overflow to Inf
 * included), where that portable code takes ~6 integer instructions per value. A NaN comes out
 * as the canonical quiet NaN 0x7fff (the portable code keeps its sign and top payload bits):
 * NaNs flow through as NaNs (DESIGN §5), their bits are not part of the function. Every
 * epilogue rounds through this. */
static __device__ __forceinline__ uint32_t bf16x2_from_f32(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Eight fp32 to eight bf16 (one 16-byte chunk), through bf16x2_from_f32. */
static __device__ __forceinline__ int4 bf16x8_from_f32(const float (&f)[8]) {
    return make_int4((int)bf16x2_from_f32(f[0], f[1]), (int)bf16x2_from_f32(f[2], f[3]),
                     (int)bf16x2_from_f32(f[4], f[5]), (int)bf16x2_from_f32(f[6], f[7]));
}
#endif

/* Host side, defined in the .cu files. */
/* Barrier `step` of the workspace's call in progress (ws->call; the rank's schedule build), on
 * `stream`; publishes T when tokens_to_publish >= 0. */
mok_status mok__cuda_barrier(mok_workspace *ws, int local_rank, cudaStream_t stream, int64_t tokens_to_publish,
                             int step);
mok_status mok__cuda_check_error_word(mok_workspace *ws);
/* The stream-ordered half of clearing the error word (NOTE in workspace.cu): every call that issues
 * work on a rank calls this first, on that work's stream. */
mok_status mok__cuda_error_word_clear(mok_workspace *ws, int local_rank, cudaStream_t stream);
/* Sizes one rank's schedule scratch for the workspace's maxima and a device of num_sms SMs; with
 * base (device memory of the returned bytes) set, also points out's arrays into it. */
size_t mok__cuda_sched_scratch(const mok_workspace *ws, int num_sms, char *base, cuda_sched_scratch *out);

/* Both passes' epilogues: the fixed-order sum of one token's 8-column chunk over its k slots, onto
 * acc (which holds the shared expert's part, or zeros): slot j = 0..k-1 in order, empty slots (id
 * < 0) skipped, each part times w[j] when WEIGHTED (the forward's y) or as it is (the backward's
 * dx). rows[j * ld] is slot j's chunk. Eight slots' ids, weights and rows are loaded before their
 * sums (an empty slot's row is in the buffer too, its bytes unused), so a thread keeps eight row
 * loads in flight instead of one; the sums, and so the bits, are those of the plain loop. */
template <bool WEIGHTED>
static __device__ __forceinline__ void slot_sum8(float (&acc)[8], const int32_t *ids, const float *w,
                                                 const uint16_t *rows, long long ld, int k) {
    for (int j0 = 0; j0 < k; j0 += 8) {
        int4 r[8];
        int32_t id[8];
        float wj[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            id[q] = -1;
            if (j0 + q < k) {
                id[q] = ids[j0 + q];
                wj[q] = WEIGHTED ? w[j0 + q] : 1.0f;
                r[q] = *(const int4 *)(rows + (long long)(j0 + q) * ld);
            }
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            if (id[q] < 0) continue;
            const uint16_t *in = (const uint16_t *)&r[q];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (WEIGHTED) acc[i] += wj[q] * mok__bf16_to_f32(in[i]);
                else acc[i] += mok__bf16_to_f32(in[i]);
            }
        }
    }
}

#endif
