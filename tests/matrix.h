/* matrix.h — what the backend-against-reference matrix tests share (test_cpu_matrix.c in bf16,
 * test_cpu_fp8.c in FP8): case seeds, the tests' own random choices, the base config, and one case
 * run as make the layer → the reference once → the backend in one or both gradient modes, each run
 * compared and its empty experts checked. */
#ifndef MOK_TESTS_MATRIX_H
#define MOK_TESTS_MATRIX_H

#include "layer.h"

/* A case's layer seed: FNV-1a of its name from a start that `salt` changes (so two files' cases of
 * the same name draw different layers), mixed with MOK_TEST_SEED. */
uint64_t matrix_case_seed(const char *name, uint64_t salt);
/* The tests' own choices (token counts, which token to poison): splitmix64. */
uint64_t matrix_pick(uint64_t *state);
/* 128-row minibatches, a 256-row ring, two compute threads and one comm thread; a peer timeout
 * long enough for sanitizer builds on two cores, which are slow, not hung. */
mok_config matrix_config(void);

/* Rows of every global expert, counted from the layer's ids. */
void matrix_expert_rows(const layer *L, int64_t *rows);
/* Experts without rows: +0 bf16 gradients, or accumulate-mode buffers left bitwise as they were.
 * Returns how many experts have no rows. */
int matrix_check_empty_experts(const char *tag, const layer *L, const layer_result *r);

enum { MATRIX_BF16_GRADS = 1, MATRIX_BOTH_MODES = 2 };
/* A check of one backend run beyond the comparison (NULL: none). */
typedef void (*matrix_run_check)(const char *tag, const layer *L, const mok_config *config, const layer_result *r);

/* The reference once, then the backend with bf16 gradients (and in accumulate mode with
 * MATRIX_BOTH_MODES); each run compared within the layer's tolerance, checked by `extra`, and its
 * empty experts checked. */
void matrix_check_layer(const char *tag, const layer *L, const mok_config *config, int modes, matrix_run_check extra);
/* One case: make the layer of `seed`, set the SwiGLU limit (steering its inputs away from the
 * clamp's rounding midpoints, layer_avoid_clamp_flips), check it, free it. tokens: per rank. */
void matrix_run_case(const char *name, uint64_t seed, const mok_shape *shape, int P, const int64_t *tokens,
                     int routing, float limit, const mok_config *config, int modes, matrix_run_check extra);

#endif
