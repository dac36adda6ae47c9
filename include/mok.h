/* mok.h — the whole public C11 API of mok, a Mixture-of-Experts layer run as one persistent
 * kernel per pass across an expert-parallel (EP) group.
 *
 * The function (every backend computes it, with the same rounding points):
 *
 *   FFN_e(v) = W_down[e] · bf16( silu(g) ⊙ u ),   g = bf16(W_gate[e]·v),  u = bf16(W_up[e]·v)
 *   y[t]     = bf16( FFN_shared(x[t]) + Σ_{j, e = topk_ids[t,j] >= 0} router_w[t,j] · FFN_e(x[t]) )
 *
 * Products accumulate in fp32; every expert output (the shared one too) is rounded to bf16 before
 * the fp32 sum, done in the order shared, then j = 0..k-1. With a SwiGLU limit L > 0, g is clamped
 * above at L and u to [-L, L] before silu(g)·u (NaN passes through the clamp as NaN).
 *
 * Backward, given dy: dx (fp32 sum of the shared part and the k routed parts, in that order, each
 * part rounded to bf16, the sum rounded once), d_router_w[t,j] = <dy[t], FFN_e(x[t])> with the
 * expert output taken before its bf16 rounding (= <dy[t] · W_down[e], h>), computed without
 * dividing by the weight (exact for zero and negative weights), and every weight gradient,
 * accumulated in fp32 over rows in schedule order and written as bf16 or added in place into the
 * caller's fp32 buffers. Empty slots (-1) get d_router_w = 0.
 *
 * Layouts (row-major, PyTorch nn.Linear [out, in] for weights):
 *   x, y, dy, dx        [T, H]            bf16 (uint16_t bit patterns)
 *   topk_ids            [T, k]            int32, global expert id in [0, E) or -1 (empty slot)
 *   router_w, d_router  [T, k]            fp32
 *   w_gate, w_up        [E_local, I, H]   bf16, the experts this rank owns (E_local = E / P)
 *   w_down              [E_local, H, I]   bf16
 *   s_gate, s_up        [I_s, H]          bf16, the shared expert (NULL when I_s = 0)
 *   s_down              [H, I_s]          bf16
 * Expert e lives on rank e / E_local, as local expert e % E_local.
 *
 * Memory: on the cpu backend every pointer is host memory; on the cuda backend every pointer is
 * device memory of the rank's GPU, and calls are asynchronous on the given stream. Every pointer
 * must be 16-byte aligned. The schedule and the forward context are caller memory (sizes from
 * mok_workspace_sizes), so that one workspace serves many layers: a context belongs to one layer
 * call, the workspace only to the duration of a pass.
 *
 * Precision: the above is MOK_PRECISION_BF16. MOK_PRECISION_FP8 computes the same function with
 * its GEMM operands block-quantized to E4M3, at the points the FP8 section below states.
 *
 * Errors: every call returns a mok_status; on failure mok_last_error() (thread-local) names the
 * argument and the rule it broke. The library never exits, aborts or traps, and no wait on a peer
 * lasts longer than config.peer_timeout_ms: a barrier, or a pass's wait on a peer's counter (on
 * cpu a wait on the rank's own counters gives up when the rank has made no progress for that long;
 * its own work, however long, is not a hang).
 *
 * Collective calls (workspace create and destroy, schedule build, forward, recompute, backward):
 * every rank of a group makes the same ones in the same order, on workspaces created in the same
 * order, and a pass on every rank reads the same schedule build. Each call carries what it is (its
 * kind, its number on the workspace, the workspace's shape and config, the schedule build it
 * writes or, on cpu, reads: a cuda pass's schedule is not read on the host) to the peers; a rank
 * that meets a peer in another call fails, as does the peer, at once and with a message naming
 * both sides ("rank 1 is in mok_backward #3 ... while this rank (0) is in mok_forward #3 ...").
 * Such a failure touches nothing: the ranks may go on with matching calls. On cuda the device
 * barrier finds it, neither pass runs, and the error word reports it at the rank's next call or
 * mok_synchronize, as for any error found on the device; so does a rank whose peer's part of the
 * call failed. Workspace creation compares the ranks' shapes and configs there too (one process
 * per rank).
 *
 * After a timeout (and after a rank destroyed a workspace while a peer was in another call) the
 * group is unusable on every rank: each rank's next call fails at once with MOK_ERR_STATE, naming
 * the rank that failed. Destroy its workspaces and the group. A peer may then still be inside a
 * pass that reads or writes this rank's symmetric memory, so that memory is not freed under it:
 * on cpu it is kept until the last rank of the group has destroyed its group; on cuda, in a group
 * of one process per rank, it stays allocated for the life of the process (the communicator is
 * aborted, not destroyed). In local mode (one handle drives every rank) every call has ended on
 * every rank when it returns, and everything is freed.
 */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The one home of mok's version: the library (mok_version), the `mok` command (mok --version) and
 * the Python package (python/setup.py reads these three lines; mok.__version__) take it from here. */
