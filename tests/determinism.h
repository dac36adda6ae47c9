/* determinism.h — the determinism check the cpu tests share (bf16 and FP8 layers alike): one layer
 * run on a backend opened with each config of a list, every output and gradient (and an FP8
 * layer's quantized weights) bitwise equal to the first config's first run, and that run right
 * against the reference. */
#ifndef MOK_TEST_DETERMINISM_H
#define MOK_TEST_DETERMINISM_H

#include <stddef.h>
#include <stdint.h>

#include "layer.h"

/* A config of the list: the fields the results must not depend on. */
typedef struct layer_variant {
    int minibatch, ring, threads, comm;
    int64_t context;
    int turned; /* every transfer in its other direction */
} layer_variant;

/* Runs L, both accumulate modes, on a backend opened with `base` changed by each variant (the first
 * one three times, on one workspace); `name` starts every message. */
void check_determinism(const char *name, const layer *L, mok_config base, const layer_variant *list, size_t count);

#endif
