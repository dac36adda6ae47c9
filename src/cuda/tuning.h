/* tuning.h — the cuda backend's tuning knobs, in one table: each knob's name, the environment
 * variable that overrides it (only where a user needs one: the comparison and A/B switches the
 * tests and benchmarks set), its default and what it does. A workspace resolves the table once
 * per rank, when it is created (mok__cuda_tuning_resolve); its passes read the result and
 * mok_workspace_tuning shows it. The rules behind the defaults follow the table.
 *
 * Plain C (host and CUDA units alike, and the tests, which count a pass's tasks by the same
 * rules); only mok__cuda_comm_ctas_scaled also runs on the device (spans_kernel). */
#ifndef MOK_CUDA_TUNING_H
#define MOK_CUDA_TUNING_H

#include <stddef.h>
#include <stdint.h>

#include "core/portable.h"
#include "core/tasks.h"
#include "mok.h"

/* X(name, environment variable or NULL, default, what it does) */
#define MOK_CUDA_TUNING(X)                                                                                         \
    X(tma, "MOK_CUDA_TMA", "1 (0 where the driver has no tensor-map encoder)",                                    \
      "GEMM operands load through TMA where the operand allows; 0 (the variable set to 0): every load through "    \
      "cp.async, a comparison path that computes the same bits")                                                  \
    X(handoff, "MOK_CUDA_HANDOFF", "1",                                                                            \
      "a bf16 forward whose operands all load by TMA hands each gate|up tile's h to the producer warpgroup's "     \
      "warps 1-3 (megakernel/compute_walk.cuh, NOTE (handoff)); 0: the consumers compute and store it. The same " \
      "bits either way")                                                                                          \
    X(direct_rows, "MOK_CUDA_DIRECT_ROWS", "1",                                                                   \
      "the forward's down tiles and the backward's dx tiles (bf16 and FP8) store their rows straight from the "    \
      "accumulators, 16 bytes a lane after a transpose within each quad (megakernel/row_stores.cuh, "            \
      "store_direct), so they never wait for the staging region that a handoff or TMA stores still read; 0: "   \
      "through the staging tile, a comparison path. The same bits either way")                                   \
    X(raster, "MOK_CUDA_RASTER", "16 where an expert's gate|up weights exceed half the L2, else 1 (mok__cuda_raster)", \
      "the GEMM spans walk their row tiles in runs of this many (1..64; mok__span_tile), so that the CTAs on "  \
      "neighbouring tickets share a few weight panels in L2; 1: tile-major, where the weights stay in L2 anyway " \
      "and the shared activation tile is worth more")                                                             \
    X(cols_gateup, NULL, "the widest of 128, 64 that divides I and I_s",                                         \
      "columns of I, each of gate and up, per gate/up task (2 x 128 fill the 256-column tile)")                   \
    X(cols_dh, "MOK_CUDA_COLS_DH", "the widest of 256, 128, 64 that divides I and I_s",                          \
      "columns of I per SwiGLU-backward (dh) task (FP8: at least 128, whole scale blocks); the variable names "    \
      "256, 128 or 64 in place of the rule's. A 256-column task runs its main loop at the wide tile's rate; with "  \
      "minibatches of 4096 rows it was the fastest on every layer timed, I = 768 included (docs/log.md)")         \
    X(cols_h, "MOK_CUDA_COLS_H", "the widest of 256, 128, 64 that divides H",                                    \
      "columns of H per down and dx task; the variable caps it at 128 or 64")                                     \
    X(fwd_comm_ctas, NULL, "config.fwd_comm_sms, or for 0 mok__cuda_comm_ctas",                                   \
      "CTAs that move rows in the forward; with config 0, a pass whose transfers are turned scales it by its "    \
      "routing (mok__cuda_comm_ctas_scaled)")                                                                         \
    X(bwd_comm_ctas, NULL, "config.bwd_comm_sms, or for 0 mok__cuda_comm_ctas",                                   \
      "the same for the backward")                                                                               \
    X(stream_spans, "MOK_CUDA_STREAM_SPANS", "1",                                                                  \
      "a pass's task list is built inside the megakernel by one thread of its last CTA and published span by " \
      "span while the other CTAs run its first tasks (megakernel/task_list.cuh), instead of by spans_kernel "    \
      "before the megakernel starts (0). The same list and bits either way")

typedef struct mok_cuda_tuning {
#define MOK_X_KNOB(name, env, fallback, what) int name;
    MOK_CUDA_TUNING(MOK_X_KNOB)
#undef MOK_X_KNOB
} mok_cuda_tuning;

/* The table resolved for one rank: the config, the shape, the group's size, the rank's SMs and L2
 * bytes, whether the driver gave the tensor-map encoder, and the environment through `env` (getenv,
 * or a test's stand-in). */
void mok__cuda_tuning_resolve(mok_cuda_tuning *tuning, const mok_shape *shape, const mok_config *config, int nranks,
                              int num_sms, int64_t l2_bytes, int tma_found, const char *(*env)(const char *name));

/* "name=value" for every knob, separated by single spaces, into text (size bytes, NUL included);
 * returns the length the whole text needs, as snprintf does. */
size_t mok__cuda_tuning_format(const mok_cuda_tuning *tuning, char *text, size_t size);