#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 1
#define MOK_VERSION_PATCH 0
#define MOK_VERSION (MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH)

/* Shape granularity. H, I and I_s are multiples of MOK_DIM_TILE; every expert's row segment in
 * the schedule is padded to MOK_ROW_TILE rows so that a GEMM row tile never mixes experts;
 * minibatch_rows is a multiple of MOK_ROW_TILE and ring_rows a multiple of minibatch_rows. */
#define MOK_DIM_TILE 64
#define MOK_ROW_TILE 128
#define MOK_MAX_RANKS 72
#define MOK_ALIGN 16
/* Bytes at the start of every forward context that hold its tag: which workspace's pass wrote it,
 * with which schedule build, as which rank (mok_forward_args.context). */
#define MOK_CONTEXT_TAG_BYTES 256

/* One table makes the status enum and its strings. */
#define MOK_STATUS_TABLE(X)                                                                   \
    X(MOK_OK, 0, "ok")                                                                        \
    X(MOK_ERR_INVALID_ARGUMENT, 1, "invalid argument")                                        \
    X(MOK_ERR_UNSUPPORTED, 2, "not supported by this build or backend")                       \
    X(MOK_ERR_OUT_OF_MEMORY, 3, "out of memory")                                              \
    X(MOK_ERR_BACKEND, 4, "backend call failed (CUDA, NCCL or the host)")                     \
    X(MOK_ERR_TIMEOUT, 5, "timed out waiting for a peer rank")                                \
    X(MOK_ERR_DEVICE_FAULT, 6, "the kernel reported an inconsistency in its error word")      \
    X(MOK_ERR_STATE, 7, "the group or workspace is unusable after an earlier failure")        \
    X(MOK_ERR_INTERNAL, 8, "internal error")

typedef enum mok_status {
#define MOK_X_ENUM(name, value, text) name = value,
    MOK_STATUS_TABLE(MOK_X_ENUM)
#undef MOK_X_ENUM
} mok_status;

typedef enum mok_backend {
    MOK_BACKEND_AUTO = 0, /* cuda when this build has it and a GPU is present, else cpu */
    MOK_BACKEND_CPU = 1,
    MOK_BACKEND_CUDA = 2
} mok_backend;

typedef enum mok_precision {
    MOK_PRECISION_BF16 = 0, /* bf16 storage, fp32 accumulation */
    MOK_PRECISION_FP8 = 1   /* block-scaled E4M3 operands, fp32 accumulation: the FP8 section
                               below */
} mok_precision;

/* The direction of each transfer. PULL: the rank that needs the rows reads them from the peer.
 * PUSH: the rank that has them writes them into the peer. */
typedef enum mok_direction { MOK_PULL = 0, MOK_PUSH = 1 } mok_direction;

/* Tuning and behaviour. Always start from MOK_CONFIG_INIT and change fields; `size` lets the
 * library (and a binding) check that it receives the struct it expects. */
