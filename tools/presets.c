/* presets.c — the preset table and its scaling. The first seven rows are public model layers;
 * the last four are the layers MoK benchmarks, each with one shared expert of the routed size. */
#include "presets.h"

#include <math.h>
#include <stddef.h>

static const tools_preset presets[] = {
    /* name                  H      I      E    k   I_s   note */
    {"qwen3-30b-a3b",      2048,   768,  128,  8,    0, "Qwen3-30B-A3B; DESIGN 6 single-GPU baseline"},
    {"qwen3-235b-a22b",    4096,  1536,  128,  8,    0, "Qwen3-235B-A22B"},
    {"deepseek-v3",        7168,  2048,  256,  8, 2048, "DeepSeek-V3; DESIGN 6 baseline"},
    {"kimi-k2",            7168,  2048,  384,  8, 2048, "Kimi K2"},
    {"glm-4.5",            5120,  1536,  160,  8, 1536, "GLM-4.5"},
    {"mixtral-8x7b",       4096, 14336,    8,  2,    0, "Mixtral 8x7B: few large experts"},
    {"olmoe-1b-7b",        2048,  1024,   64,  8,    0, "OLMoE-1B-7B"},
    {"kimi-k2.7",          7168,  2048,  384,  8, 2048, "MoK benchmark layer"},
    {"glm-5.2",            6144,  2048,  256,  8, 2048, "MoK benchmark layer"},
    {"qwen3.5-397b-a17b",  4096,  1024,  512, 10, 1024, "MoK benchmark layer"},
    {"deepseek-v4-pro",    7168,  3072,  384,  6, 3072, "MoK benchmark layer"},
};

int tools_preset_count(void) { return (int)(sizeof presets / sizeof presets[0]); }

const tools_preset *tools_preset_at(int index) {
    return index >= 0 && index < tools_preset_count() ? &presets[index] : NULL;
}

static int lower(int c) { return c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c; }

static int equal_ignoring_case(const char *a, const char *b) {
    for (; *a && *b; ++a, ++b)
        if (lower((unsigned char)*a) != lower((unsigned char)*b)) return 0;
    return *a == *b;
}

const tools_preset *tools_preset_find(const char *name) {
    for (int i = 0; i < tools_preset_count(); ++i)
        if (equal_ignoring_case(presets[i].name, name)) return &presets[i];
    return NULL;
}

/* The nearest multiple of `unit` to value / scale, at least one unit and at most the largest
 * multiple an int64_t holds (a scale near 0 asks for more; the library then refuses the shape). */
static int64_t scaled_multiple(int64_t value, double scale, int64_t unit) {
    const int64_t most = INT64_MAX / unit; /* units; (double)most may round up past it */
    double units = nearbyint((double)value / scale / (double)unit);
    if (!(units >= 1.0)) return unit;
    if (units >= (double)most) return most * unit;
    return (int64_t)units * unit;
}

int64_t tools_dim_unit(int precision) { return precision == MOK_PRECISION_FP8 ? MOK_FP8_BLOCK : MOK_DIM_TILE; }

mok_shape tools_preset_shape(const tools_preset *preset, double scale, int nranks, int64_t max_tokens,
                             int precision) {
    const int64_t unit = tools_dim_unit(precision);
    mok_shape shape;
    shape.hidden = scaled_multiple(preset->hidden, scale, unit);
    shape.intermediate = scaled_multiple(preset->intermediate, scale, unit);
    shape.shared_intermediate =
        preset->shared_intermediate == 0 ? 0 : scaled_multiple(preset->shared_intermediate, scale, unit);
    shape.num_experts = scale == 1.0 ? preset->num_experts
                                     : scaled_multiple(preset->num_experts, scale, nranks >= 1 ? nranks : 1);
    shape.topk = preset->topk < shape.num_experts ? preset->topk : shape.num_experts;
    shape.max_tokens = max_tokens;
    shape.precision = precision;
    return shape;
}

int64_t tools_default_tokens(double scale) {
    if (scale == 1.0) return 4096;
    /* A layer scaled by S does S^2 less work per token; taking 16384 / S^2 tokens as well keeps
     * the fp64 reference of a --check at --scale 16 (64 tokens per rank) to about a second. */
    double tokens = nearbyint(16384.0 / (scale * scale));
    return tokens < 32.0 ? 32 : (tokens > 4096.0 ? 4096 : (int64_t)tokens);
}
