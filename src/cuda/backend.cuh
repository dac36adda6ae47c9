/* backend.cuh — what the cuda backend's files share on the host side: the checked-call path
 * (every CUDA and NCCL call and every launch goes through CUDA_TRY, NCCL_TRY, LAUNCH_TRY), the
 * state of a group, a workspace and each of its ranks, and the entry points one file gives
 * another. The device side is in device.cuh (memory order, bounded waits' clock, bf16 packing)
 * and error_word.cuh. */
#ifndef MOK_CUDA_BACKEND_CUH
#define MOK_CUDA_BACKEND_CUH

#include <cuda_runtime.h>
#include <nccl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "core/layout.h"
#include "backend.h"
#include "cuda/tuning.h"
#include "internal.h"
}
#include "cuda/core.cuh"
#include "cuda/device.cuh"
#include "cuda/error_word.cuh"

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
 * workspace from the shape (the tuning's cols_gateup, cols_dh, cols_h: 256, 128 or 64);
 * CUDA_N_TILE is the smallest, which sizes the task lists. Weight-gradient tiles are CUDA_WGRAD_M
 * x CUDA_WGRAD_N (the last ones may be narrower, in steps of 64). */
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

typedef struct cuda_group {
    ncclComm_t comm[MOK_MAX_RANKS];
    int device[MOK_MAX_RANKS];
    int num_sms[MOK_MAX_RANKS];
    int64_t l2_bytes[MOK_MAX_RANKS];
} cuda_group;

/* What every rank's workspace must agree on, as it publishes it in its region at creation
 * (workspace.cu: workspace_agree). */
typedef struct cuda_blob {
    mok_shape shape;
    mok_config config;
} cuda_blob;

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
    mok_cuda_tuning tuning;    /* the tuning table, resolved when the workspace was created */
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
    uint8_t *sh_gq;                     /* FP8 with a shared expert whose dg^|du^ code rows do not fit
                                           the window's combine region: [T_max, sh_gq_ld bytes] (else
                                           NULL: they go there, mok__cuda_fp8_shared_codes_fit) */
    float *carry;                       /* [carry_slots, 3 I H]: weight-gradient accumulators of experts
                                           that span macrobatches (bf16 mode) */
    long long carry_slots;
    mok_trace_event *trace;             /* config.trace: [MOK_TRACE_PASSES * trace_cap] events of the last
                                           forward (from 0) and the last backward (from trace_cap) */
    long long trace_cap;                /* events of one pass */
    unsigned long long *trace_count;    /* [MOK_TRACE_PASSES] */
    unsigned long long *counters;       /* [counters_cap + MOK_COUNTER_EXTRA_SLOTS]: pass counters, then
                                           the named slots (core/layout.h) */
    int64_t counters_cap;
    unsigned long long *epoch;          /* device: barriers passed by this rank */
    mok_task_span *spans;              /* device [spans_cap]: the pass's task spans */
    long long spans_cap;
    unsigned long long *spans_published; /* device: the list's count << 1 | complete (task_list.cuh) */
    int *comm_dev;                      /* device: the pass's comm CTA count (spans_kernel) */
    cuda_error_word *error_word;        /* device: the error word (NOTE in error_word.cu) */
    int *error_mirror;                  /* mapped pinned [MIRROR_INTS]: its mirror, the host's view of it */
    int error_clear_pending;            /* host: an argument error was reported, and the device
                                           word is cleared by the next call on this rank */
    int in_window;                      /* counters and ring_{x,y,dy,dyw,w,rdot} point into sym
                                           (the region's `turned`), so they are not cudaFree'd */
    char *sched_mem;                    /* device: backs `sched` */
    cuda_sched_scratch sched;
    unsigned kernel_attrs;              /* host: CUDA_ATTR_* bits of the kernels whose shared-memory
                                           limit is set on this rank's device (cuda_kernel_smem) */
} cuda_rank;

/* A kernel's dynamic shared-memory limit, set the first time a call of this workspace launches it
 * on the rank's device (which must be current: cuda_use_device): the attribute stays with the
 * function on that device, and setting it on every call cost the host microseconds a call. Each
 * kernel's limit is one constant, so every workspace sets the same value. */
#define CUDA_ATTR_SCHED_PLACE 1u
#define CUDA_ATTR_FORWARD 2u
#define CUDA_ATTR_FORWARD_FP8 4u
#define CUDA_ATTR_BACKWARD 8u
#define CUDA_ATTR_BACKWARD_FP8 16u
static inline cudaError_t cuda_kernel_smem(cuda_rank *R, unsigned bit, const void *kernel, size_t bytes) {
    if (R->kernel_attrs & bit) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) R->kernel_attrs |= bit;
    return e;
}

/* Makes `device` current when it is not already (*current: the current device, kept up to date):
 * a pass on one GPU then makes no cudaSetDevice calls, which cost the host microseconds each. */
