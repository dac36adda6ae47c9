/* presets.h — the layers `mok run` knows by name, and how --scale shrinks one into a shape the
 * library accepts. A preset is a published MoE layer; scaling keeps its proportions (H : I : I_s,
 * E, k) so that a small run still exercises the same kind of routing and padding. */
#ifndef MOK_TOOLS_PRESETS_H
#define MOK_TOOLS_PRESETS_H

#include <stdint.h>

#include "mok.h"

typedef struct tools_preset {
    const char *name;             /* matched case-insensitively */
    int64_t hidden;               /* H */
    int64_t intermediate;         /* I of a routed expert */
    int64_t num_experts;          /* E */
    int64_t topk;                 /* k */
    int64_t shared_intermediate;  /* I_s; 0 = no shared expert */
    const char *note;
} tools_preset;

int tools_preset_count(void);
const tools_preset *tools_preset_at(int index);
const tools_preset *tools_preset_find(const char *name); /* NULL if unknown */

/* The shape of `preset` divided by `scale` (> 0; `mok run` takes 1 to TOOLS_SCALE_MAX) for a group
 * of `nranks` in `precision` (mok_precision): H, I and I_s are rounded to the nearest multiple of
 * tools_dim_unit(precision) (at least one; I_s = 0 stays 0), E to the nearest multiple of nranks
 * (at least nranks) and k is cut to E. At scale 1 the layer is kept exactly as published (every
 * preset's dimensions are multiples of both units), so the library itself checks that nranks
 * divides E. nranks < 1 is left for the library to reject (rounding then uses 1). */
mok_shape tools_preset_shape(const tools_preset *preset, double scale, int nranks, int64_t max_tokens,
                             int precision);

/* The multiple H, I and I_s are rounded to: MOK_DIM_TILE, or MOK_FP8_BLOCK under FP8 (whose scales
 * cover blocks of that many along every GEMM's K). */
int64_t tools_dim_unit(int precision);

/* Tokens per rank when --tokens is not given: 4096 at full size, else 16384 / S^2 within
 * [32, 4096], so that a scaled run with --check (whose reference is naive fp64) stays a matter
 * of seconds. */
int64_t tools_default_tokens(double scale);

#endif
