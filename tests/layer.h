/* layer.h — a random MoE layer for P ranks, and the two ways tests compute it: the cpu backend
 * through the public API in local mode (one process drives every rank), and the reference
 * (mok_ref_forward / mok_ref_backward). layer_compare judges one against the other with the
 * tolerance table of layer.c.
 *
 * The one idea: every output buffer a backend run gets is poisoned first (bf16 0x7fc1, fp32 NaN),
 * or in accumulate mode filled with random fp32 starting values that the comparison subtracts
 * again, so an element the library forgot to write shows up as "unwritten", never as a pass.
 *
 * Typical use:
 *   layer L; layer_result got = {0}, ref = {0};
 *   layer_make(&L, &shape, P, tokens, seed, LAYER_ROUTE_UNIFORM);
 *   layer_run_backend(&L, &config, 0, &got);   layer_run_reference(&L, &ref);
 *   CHECK(layer_compare(&L, &got, &ref, "tag") <= 1.0, ...);
 *   layer_result_free(&got); layer_result_free(&ref); layer_free(&L);
 */
#ifndef MOK_TESTS_LAYER_H
#define MOK_TESTS_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

/* Routing: one mode, optionally OR'ed with the flags below. */
enum layer_routing {
    LAYER_ROUTE_UNIFORM = 0, /* softmax top-k of random logits: k distinct experts per token, router
                                weights the renormalised softmax of the chosen ones (positive) */
    LAYER_ROUTE_SKEWED,      /* the same with logits biased by 3 * (1 - e / (E - 1)): low ids hot */
    LAYER_ROUTE_ONE_EXPERT,  /* every slot of every token goes to L->hot_expert (ids repeat inside a
                                token); weights random positive, renormalised */
    LAYER_ROUTE_EVEN,        /* top-k among the even ids only: odd experts receive no rows (2k <= E) */
    LAYER_ROUTE_HOLES,       /* uniform, then about a quarter of the slots -1 and every fifth token all
                                -1; the router weight of a -1 slot is NaN (the library must not read it) */
    LAYER_ROUTE_NUM_MODES,
    LAYER_ROUTE_MODE_MASK = 0xff,
    LAYER_SIGNED_WEIGHTS = 0x100, /* router weights: about a quarter exactly 0, a quarter negative */
    LAYER_ENCODED = 0x200         /* x[t] encodes (rank, token) in its signs, slot j has router
                                     weight 2^-(j+1): a row or slot mix-up is an error of the size
                                     of the output, and layer_compare names the row it looks like */
};

enum { LAYER_GATE = 0, LAYER_UP = 1, LAYER_DOWN = 2 }; /* index of the three matrices below */

typedef struct layer {
    mok_shape shape;
    int nranks;
    int routing;        /* enum layer_routing value */
    uint64_t seed;      /* everything random in the layer (and accumulate-mode start values) */
    float swiglu_limit; /* 0 after layer_make; both layer_run_* use this value (it overrides the
                           config's) */
    int hot_expert;     /* LAYER_ROUTE_ONE_EXPERT: the expert every slot goes to; else -1 */
    int tensor_core_sums; /* FP8 layers: layer_compare uses the rows for a backend whose 128-K block
                             sums keep fewer bits than fp32 (the cuda tiles; layer.c says why); 0
                             after layer_make */
    int64_t num_tokens[MOK_MAX_RANKS];
    /* Per rank; NULL when the rank has no tokens. */
    uint16_t *x[MOK_MAX_RANKS];        /* [T_p, H] bf16 in [-1, 1], never 0 */
    uint16_t *dy[MOK_MAX_RANKS];       /* [T_p, H] bf16 in [-1, 1], never 0 */
    int32_t *topk_ids[MOK_MAX_RANKS];  /* [T_p, k] */
    float *router_w[MOK_MAX_RANKS];    /* [T_p, k] */
    /* The rank's experts: gate, up [E_local, I, H]; down [E_local, H, I]; uniform in
       ±sqrt(3 / fan_in), never 0. */
    uint16_t *w[3][MOK_MAX_RANKS];
    uint16_t *s[3]; /* the shared expert, one copy for every rank: [I_s, H], [I_s, H], [H, I_s];
                       NULL when I_s = 0 */
} layer;

/* Fills L. shape->max_tokens is raised to the largest tokens_per_rank (and to at least 1); the
 * other shape fields are used as given (the caller keeps them valid for the library). Returns 0,
 * or -1 when the routing mode cannot be built for the shape (LAYER_ROUTE_EVEN with 2k > E) or
 * memory runs out. */
int layer_make(layer *L, const mok_shape *shape, int nranks, const int64_t *tokens_per_rank,
               uint64_t seed, int routing);
void layer_free(layer *L);

/* With a SwiGLU limit, the clamp's gradient mask jumps where a g or u value rounds to the bf16
 * just above the limit instead of the one at or below it; an fp32 and an fp64 sum that straddle
 * that one rounding midpoint disagree by a whole gradient element, which no tolerance covers.
 * This redraws (uniform in [-1, 1], from a fresh stream) the x rows of tokens with a g or u value,
 * of the shared expert or any expert they are routed to, within 2^-16 of such a midpoint (for an
 * FP8 layer, g and u of the quantized x and weights). Call it after setting L->swiglu_limit.
 * Returns the number of rows redrawn. */
int layer_avoid_clamp_flips(layer *L);

/* Everything one run produced, backend or reference. A result starts zeroed ({0}) and is given
 * back with layer_result_free. */