typedef struct mok_config {
    size_t size;            /* sizeof(mok_config) */
    int fwd_comm_sms;       /* CTAs that move data in the forward (cuda); 0 = the backend's choice
                               from the layer's bytes per FLOP (the tuning knob fwd_comm_ctas:
                               src/cuda/tuning.h, mok_workspace_tuning) */
    int bwd_comm_sms;       /* the same for the backward */
    int minibatch_rows;     /* comm->compute handover unit; multiple of MOK_ROW_TILE */
    int ring_rows;          /* rows of the ring token buffer (one macrobatch); multiple of
                               minibatch_rows. Default 32768: half the macrobatches of 16384, so
                               half the experts whose weight gradients carry across one, for the
                               memory of the larger ring */
    int64_t context_rows;   /* routed rows whose gate/up activations the forward context keeps;
                               rows past it are replayed (recomputed) in the backward.
                               0 = all rows the worst case can route to a rank */
    float swiglu_limit;     /* > 0: clamp limit; 0: no clamp */
    double peer_timeout_ms; /* longest wait on a peer before MOK_ERR_TIMEOUT; in (0, 1e9] */
    int cpu_threads;        /* cpu backend: worker threads per rank, movers included (0 = one
                               compute thread per core plus cpu_comm_threads movers; else in
                               [2, 1024]) */
    int cpu_comm_threads;   /* cpu backend: how many of cpu_threads move data; in [1, 1024] */
    /* The transfers' directions (mok_direction), each either way on every backend with the same
       results bit for bit; the defaults are the faster ones measured (docs/log.md). */
    int fwd_dispatch;       /* MOK_PULL; MOK_PUSH: each rank writes its x rows into the peers'
                               rings */
    int fwd_combine;        /* MOK_PUSH; MOK_PULL: each rank gathers its expert outputs from the
                               peers' rings */
    int bwd_combine;        /* reverse-combine of dy: MOK_PULL; MOK_PUSH: each rank writes its dy
                               and x rows and router weights into the peers' rings */
    int bwd_dispatch;       /* reverse-dispatch of dx parts: MOK_PUSH; MOK_PULL: each rank gathers
                               its dx parts and router-weight gradients */
    int trace;              /* 1: record each worker's tasks for mok_trace_write (the last forward
                               and the last backward, each in a buffer of its own) */
} mok_config;

#define MOK_CONFIG_INIT                                                                       \
    {                                                                                         \
        sizeof(mok_config), 0, 0, 4096, 32768, 0, 0.0f, 10000.0, 0, 1, MOK_PULL, MOK_PUSH, \
            MOK_PULL, MOK_PUSH, 0                                                             \
    }

/* The layer. Every rank of a group must create its workspace with the same shape. */
typedef struct mok_shape {
    int64_t hidden;              /* H, multiple of MOK_DIM_TILE */
    int64_t intermediate;        /* I of a routed expert, multiple of MOK_DIM_TILE */
    int64_t num_experts;         /* E, global; a multiple of the group size P */
    int64_t topk;                /* k, 1 <= k <= E */
    int64_t shared_intermediate; /* I_s of the shared expert, multiple of MOK_DIM_TILE; 0 = none */
    int64_t max_tokens;          /* T_max, tokens per rank per call; >= 1 */
    int precision;               /* mok_precision */
} mok_shape;

typedef struct mok_unique_id {
    char bytes[128];
} mok_unique_id;

typedef struct mok_group mok_group;
typedef struct mok_workspace mok_workspace;

/* Sizes that a workspace implies, in bytes. */
typedef struct mok_sizes {
    size_t schedule_bytes;   /* caller buffer for one schedule (per local rank) */
    size_t context_bytes;    /* caller buffer for one forward context (per local rank) */
    size_t symmetric_bytes;  /* symmetric memory the workspace holds per rank */
    size_t workspace_bytes;  /* all memory the workspace holds per rank, symmetric included */
    int64_t max_routed_rows; /* padded rows the worst case can route to one rank */
} mok_sizes;

/* What a built schedule says about one rank (read back on the host; on cuda this waits for the
 * stream). */
typedef struct mok_schedule_info {
    int64_t num_tokens[MOK_MAX_RANKS]; /* T of every rank of the group */
    int64_t routed_rows;               /* (token, slot) pairs routed to this rank's experts */
    int64_t padded_rows;               /* the same, each expert padded to MOK_ROW_TILE */
    int64_t num_minibatches;
    int64_t num_macrobatches;
    int64_t max_expert_rows; /* rows of this rank's busiest expert */
} mok_schedule_info;

