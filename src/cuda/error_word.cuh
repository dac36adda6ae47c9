/* error_word.cuh — a rank's error word: the codes the kernels report (they never trap), the word
 * and its host mirror, and set_error, the one way a kernel writes it. error_word.cu says who
 * writes, reads and clears it, in which order, and holds the host's side. */
#ifndef MOK_CUDA_ERROR_WORD_CUH
#define MOK_CUDA_ERROR_WORD_CUH

#include <stddef.h>

#include "core/schedule.h"
#include "cuda/device.cuh"

/* Error word codes (the kernel never traps; the host reports these). */
#define MOK_KERR_TIMEOUT 1       /* a peer did not reach a barrier in time */
#define MOK_KERR_EXPERT_ID 2     /* topk_ids held an id outside [-1, E) */
#define MOK_KERR_TOKENS 3        /* a peer's T outside [0, T_max] */
#define MOK_KERR_STALL 4         /* a local counter wait timed out (an internal inconsistency) */
#define MOK_KERR_SCHEDULE 5      /* the schedule buffer was not built for this pass (no schedule, a
                                    failed build, another T) */
#define MOK_KERR_MISMATCH 6      /* a peer's barrier carried another call (barrier.cu: call words) */
#define MOK_KERR_PEER_FAILED 7   /* a peer reached a barrier of this call after its own error */
/* A schedule or a context whose tag (core/schedule.h) says it is not the pass's: the code of the
 * tag check (MOK_TAG_*) after the codes above, with the value found and the one expected in the
 * mirror. MOK_KERR_TAG_BASE itself is no code. */
#define MOK_KERR_TAG_BASE 7
#define MOK_KERR_SCHEDULE_WORKSPACE (MOK_KERR_TAG_BASE + MOK_TAG_SCHEDULE_WORKSPACE) /* 8: another workspace's */
#define MOK_KERR_SCHEDULE_RANK (MOK_KERR_TAG_BASE + MOK_TAG_SCHEDULE_RANK)           /* 9: another rank's */
#define MOK_KERR_CONTEXT_MISSING (MOK_KERR_TAG_BASE + MOK_TAG_CONTEXT_MISSING)       /* 10: no forward wrote it */
#define MOK_KERR_CONTEXT_WORKSPACE (MOK_KERR_TAG_BASE + MOK_TAG_CONTEXT_WORKSPACE)   /* 11: another workspace's */
#define MOK_KERR_CONTEXT_RANK (MOK_KERR_TAG_BASE + MOK_TAG_CONTEXT_RANK)             /* 12: another rank's */
#define MOK_KERR_CONTEXT_BUILD (MOK_KERR_TAG_BASE + MOK_TAG_CONTEXT_BUILD)           /* 13: another build's */
#define MOK_KERR_FP8_WEIGHTS 14  /* an FP8 pass's fp8_weights header is not mok_quantize_weights' for
                                    the workspace's shape */

/* The host mirror of a rank's error word: the code, then (MOK_KERR_MISMATCH, MOK_KERR_PEER_FAILED)
 * the peer and both call words, or (the tag codes) the value found and the one expected in
 * THEIRS and MINE, written by the thread that set the code, before it. */
enum { MIRROR_CODE = 0, MIRROR_PEER = 1, MIRROR_THEIRS = 2, MIRROR_MINE = 4, MIRROR_INTS = 6 };

/* A rank's error word (the NOTE in error_word.cu says who writes and who clears it, in which
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

#ifdef __CUDACC__
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

/* set_error with what the host's message needs: the value found and the one expected (the tag
 * codes), written into the mirror before the code, by the thread that wins the CAS. */
static __device__ __forceinline__ void set_error_values(int *error, int code, long long found, long long expected) {
    cuda_error_word *e = (cuda_error_word *)error;
    if (atomicCAS(&e->word, 0, code) != 0) return;
    int *m = e->mirror;
    st_relaxed_sys(m + MIRROR_THEIRS, (int)(found & 0xffffffffll));
    st_relaxed_sys(m + MIRROR_THEIRS + 1, (int)((unsigned long long)found >> 32));
    st_relaxed_sys(m + MIRROR_MINE, (int)(expected & 0xffffffffll));
    st_relaxed_sys(m + MIRROR_MINE + 1, (int)((unsigned long long)expected >> 32));
    __threadfence_system();
    st_relaxed_sys(m + MIRROR_CODE, code);
    __threadfence_system();
}
#endif

#endif