typedef struct layer_result {
    int nranks;
    int grads_f32;                         /* weight gradients are fp32 (accumulate mode and the
                                              reference), else bf16 */
    uint16_t *y[MOK_MAX_RANKS];            /* [T_p, H] */
    uint16_t *dx[MOK_MAX_RANKS];           /* [T_p, H]; NULL until a backward ran */
    float *d_router_w[MOK_MAX_RANKS];      /* [T_p, k] */
    void *dw[3][MOK_MAX_RANKS];            /* the rank's experts, in the weights' layouts */
    void *ds[3][MOK_MAX_RANKS];            /* shared-expert gradient of the rank's own tokens */
    float *dw_init[3][MOK_MAX_RANKS];      /* accumulate mode: what dw held before the backward */
    float *ds_init[3][MOK_MAX_RANKS];
    void *schedule[MOK_MAX_RANKS];         /* backend only */
    void *context[MOK_MAX_RANKS];          /* backend only: the forward's context, poisoned with
                                              bf16 0x7fc1 before the forward */
    void *fp8_weights[MOK_MAX_RANKS];      /* backend only, FP8 layers: each rank's weights as
                                              mok_quantize_weights wrote them (before the forward,
                                              into a poisoned buffer) */
    size_t fp8_bytes;
    size_t schedule_bytes, context_bytes;
    mok_schedule_info info[MOK_MAX_RANKS]; /* mok_schedule_read of every rank */
    char message[1024];                    /* mok_last_error() of the call that failed */
} layer_result;

void layer_result_free(layer_result *r);

/* The poison patterns. */
#define LAYER_POISON_BF16 ((uint16_t)0x7fc1)
#define LAYER_POISON_F32_BITS 0x7fc0dead

/* A group and a workspace for layers of one shape on the cpu backend in local mode. The config's
 * swiglu_limit is replaced by L's; config may be NULL (defaults). A session may run several layers
 * of the same shape and nranks, interleaved (forward of one, forward of another, backward of the
 * first: one workspace serves many layers). */
typedef struct layer_backend {
    mok_config config;
    int nranks;
    mok_shape shape;
    mok_group *group;
    mok_workspace *workspace;
    mok_sizes sizes;
    char message[1024]; /* mok_last_error() of a failed open */
} layer_backend;

mok_status layer_backend_open(layer_backend *B, const layer *L, const mok_config *config);
void layer_backend_close(layer_backend *B);
/* Allocates out's forward buffers (poisoned), builds the schedule, reads every rank's
 * mok_schedule_info, runs the forward. */
mok_status layer_backend_forward(layer_backend *B, const layer *L, layer_result *out);
/* Allocates out's backward buffers (poisoned; accumulate = 1: fp32 gradients starting from random
 * values derived from L->seed, kept in dw_init / ds_init) and runs the backward with out's
 * schedule and context. */
mok_status layer_backend_backward(layer_backend *B, const layer *L, int accumulate, layer_result *out);
/* forward then backward */
mok_status layer_backend_run(layer_backend *B, const layer *L, int accumulate, layer_result *out);
/* open, run, close. */
mok_status layer_run_backend(const layer *L, const mok_config *config, int accumulate, layer_result *out);

/* The argument arrays (one per rank) that layer_backend_forward / _backward pass, for tests that
 * call mok_forward, mok_recompute_context or mok_backward themselves. */
void layer_forward_args(const layer *L, const layer_result *r, mok_forward_args *args);
void layer_backward_args(const layer *L, const layer_result *r, int accumulate, mok_backward_args *args);

/* The reference: y, dx (bf16), d_router_w and every gradient (fp32, unrounded). */
mok_status layer_run_reference(const layer *L, layer_result *ref);
/* Only y (the weight gradients of a full-size layer cost minutes on the host). */
mok_status layer_run_reference_forward(const layer *L, layer_result *ref);

/* Compares got (backend) with ref (reference), tensor by tensor, with the tolerance table of
 * layer.c (its FP8 rows for an FP8 layer): error = max |got - ref| / (atol + rtol * max |ref|), the max taken per block (one rank
 * of y, dx and the shared gradients; one expert of the routed gradients; all of d_router_w), so a
 * small expert is judged at its own scale. An element that is non-finite on one side only is an
 * infinite error (a poison value left in place is counted as unwritten); non-finite on both sides
 * is fine. A -1 slot must have d_router_w exactly 0. Skips the backward tensors when got has none.
 * Prints one line per failing tensor to stderr, beginning with tag, and returns the worst error
 * (<= 1 passes). */
double layer_compare(const layer *L, const layer_result *got, const layer_result *ref, const char *tag);

/* layer_compare of one rank: only got's arrays of `rank` are read (the others may be NULL), and
 * they are judged as layer_compare judges them (d_router_w's scale is still every rank's of ref).
 * For a process that ran one rank of a group against the reference of the whole layer. */
double layer_compare_rank(const layer *L, const layer_result *got, const layer_result *ref, int rank,
                          const char *tag);

/* layer_compare with every matrix judged per column_block columns (y, dx: a rank's rows; the
 * gradients: an expert's, or the shared expert's, rows), each block at its own scale: for layers
 * whose column blocks differ in magnitude by design. */
double layer_compare_columns(const layer *L, const layer_result *got, const layer_result *ref, int64_t column_block,
                             const char *tag);

/* 1 when every output of a and b (y, dx, d_router_w, gradients) is bitwise equal; else 0 and
 * what names the first difference. Both must come from the same layer and gradient type. */
int layer_equal(const layer *L, const layer_result *a, const layer_result *b, char *what, size_t what_size);

#endif