/* Arguments of one local rank. Calls take an array of them, one per local rank of the group
 * (1 when each process drives one rank, P when one process drives all), in local-rank order. */
typedef struct mok_schedule_args {
    int64_t num_tokens;       /* T <= T_max; 0 allowed */
    const int32_t *topk_ids;  /* [T, k] */
    void *schedule;           /* out: schedule_bytes */
    void *stream;             /* cudaStream_t (cuda); ignored on cpu */
} mok_schedule_args;

typedef struct mok_forward_args {
    int64_t num_tokens;      /* must equal the T the schedule was built with */
    const void *schedule;    /* from mok_schedule_build */
    const void *x;           /* [T, H] bf16 */
    const float *router_w;   /* [T, k] */
    const void *w_gate;      /* [E_local, I, H] */
    const void *w_up;        /* [E_local, I, H] */
    const void *w_down;      /* [E_local, H, I]; not read by mok_recompute_context */
    const void *s_gate;      /* [I_s, H]; NULL iff I_s = 0 */
    const void *s_up;        /* [I_s, H] */
    const void *s_down;      /* [H, I_s]; not read by mok_recompute_context */
    void *y;                 /* out [T, H]; not written by mok_recompute_context (may be NULL) */
    void *context;           /* out: context_bytes, read by mok_backward. Need not be cleared: the
                                pass writes its tag (the first MOK_CONTEXT_TAG_BYTES: which
                                workspace, schedule build and rank wrote it; the backward checks
                                it), from there the routed rows it keeps (the schedule's padded
                                rows, at most the context rows, 2·I bf16 each, padding rows as
                                zeros) and, from the next 256-byte boundary after the context
                                rows' space, the shared expert's 2·I_s bf16 for each of the T
                                tokens; the backward reads nothing else */
    void *stream;
    const void *fp8_weights; /* FP8 workspaces: this rank's buffer written by mok_quantize_weights
                                from the weights above (mok_fp8_layout); NULL for bf16 */
} mok_forward_args;

typedef struct mok_backward_args {
    int64_t num_tokens;
    const void *schedule;
    const void *context;     /* left by mok_forward or mok_recompute_context with this schedule
                                build, on this workspace and rank (its tag says so) */
    const void *dy;          /* [T, H] bf16 */
    const void *x;           /* [T, H] the forward's x */
    const float *router_w;   /* [T, k] the forward's weights */
    const void *w_gate, *w_up, *w_down; /* routed weights, as in the forward */
    const void *s_gate, *s_up, *s_down; /* shared weights or NULL */
    void *dx;                /* out [T, H] bf16 */
    float *d_router_w;       /* out [T, k] fp32 */
    /* Weight gradients, in the weights' layouts. accumulate = 0: bf16, overwritten (experts that
     * received no rows get zeros). accumulate = 1: fp32, the gradient is added in place (fp32
     * accumulation starts from the buffer's value); experts with no rows are left untouched. */
    int accumulate;
    void *dw_gate, *dw_up, *dw_down;
    void *ds_gate, *ds_up, *ds_down; /* NULL iff I_s = 0 */
    void *stream;
    const void *fp8_weights; /* FP8 workspaces: as in mok_forward_args; NULL for bf16 */
} mok_backward_args;

/* ---- version, errors ---------------------------------------------------------------------- */
int mok_version(void);                 /* MOK_VERSION of the library */
size_t mok_config_struct_size(void);   /* sizeof(mok_config) the library was built with */
const char *mok_status_string(mok_status status);
const char *mok_last_error(void);      /* this thread's message for its last failed call */
mok_config mok_config_default(void);   /* MOK_CONFIG_INIT, for bindings */
mok_status mok_config_validate(const mok_config *config);
mok_status mok_shape_validate(const mok_shape *shape, int nranks);

/* ---- backends and groups ------------------------------------------------------------------ */
/* cpu and auto: 1. cuda: the number of usable GPUs (0 when the build has no CUDA backend or the
 * machine no GPU). */
int mok_backend_available(mok_backend backend);
const char *mok_backend_name(mok_backend backend);

/* A fresh id for mok_group_create; rank 0 makes it and sends it to the others by any channel.
 * On cpu, ranks are threads of one process that share the id. */
