/* inputs.h — deterministic random inputs for `mok run`. Every tensor draws from its own
 * splitmix64 stream, keyed by (seed, tensor, index): activations by rank, routed weights by
 * global expert id, so that the layer's weights are the same for every group size P. */
#ifndef MOK_TOOLS_INPUTS_H
#define MOK_TOOLS_INPUTS_H

#include <stdint.h>

typedef struct tools_rng {
    uint64_t state;
} tools_rng;

typedef enum tools_stream {
    TOOLS_STREAM_X = 1,
    TOOLS_STREAM_DY,
    TOOLS_STREAM_LOGITS,
    TOOLS_STREAM_W_GATE,
    TOOLS_STREAM_W_UP,
    TOOLS_STREAM_W_DOWN,
    TOOLS_STREAM_S_GATE,
    TOOLS_STREAM_S_UP,
    TOOLS_STREAM_S_DOWN
} tools_stream;

tools_rng tools_rng_make(uint64_t seed, tools_stream stream, uint64_t index);
uint64_t tools_rng_next(tools_rng *rng);
double tools_rng_uniform(tools_rng *rng);  /* [-1, 1) */
double tools_rng_gaussian(tools_rng *rng); /* N(0, 1) */

/* n bf16 values uniform in (-bound, bound), on a grid of 65536 levels. */
void tools_fill_bf16(uint16_t *out, int64_t n, double bound, tools_rng *rng);

/* One tensor for tools_fill_bf16_many: its values and the stream they come from. */
typedef struct tools_fill {
    uint16_t *out;
    int64_t n;
    double bound;
    tools_rng rng;
} tools_fill;

/* tools_fill_bf16 of every tensor in `fills`, on the machine's cores: each tensor draws from its
 * own stream, so the values are those of filling them one after another (a full-size layer's
 * weights are billions of values: tens of seconds on one core). */
void tools_fill_bf16_many(tools_fill *fills, int64_t count);

/* Uniform bound that gives a weight of fan-in `fan_in` the variance 1 / fan_in, so that a
 * product keeps the scale of its input. */
double tools_weight_bound(int64_t fan_in);

/* Routing of `tokens` tokens: logits ~ N(0, 1) plus a bias skew * (1 - e / (E - 1)) that makes
 * low expert ids hot (skew = 0: uniform; skew is the logit gap between expert 0 and expert E-1
 * in units of the logits' standard deviation); the top-k by logit (ties to the lower id), and
 * router weights = their softmax probabilities renormalised to sum to 1. ids [tokens, k],
 * weights [tokens, k]. Returns -1 when its scratch memory cannot be had, else 0. */
int tools_route(int32_t *ids, float *weights, int64_t tokens, int64_t num_experts, int64_t topk,
                double skew, tools_rng *rng);

#endif