/* Local rank 0's resolved table of a cuda workspace (workspace.cu; every rank resolves the same
 * table, its comm CTA counts from its own GPU's SMs). */
const mok_cuda_tuning *mok__cuda_workspace_tuning(const mok_workspace *ws);

/* ---- the rules behind the defaults ----------------------------------------------------------- */

/* A pass's comm CTAs when the config leaves them to the backend. A CTA copies scattered rows at a
 * rate that hardly depends on how it copies (megakernel/comm_walk.cuh), so the CTAs a pass needs grow with
 * the bytes its rows move per FLOP: 4·H bytes (in and out) against 6·H·I_eff FLOPs, I_eff = I +
 * I_s / k counting the shared expert's work per routed row, so ceil(bytes_term / I_eff) with a
 * floor:
 *   across ranks     12288, floor 10 forward, 16 backward;
 *   one rank         12288 forward, floor 8; 15360 backward, floor 12 (its pull brings dy and x
 *                    rows in, its push takes dx rows out, and its dh / dx tasks are shorter than
 *                    the forward's, so its comm tasks bound those phases);
 *   one rank, direct (its down / dx tiles store their rows into the (token, slot) rows
 *                    themselves, so the comm tasks move rows one way only): 9216, floor 4
 *                    forward (Qwen3's 12 beat 8 and 16 by 13-18%: with 8 its compute CTAs
 *                    idled 16-20% waiting for dispatched rows); 12288, floor 8 backward.
 * An FP8 backward (fp8) takes at least twice the floor: its pulls widen x^ as they copy (and
 * copy dy^, made once per token before the pass, backward_fp8.cuh). Where the bf16 count is the
 * floor, the bursts of pulls at each minibatch's start set it rather than their average rate,
 * and those bursts take twice the floor (DeepSeek-V3: 16 against 12 and 20). Qwen3 at its term's
 * 16: 4-6% faster than at 24 once dy^ came made (one H200, docs/log.md), where the pulls that
 * quantized dy themselves wanted 20-24.
 * At most a quarter of the SMs, and at least one SM left to compute. The floors and terms are the
 * counts that ran fastest on the measured layers (docs/log.md). */
int mok__cuda_comm_ctas(int64_t intermediate, int64_t shared_intermediate, int topk, int nranks, int backward,
                        int direct, int fp8, int num_sms);

/* Tiles per run of the GEMM spans' walk (mok__span_tile), from the bytes each wave of tiles brings
 * from memory. A 128 x 256 tile reads 128 activation rows and 256 weight rows of K values. Walking
 * runs of R row tiles, each run column panel by column panel, the W compute CTAs at work hold R
 * activation row blocks and about W / R weight panels: R·128 + (W / R)·256 rows per wave, least at
 * R = sqrt(2W), 16 for an H200's 120-128 compute CTAs. That only matters when an expert's weights
 * do not stay in L2 from one of its row tiles to the next: its gate|up weights (4·H·I bytes, the
 * largest weight operand) at most half the L2 are read from memory about once whatever the order,
 * and tile-major order (1) then keeps each activation row block hot for all its column tiles
 * instead. (In tile-major order Mixtral-8x7B's 235 MB of gate|up weights per expert were read once
 * per row tile, and the gate|up tiles ran at two thirds of the tensor cores' rate.) */
int mok__cuda_raster(int64_t hidden, int64_t intermediate, int compute_ctas, int64_t l2_bytes);

/* The widest of `widest`, its halves down to 64, that divides a and b (b = 0 divides). */
int mok__cuda_cols(int64_t a, int64_t b, int widest);

/* The comm CTAs of a pass whose transfers name peers (mok__plan_names_peers; else `balanced`):
 * `balanced`, the count for a balanced load (every rank receives as many rows as its tokens send,
 * own_rows = T·k), scaled by the rows this rank's comm tasks move per FLOP of its compute against
 * that case, within [1, max]. A pulled transfer moves the rows this rank receives (routed_rows),
 * a pushed or gathered one the rows of its own tokens (own_rows), whatever rank their experts are
 * on; the backward moves two rows (x, dy) per reverse-combined row; a recompute pass pulls.
 * Compute: routed_rows·I plus T·I_s. With the default directions a rank's moves follow its
 * compute, so `balanced` stays; with transfers turned around, the rank whose experts get most
 * rows gives CTAs to compute while the others take on its rows' moves. */
MOK_INLINE int mok__cuda_comm_ctas_scaled(const mok_plan *plan, int balanced, int max, int64_t own_rows,
                                      int64_t routed_rows) {
    const double S = (double)own_rows, R = (double)routed_rows;
    if (!mok__plan_names_peers(plan) || S <= 0 || R <= 0) return balanced;
    double moved, even;
    if (plan->recompute) {
        moved = R;
        even = S;
    } else if (plan->backward) {
        moved = 2 * (plan->combine_push ? S : R) + (plan->dispatch_pull ? S : R);
        even = 3 * S;
    } else {
        moved = (plan->dispatch_push ? S : R) + (plan->combine_pull ? S : R);
        even = 2 * S;
    }
    const double I = (double)plan->intermediate, shared = (double)plan->num_tokens * plan->shared_intermediate;
    const int n = (int)(balanced * (moved / even) * (S * I + shared) / (R * I + shared) + 0.5);
    return n < 1 ? 1 : n > max ? max : n;
}

#endif