mok_status mok_unique_id_create(mok_backend backend, mok_unique_id *id);

/* One process (or thread, on cpu) per rank. Collective: every rank calls it with the same id
 * and nranks; a rank that does not join within config->peer_timeout_ms makes the others fail
 * with MOK_ERR_TIMEOUT. Each rank joins once: on cpu a second handle for a rank that a handle of
 * the same id holds is refused. device: the GPU of this rank (cuda), ignored on cpu. */
mok_status mok_group_create(mok_group **group, mok_backend backend, int nranks, int rank,
                            const mok_unique_id *id, int device, const mok_config *config);

/* One process drives all nranks ranks. devices: nranks GPU ordinals (cuda), NULL on cpu. */
mok_status mok_group_create_local(mok_group **group, mok_backend backend, int nranks,
                                  const int *devices, const mok_config *config);
/* Workspaces first: it refuses (and keeps the group) while a workspace made on it lives. Calls on
 * one group handle and its workspaces come from one thread at a time. */
mok_status mok_group_destroy(mok_group *group);

/* nranks, local ranks driven by this handle, the first local rank's index, the backend. */
mok_status mok_group_info(const mok_group *group, int *nranks, int *num_local_ranks,
                          int *first_rank, mok_backend *backend);

/* ---- workspace ---------------------------------------------------------------------------- */
/* Collective: every rank creates its workspace with the same shape and the same minibatch_rows,
 * ring_rows, context_rows, swiglu_limit and transfer directions (the other fields are each rank's
 * own); a difference is refused on every rank, naming the field. All buffers are allocated here,
 * none per call. config may be NULL (the group's). */
mok_status mok_workspace_create(mok_workspace **workspace, mok_group *group,
                                const mok_shape *shape, const mok_config *config);
/* Collective too: every rank destroys its workspaces in the same order. The handle is gone
 * whatever it returns; a destroy that met a peer in another call returns that error and makes the
 * group unusable (the memory rule above). */
mok_status mok_workspace_destroy(mok_workspace *workspace);
mok_status mok_workspace_sizes(const mok_workspace *workspace, mok_sizes *sizes);
/* The workspace's tuning as its backend resolved it at creation, as "name=value" pairs separated
 * by single spaces (the cuda backend's knobs, with their defaults, environment variables and what
 * each does: src/cuda/tuning.h; a cpu workspace has none and gets ""). size: the bytes of text,
 * the NUL included; a text that does not fit is MOK_ERR_INVALID_ARGUMENT, with the size it needs
 * in the message. */
mok_status mok_workspace_tuning(const mok_workspace *workspace, char *text, size_t size);

/* ---- passes (collective; args has one entry per local rank) -------------------------------
 * A schedule serves the workspace and local rank that built it, until it is built again. A backward
 * reads the context that a forward or recompute wrote with the same schedule build. The schedule
 * and the context carry tags that say so (the schedule's header, the context's first
 * MOK_CONTEXT_TAG_BYTES): the workspace (a value unique in the process for its life), the schedule
 * build (the number of its mok_schedule_build call on the workspace) and the rank. A pass refuses a
 * schedule another workspace built or built for another rank; a backward refuses a context no
 * forward or recompute wrote, one another workspace or rank wrote, and one written with another
 * schedule build than its schedule's (the schedule was built again after the forward, or the
 * context is another layer call's). The tags travel with the bytes: a copy of a schedule or a
 * context into another buffer serves as the original does. On cpu the tags are checked on the
 * host before the pass, and a schedule whose contents were changed after its build is refused;
 * on cuda one device thread of the pass checks them, and the refusal is reported at the rank's
 * next call or mok_synchronize, as any error found on the device (the pass does nothing). */
mok_status mok_schedule_build(mok_workspace *workspace, const mok_schedule_args *args);
/* The schedule must be this workspace's and local_rank's. */
mok_status mok_schedule_read(mok_workspace *workspace, const void *schedule, int local_rank,
                             mok_schedule_info *info);
mok_status mok_forward(mok_workspace *workspace, const mok_forward_args *args);
mok_status mok_backward(mok_workspace *workspace, const mok_backward_args *args);
/* Rebuilds the forward context (activation checkpointing); bitwise equal to the forward's. */
mok_status mok_recompute_context(mok_workspace *workspace, const mok_forward_args *args);

