/* gpu_layer.h — a layer's buffers on the GPUs, as the cuda tests share them (test_cuda.c in bf16,
 * test_cuda_fp8.c in FP8): a group with rank p on GPU p, one workspace, every rank's inputs,
 * weights, y, schedule and context in device memory, and the copies and pass arguments over them.
 * Buffers are placed with mok_memory_alloc, so no CUDA header is needed. */
#ifndef MOK_TESTS_GPU_LAYER_H
#define MOK_TESTS_GPU_LAYER_H

#include <stddef.h>

#include "layer.h"

/* Device copies of one layer, a group and a workspace. */
typedef struct gpu_layer {
    mok_group *group;
    mok_workspace *ws;
    mok_sizes sizes;
    int nranks;
    void *x[MOK_MAX_RANKS], *ids[MOK_MAX_RANKS], *rw[MOK_MAX_RANKS], *w[3][MOK_MAX_RANKS], *s[3][MOK_MAX_RANKS];
    void *y[MOK_MAX_RANKS], *schedule[MOK_MAX_RANKS], *context[MOK_MAX_RANKS];
    char message[1024]; /* what failed */
} gpu_layer;

/* config (NULL: the defaults) with the layer's SwiGLU limit, and the peer timeout of
 * MOK_TEST_PEER_TIMEOUT_MS where set: under compute-sanitizer a pass runs far slower than the
 * default peer timeout allows. */
mok_config gpu_layer_config(const layer *L, const mok_config *config);

/* Clears G; then the group of L's ranks, a workspace of L's shape under gpu_layer_config and its
 * sizes, no buffers yet. A failure is noted in G->message ("group: ...", "workspace: ...",
 * "sizes: ..."). */
mok_status gpu_layer_create(gpu_layer *G, const layer *L, const mok_config *config);
/* Rank p's buffers: x, topk_ids and router_w of its tokens, each with `pad` bytes more; the expert
 * and shared weights; y of max_tokens rows; a schedule; a context. Nothing once *st is an error. */
void gpu_layer_upload_rank(gpu_layer *G, const layer *L, int p, size_t pad, mok_status *st);
/* Every rank's buffers, the workspace and the group freed; G cleared. Fine after a failed create. */
void gpu_layer_close(gpu_layer *G);

/* Returns st; where it is an error and G holds no message yet, notes "what: <mok_last_error>". */
mok_status gpu_layer_note(gpu_layer *G, mok_status st, const char *what);

/* A buffer of `bytes` (16 for 0) on rank p, holding host's bytes where host is given. Nothing, and
 * NULL, once *st is an error. */
void *gpu_layer_upload(gpu_layer *G, int p, const void *host, size_t bytes, mok_status *st);
/* `bytes` of `value` into rank p's buffer dev. */
mok_status gpu_layer_fill(gpu_layer *G, int p, void *dev, size_t bytes, int value);
/* A host copy (malloc, 16 bytes for 0) of `bytes` of rank p's buffer dev. */
void *gpu_layer_download(gpu_layer *G, int p, const void *dev, size_t bytes);
/* y of every rank's tokens into out (a result with y only, for layer_compare). */
void gpu_layer_download_y(gpu_layer *G, const layer *L, layer_result *out);

/* Issues the schedule build into G's schedules on `stream` (NULL: the default stream). */
mok_status gpu_layer_build(gpu_layer *G, const layer *L, void *stream);
/* Every rank's forward arguments over G's buffers, on `stream`, with fp8_weights[p] (NULL: none,
 * as for bf16). */
void gpu_layer_forward_args(const gpu_layer *G, const layer *L, void *stream, void *const *fp8_weights,
                            mok_forward_args *fa);

/* Runs the backward on the device after a forward (schedule and context in G), with fp8_weights[p]
 * (NULL: none), and downloads dx, d_router_w and every gradient into out. accumulate = 1: fp32
 * gradients starting from random values (kept in out->dw_init / ds_init for the comparison). */
mok_status gpu_layer_backward(gpu_layer *G, const layer *L, int accumulate, void *const *fp8_weights,
                              layer_result *out);

/* The layer on the GPUs (gpu_layer.h), the workspace's FP8 layout, and every rank's FP8 weights
 * buffer, written there by mok_quantize_weights. */