static inline cudaError_t cuda_use_device(int device, int *current) {
    if (*current == device) return cudaSuccess;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) *current = device;
    return e;
}

typedef struct cuda_workspace {
    mok_region_layout sym; /* every rank's symmetric region (core/layout.h, symmetric.cu) */
    int64_t counters_cap; /* every rank's: the worst plan's counters (mok__counters_max) */
    int num_local;
    cuda_rank ranks[MOK_MAX_RANKS];
} cuda_workspace;

/* ---- what one file gives the others (host side) -------------------------------------------- */
/* barrier.cu: barrier `step` of the workspace's call in progress (ws->call; the rank's schedule
 * build, or for a pass the build in its schedule's header, `schedule`, which the kernel reads) on a
 * rank's stream; tokens_to_publish >= 0 also publishes T. A peer in another call sets
 * MOK_KERR_MISMATCH, a peer whose part of the call failed MOK_KERR_PEER_FAILED. The call words'
 * slots per rank, and the decoding of a word for messages. */
#define CALL_SLOTS 4
mok_status mok__cuda_barrier(mok_workspace *ws, int local_rank, cudaStream_t stream, int64_t tokens_to_publish,
                             int step, const void *schedule);
void mok__cuda_describe_call_word(unsigned long long word, char *out, size_t size);

/* error_word.cu (its NOTE says who writes, reads and clears the word, in which order): the word
 * and its mirror for a rank (total: bytes of device memory, added to), their release, the report
 * at the start of every call, and the stream-ordered half of clearing an argument error, which
 * every call that issues work on a rank runs first, on that work's stream. */
mok_status mok__cuda_error_word_create(cuda_rank *R, size_t *total);
void mok__cuda_error_word_release(cuda_rank *R);
mok_status mok__cuda_check_error_word(mok_workspace *ws);
mok_status mok__cuda_error_word_clear(mok_workspace *ws, int local_rank, cudaStream_t stream);

/* symmetric.cu: the region's layout for a workspace, a rank's region (allocated, cleared, and
 * with a turned transfer the rank's rings and counters pointed into it), the collective
 * registration of every local rank's region with the peer tables, and their release (which keeps
 * a region a peer may still touch: its NOTE). */
void mok__cuda_sym_layout(mok_region_layout *layout, const mok_workspace *ws, int64_t counters_cap);
mok_status mok__cuda_sym_alloc(const cuda_workspace *cw, cuda_rank *R);
mok_status mok__cuda_sym_register(mok_workspace *ws);
mok_status mok__cuda_sym_release(mok_workspace *ws);

/* workspace.cu, an FP8 backward's buffers for a shared expert (backward_fp8.cuh): the bytes of
 * bf16(x^) [T_max, H] at the start of the window's combine region, the row length of the dg^|du^
 * code rows (2 I_s codes, then 2 I_s / 128 scales, 16-byte aligned), and whether those rows fit the
 * region after bf16(x^). */
size_t mok__cuda_fp8_xhat_bytes(const mok_workspace *ws);
long long mok__cuda_fp8_sh_gq_ld(const mok_workspace *ws);
int mok__cuda_fp8_shared_codes_fit(const mok_workspace *ws);
/* The FP8 backward's dy^ code rows (backward_fp8.cuh): their bytes a row, and their offset in the
 * window's combine region, after bf16(x^) and the shared dg^|du^ where those are there, or -1
 * where T_max rows do not fit it (k = 1 with a shared expert, or a wide one). */
long long mok__cuda_fp8_dyq_ld(const mok_workspace *ws);
long long mok__cuda_fp8_dyq_offset(const mok_workspace *ws);

/* fp8_quantize.cu, on `stream`: x [rows, cols] bf16 into E4M3 codes and scales per row per 128
 * columns (an FP8 pass's x^ before its dispatch, the backward's dy^ for the shared expert), row
 * r's codes at q + r * q_ld bytes and its scales at s + r * s_ld floats; and bf16(v^) [rows, cols]
 * from codes [rows, cols] and scales [rows, cols / 128] stored back to back. */
mok_status mok__cuda_fp8_quantize_rows(const uint16_t *x, long long rows, long long cols, uint8_t *q, long long q_ld,
                                       float *s, long long s_ld, int num_sms, cudaStream_t stream);
mok_status mok__cuda_fp8_dequantize_rows(const uint8_t *q, const float *s, long long rows, long long cols, uint16_t *out,
                                         int num_sms, cudaStream_t stream);

/* schedule.cu: sizes one rank's schedule scratch for the workspace's maxima and a device of num_sms SMs; with
 * base (device memory of the returned bytes) set, also points out's arrays into it. */
size_t mok__cuda_sched_scratch(const mok_workspace *ws, int num_sms, char *base, cuda_sched_scratch *out);

#endif