/* ---- FP8 (shape.precision = MOK_PRECISION_FP8) -------------------------------------------
 * The bf16 function above with every GEMM operand replaced by its block-quantized value. Every
 * rounding point of the bf16 function stays; quantization Q is added at the points listed here.
 * H, I and I_s (when not 0) are multiples of MOK_FP8_BLOCK.
 *
 * E4M3 (OCP FP8): sign, 4 exponent bits (bias 7), 3 mantissa bits; normals (1 + m/8)·2^(E-7) for
 * E = 1..15 up to 448 = 1.75·2^8, subnormals m·2^-9, ±0, no infinities, NaN = S.1111.111.
 *
 * Q of a block of values v: activations in blocks of 1 x MOK_FP8_BLOCK along the GEMM's K (one
 * row's columns [128b, 128b + 128)), weights in blocks of 128 x 128 of the [out, in] matrix.
 *   amax  = max |v| over the block's finite values (0 when it has none);
 *   e     = the smallest integer >= -124 with amax <= 448 · 2^e, i.e. max(ceil(log2(amax / 448)),
 *           -124); e = 0 when amax = 0. The scale is s = 2^e, an fp32 power of two (an E8M0 scale:
 *           MX-compatible, every rescaling exact);
 *   q     = E4M3(v / s), rounded to nearest, ties to the even mantissa. |v / s| <= 448 by
 *           construction, so nothing saturates or overflows;
 *   v^    = q · s, the dequantized value: exact in bf16 and fp32 (e >= -124 keeps even the
 *           smallest subnormal, 2^-9 · s, on the bf16 grid).
 *   NaN and ±Inf: amax ignores them and they become the E4M3 NaN (0x7f or 0xff; which one is not
 *   part of the function), so a non-finite value flows on as NaN, never as a finite number (an
 *   Inf does not saturate to 448), and leaves the block's scale and its other values as they would
 *   be without it. A block with no finite value other than zeros has s = 1.
 * Every quantized operand is the quantization of a bf16 value: an input (x, dy, the weights) or a
 * bf16 rounding point of the function (h, dg, du).
 *
 * A GEMM of quantized operands, C[m, n] = sum over k of A[m, k] · B[k, n]: K runs in blocks b of
 * 128 in increasing order; partial_b = sum over k in b of q_A · q_B (the products are exact; the
 * order and the accumulator inside a block are the backend's: fp32 on the cpu, the tensor cores'
 * on a GPU, which on Hopper keep fewer bits than fp32, whence the blocks), then
 * acc = acc + partial_b · (s_A · s_B) in fp32, with s_A the scale of A's block (m, b) and s_B that
 * of B's block (b, n) (s_A · s_B is a power of two: the scaling is exact unless it leaves fp32's
 * normal range, so a fused multiply-add gives the same); acc starts at 0. The partial sums are so
 * promoted to fp32 every 128 of K. The reference sums v^_A · v^_B in fp64.
 *
 * Forward:
 *   x^ = Q(x), per token per 128 of H, once, before the dispatch: the dispatch moves E4M3 rows and
 *        their scales. W^ = Q(W) per 128 x 128 block of every weight (mok_quantize_weights);
 *   g = bf16(W^_gate · x^), u = bf16(W^_up · x^) (the context keeps g, u in bf16 as for bf16);
 *   h = bf16(silu(g) ⊙ u) as above (clamp included); h^ = Q(h) per row per 128 of I;
 *   FFN_e(x) = W^_down · h^, rounded to bf16; y as above (fp32 sum of bf16 outputs, rounded once).
 *   The shared expert the same way, from the same x^.
 * Backward (x^ as in the forward: the reverse-combine moves its E4M3 rows and scales):
 *   dy^ = Q(dy) per token per 128 of H; dh = w · (dy^ · W^_down) in fp32 (K = H);
 *   d_router_w[t,j] = <dy^ · W^_down, h^> (the derivative of the FP8 forward with dy replaced by
 *        dy^; no division by the weight), h^ recomputed bit for bit from the context's g, u;
 *   dg, du = bf16 of the SwiGLU backward of dh as above; dg^ = Q(dg), du^ = Q(du) per row per 128
 *        of I; dx part = bf16(dg^ · W^_gate + du^ · W^_up), one GEMM over K = 2I (dg's blocks,
 *        then du's); dx as above;
 *   weight gradients take bf16 operands, the current choice (docs/log.md has what FP8
 *        weight-gradient GEMMs, operands quantized along the tokens, would gain):
 *        dW_gate = sum dg ⊗ x^, dW_up = sum du ⊗ x^, dW_down = sum bf16(w · dy) ⊗ h^ (x^, h^
 *        dequantized, exact in bf16; dg, du, dy unquantized), accumulated and written as above.
 *   The shared expert the same way with w = 1.
 * The backward's GEMMs on Hopper need both operands K-major, so the weights come twice: as
 * [out, in] for the forward (K = in) and transposed for the backward (K = out). The transposed
 * copies hold the same E4M3 values and scales, transposed: every GEMM uses the same W^. The passes
 * take them (args fp8_weights) beside the bf16 weights, which stay required but which the FP8
 * GEMMs do not read.
 *
 * Memory: an FP8 workspace holds no more than the bf16 one of the same shape and config
 * (mok_sizes), but for one case on the cuda backend: with a shared expert whose backward operands
 * dg^|du^ (2 I_s + I_s / 16 bytes per token) do not fit beside bf16(x^) in the buffer of the
 * forward's expert outputs (2 k H bytes per token), i.e. for top-k 1 or I_s near k H, it holds
 * them apart. The FP8 weights are caller memory of mok_fp8_layout.bytes per rank. */
