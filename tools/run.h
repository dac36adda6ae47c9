/* run.h — one `mok run`: its state (the group, the workspace, every rank's tensors, the timings)
 * and the steps that make and run it (run.c), report it (report.c) and check it against the
 * reference (verify.c). mok.c strings them together. */
#ifndef MOK_TOOLS_RUN_H
#define MOK_TOOLS_RUN_H

#include <stdint.h>

#include "buffers.h"
#include "check.h"
#include "mok.h"
#include "options.h"
#include "progress.h"

enum { PHASE_SCHEDULE, PHASE_FORWARD, PHASE_BACKWARD, PHASE_TOTAL, NUM_PHASES };
extern const char *const phase_names[NUM_PHASES];

/* One rank's tensors, in the layouts of mok.h. Shared-expert buffers mirror one host copy. */
typedef struct rank_tensors {
    int64_t tokens;
    int64_t remote_rows;                     /* (token, slot) pairs of other ranks routed here */
    tools_buffer x, dy;                      /* [T, H] bf16 */
    tools_buffer topk_ids, router_w;         /* [T, k] */
    tools_buffer w_gate, w_up, w_down;       /* [E_local, I, H], [E_local, H, I] */
    tools_buffer s_gate, s_up, s_down;       /* [I_s, H], [H, I_s]; empty when I_s = 0 */
    tools_buffer outputs[TOOLS_NUM_TENSORS]; /* y, dx, d_router_w, then the gradients (bf16);
                                                library memory only, read back for --check */
    tools_buffer schedule, context;          /* library memory only */
    tools_buffer fp8_weights;                /* FP8: mok_fp8_layout.bytes of library memory, written
                                                by mok_quantize_weights from the weights above */
} rank_tensors;

typedef struct run_state {
    const run_options *opt;
    mok_shape shape;
    int nranks;
    mok_backend backend;
    int64_t num_local_experts;
    int64_t tokens;        /* per rank as asked (0 allowed; shape.max_tokens is at least 1) */
    mok_group *group;
    mok_workspace *workspace;
    mok_sizes sizes;
    mok_fp8_layout fp8_layout;     /* FP8: one rank's FP8 weights (mok_workspace_fp8_layout); zero for bf16 */
    uint16_t *shared[3];   /* host copies of s_gate, s_up, s_down */
    rank_tensors *ranks;
    mok_schedule_args *schedule_args;
    mok_forward_args *forward_args;
    mok_backward_args *backward_args;
    mok_quantize_args *quantize_args; /* FP8 */
    double quantize_seconds;       /* FP8: the one mok_quantize_weights before the runs */
    double (*seconds)[NUM_PHASES]; /* [repeat]; NAN for a phase that did not run */
    uint64_t *output_hashes;       /* [repeat], with --check or --hash */
    double median[NUM_PHASES], min[NUM_PHASES], max[NUM_PHASES]; /* NAN: the phase never ran */
    int backward;                  /* the runs do the backward (no --no-backward) */
    tools_progress *progress;      /* may be NULL */
} run_state;

/* run.c. Each returns 0, or -1 with its message printed. */
int run_create_group(run_state *st);      /* the group (the config and the shape checked first) */
int run_create_workspace(run_state *st);  /* the workspace and its sizes */
int run_make_tensors(run_state *st);      /* every rank's inputs and outputs, the pass arguments */
int run_quantize_weights(run_state *st);  /* FP8: every rank's FP8 weights from its bf16 ones */
int run_passes(run_state *st);            /* the warm-up (cuda) and the --repeat timed runs */
int run_summarize(run_state *st);         /* median, min and max of each phase */
/* The workspace replaced by one of the same shape in `precision`, on the same inputs (the schedule
 * and context buffers grown where it needs more; no FP8 weights passed to a bf16 workspace). */
int run_switch_precision(run_state *st, mok_precision precision);
void run_destroy(run_state *st);

/* Tokens of rank `rank`: --tokens, or with --uneven T*(r+1)/P. */
int64_t run_rank_tokens(const run_state *st, int rank);

/* Elements of an output tensor for `tokens` tokens, and their bytes as the library writes them. */
int64_t run_tensor_count(const run_state *st, int64_t tokens, tools_tensor tensor);
size_t run_output_element(tools_tensor tensor);
int run_tensor_present(const run_state *st, tools_tensor tensor); /* the shared gradients need I_s > 0 */
int run_per_token(tools_tensor tensor); /* y, dx and d_router_w; the weight gradients sum over tokens */

/* report.c */
void report_layer(const run_state *st);   /* what runs: the layer, the config (before any run) */
void report_memory(const run_state *st);  /* the workspace's sizes */
int report_ranks(run_state *st);          /* the schedules and links of every rank */
void report_timings(const run_state *st);
int report_hashes(const run_state *st);   /* 1 when the runs wrote different bits */
/* The phases' medians of the bf16 runs (st) beside those of the FP8 runs (fp8_median). */
void report_beside(const run_state *st, const double fp8_median[NUM_PHASES]);
void report_format_bytes(char *out, size_t size, double bytes);

/* verify.c: the reference on the same inputs; returns 0 PASS, 1 FAIL, -1 error. */
int verify_against_reference(run_state *st);
int64_t verify_tokens(const run_options *opt, const mok_shape *shape); /* per rank; INT64_MAX = all */

#endif