typedef struct gpu_fp8 {
    gpu_layer gpu;
    mok_fp8_layout layout;
    void *fp8[MOK_MAX_RANKS];
} gpu_fp8;

/* Group, workspace, the layer's tensors on the devices, and the FP8 weights quantized there (into
 * buffers filled with 0xa5, as layer.c fills the cpu's, so that their padding compares too). */
mok_status gpu_fp8_open(gpu_fp8 *G, const layer *L, const mok_config *config);
void gpu_fp8_close(gpu_fp8 *G);
/* Schedule and forward (recompute: mok_recompute_context) with y poisoned first, then synchronize. */
mok_status gpu_fp8_forward(gpu_fp8 *G, const layer *L, int recompute);

/* Reshaped values for FP8 layers (mode GPU_FP8_EXACT or GPU_FP8_SPREAD). Exact layers: every x
 * and dy value ±1 or ±1/2 times a power of two per (token, 128-block), every weight the same per
 * 128 x 128 block (exponents in [-6, 6]). The E4M3 codes are then ±256 or
 * ±128 and a block's partial sum a multiple of 2^14 below 2^23: exact on the tensor cores as in
 * fp32, so g, u and dy^ · W^_down are the same bits on every backend (mok.h: only the block
 * sums are the backend's). h, dg and du come through the sigmoid (fp32 on the backends, fp64 in
 * the reference); token rows where one of them sits so near a tie of its bf16 rounding that the
 * two could round apart, and E4M3 would see it, are redrawn (gpu_layer.c). Returns how many
 * token rows could not be steered so (0 for spread layers; -1 out of memory). Spread layers keep the random values and scale the same blocks by 2^-20 .. 2^4 (x)
 * and 2^-12 .. 2^4 (weights): blocks far apart in magnitude, many E4M3 subnormals. */
enum { GPU_FP8_EXACT = 1, GPU_FP8_SPREAD = 2 };
int64_t gpu_fp8_reshape(layer *L, int mode, uint64_t seed);
/* layer_make with the SwiGLU limit set, then gpu_fp8_reshape in mode (0: none) from the layer's
 * seed: 0; -1 when layer_make failed (L freed); 1 when rows were left at a tie. */
int gpu_fp8_layer(layer *L, const mok_shape *shape, int P, const int64_t *tokens, uint64_t seed, int routing,
                  float limit, int mode);

/* The workspace variants of the FP8 determinism tests: comm CTAs, minibatch and ring rows (0: the
 * defaults), the pass's transfers turned, the cp.async path (no_tma: MOK_CUDA_TMA=0 while its
 * workspace is created, which is when the tuning is read), the dh tiles' width (cols_dh:
 * MOK_CUDA_COLS_DH, 0 the rule's), the down and dx rows through the staging tile (staged_rows). */
typedef struct gpu_variant {
    int comm, minibatch, ring, turned, no_tma, cols_dh, staged_rows;
} gpu_variant;
#define GPU_VARIANTS {{0, 0, 0, 0, 0, 0, 0}, {1, 0, 0, 0, 0, 0, 0}, {7, 128, 256, 0, 0, 0, 0}, \
                      {2, 256, 512, 0, 0, 0, 0}, {0, 0, 0, 1, 0, 0, 0}, {0, 128, 384, 1, 0, 256, 0}, \
                      {0, 0, 0, 0, 1, 0, 0}, {0, 0, 0, 0, 0, 256, 0}, {0, 0, 0, 0, 0, 0, 1}}
/* Its config for the forward (backward 0: fwd_comm_sms, the dispatch pushed and the combine pulled)
 * or the backward (bwd_comm_sms, the reverse-combine pushed and the reverse-dispatch pulled). */
mok_config gpu_variant_config(const gpu_variant *v, int backward);
/* Around the workspace's creation: on = 1 sets MOK_CUDA_TMA=0 for a no_tma variant,
 * MOK_CUDA_COLS_DH for a cols_dh one and MOK_CUDA_DIRECT_ROWS=0 for a staged_rows one, on = 0
 * puts back what the environment held. */
void gpu_variant_env(const gpu_variant *v, int on);

#endif