#define MOK_FP8_BLOCK 128

/* The matrices of one rank's FP8 weights. Codes are uint8 E4M3, row-major; scales are fp32, one
 * per 128 x 128 block, row-major over the blocks:
 *   W_GATE, W_UP  [E_local, I, H]   scales [E_local, I/128, H/128]
 *   W_DOWN        [E_local, H, I]   scales [E_local, H/128, I/128]
 *   W_GATE_T, W_UP_T [E_local, H, I], W_DOWN_T [E_local, I, H]: each expert's matrix transposed
 *                 (and its scales: [E_local, H/128, I/128], [E_local, I/128, H/128])
 *   S_*           the shared expert the same way without E_local; empty when I_s = 0. */
typedef enum mok_fp8_matrix {
    MOK_FP8_W_GATE = 0, MOK_FP8_W_UP, MOK_FP8_W_DOWN, MOK_FP8_W_GATE_T, MOK_FP8_W_UP_T, MOK_FP8_W_DOWN_T,
    MOK_FP8_S_GATE, MOK_FP8_S_UP, MOK_FP8_S_DOWN, MOK_FP8_S_GATE_T, MOK_FP8_S_UP_T, MOK_FP8_S_DOWN_T,
    MOK_FP8_NUM_MATRICES
} mok_fp8_matrix;

/* Where mok_quantize_weights puts each matrix in one rank's buffer (byte offsets, each a multiple
 * of 256; the buffer starts with a header that the passes check). */
typedef struct mok_fp8_layout {
    size_t bytes;                          /* the whole buffer, per rank */
    size_t codes[MOK_FP8_NUM_MATRICES];    /* offset of each matrix's E4M3 codes */
    size_t scales[MOK_FP8_NUM_MATRICES];   /* offset of its block scales */
} mok_fp8_layout;

/* One local rank's weights to quantize: the bf16 master weights as in mok_forward_args. */
typedef struct mok_quantize_args {
    const void *w_gate, *w_up, *w_down; /* [E_local, I, H], [E_local, I, H], [E_local, H, I] */
    const void *s_gate, *s_up, *s_down; /* shared: NULL iff I_s = 0 */
    void *fp8_weights;                  /* out: mok_fp8_layout.bytes */
    void *stream;                       /* cudaStream_t (cuda); ignored on cpu */
} mok_quantize_args;

/* The layout of one rank's FP8 weights for an FP8 workspace. */
mok_status mok_workspace_fp8_layout(const mok_workspace *workspace, mok_fp8_layout *layout);

/* Writes the FP8 weights (codes, scales, transposed copies) of every local rank (args has one
 * entry per local rank), deterministically: the same bits for the same weights on every call and
 * every rank. Call it after each change of the master weights (once per optimizer step): the FP8
 * passes' GEMMs read these weights only, so a stale buffer computes with the old weights. Not
 * collective. */
mok_status mok_quantize_weights(mok_workspace *workspace, const mok_quantize_args *args);

/* E4M3 helpers for callers (round to nearest even; NaN and ±Inf give NaN, as do magnitudes that
 * round past 448). */
uint8_t mok_e4m3_from_float(float value);
float mok_e4m3_to_float(uint8_t value);

/* ---- memory and synchronisation, for callers without an allocator of their own -----------
 * Memory where a local rank's backend wants it: device memory of its GPU (cuda) or host memory
 * (cpu), MOK_ALIGN-aligned; bytes <= PTRDIFF_MAX. mok_memory_copy is synchronous. */
typedef enum mok_copy_kind {
    MOK_COPY_HOST_TO_RANK = 0,
    MOK_COPY_RANK_TO_HOST = 1,
    MOK_COPY_RANK_TO_RANK = 2 /* within the same local rank's memory */
} mok_copy_kind;
mok_status mok_memory_alloc(mok_group *group, int local_rank, size_t bytes, void **ptr);
mok_status mok_memory_free(mok_group *group, int local_rank, void *ptr);
mok_status mok_memory_copy(mok_group *group, int local_rank, void *dst, const void *src, size_t bytes,
                           mok_copy_kind kind);
/* Waits until every pass issued on every local rank has finished, then reports any error the
 * kernels recorded (timeouts, bad ids). On cpu every call is already synchronous. */
mok_status mok_synchronize(mok_workspace *workspace);

/* Writes the tasks recorded (config.trace = 1) by the workspace's last forward (or recompute) and
 * its last backward as Chrome trace JSON, both passes on one time axis in microseconds: one
 * process per (rank, pass), named "rank R forward" / "rank R backward" (pid R / MOK_MAX_RANKS + R),
 * one thread per worker (cpu thread or GPU CTA), named "comm worker W" / "compute worker W", one
 * complete event per task (args: rank, pass, minibatch). A pass not run yet adds nothing. */
mok_status mok_trace_write(mok_workspace *workspace, const char *path);

/* ---- reference (host memory, all ranks at once, fp64 accumulation; for tests) -------------
 * Arrays of pointers have one entry per rank. Outputs follow the rounding points above; with
 * shape->precision = MOK_PRECISION_FP8 the FP8 function (it quantizes the bf16 weights itself). */
typedef struct mok_ref_layer {
    const mok_shape *shape;
    int nranks;
    float swiglu_limit;
    const int64_t *num_tokens;                /* [P] */
    const void *const *x;                     /* [P] -> [T_p, H] */
    const int32_t *const *topk_ids;           /* [P] -> [T_p, k] */
    const float *const *router_w;             /* [P] -> [T_p, k] */
    const void *const *w_gate, *const *w_up, *const *w_down; /* [P] -> rank's experts */
    const void *s_gate, *s_up, *s_down;       /* shared weights: one copy, the same on all ranks;
                                                 NULL when I_s = 0 */
} mok_ref_layer;

mok_status mok_ref_forward(const mok_ref_layer *layer, void *const *y /* [P] -> [T_p, H] */);

/* Shared-weight gradients are per rank (each rank's own tokens), like the backends'. Gradients
 * are written as fp32 (no rounding), so tests compare before the backend's last rounding. */
mok_status mok_ref_backward(const mok_ref_layer *layer, const void *const *dy,
                            void *const *dx /* bf16 */, float *const *d_router_w,
                            float *const *dw_gate, float *const *dw_up, float *const *dw_down,
                            float *const *ds_gate, float *const *ds_up, float *const *ds_down);

/* bf16 helpers for callers that hold fp32 (round to nearest even; NaN stays NaN). */
uint16_t mok_bf16_from_float(float value);
float mok_bf16_to_float(uint16_t value);

#ifdef __cplusplus
}
#endif
#endif /* MOK_H */
