/* inputs.c — splitmix64 streams, the tensors filled from them (on every core), and the router of
 * random logits. */
#include "inputs.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mok.h"

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

tools_rng tools_rng_make(uint64_t seed, tools_stream stream, uint64_t index) {
    /* Mix each key through the generator so that neighbouring seeds, streams and indices start
     * far apart in the sequence. */
    uint64_t state = seed;
    uint64_t a = splitmix64(&state);
    state = a ^ ((uint64_t)stream * 0xd1b54a32d192ed03ull);
    uint64_t b = splitmix64(&state);
    state = b ^ (index * 0x8cb92ba72f3d8dd7ull);
    tools_rng rng = {splitmix64(&state)};
    return rng;
}

uint64_t tools_rng_next(tools_rng *rng) { return splitmix64(&rng->state); }

double tools_rng_uniform(tools_rng *rng) {
    return (double)(tools_rng_next(rng) >> 11) * 0x1.0p-52 - 1.0;
}

double tools_rng_gaussian(tools_rng *rng) {
    /* Box-Muller; u1 in (0, 1] keeps the log finite. */
    double u1 = ((double)(tools_rng_next(rng) >> 11) + 1.0) * 0x1.0p-53;
    double u2 = (double)(tools_rng_next(rng) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Round to nearest even; the values here are finite. Inline, since full-size layers fill
 * billions of weights. */
static inline uint16_t bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

void tools_fill_bf16(uint16_t *out, int64_t n, double bound, tools_rng *rng) {
    /* Four values per draw, each from 16 bits: 65536 evenly spaced levels, symmetric about 0,
     * are finer than bf16's 8-bit significand needs. */
    const float step = (float)(2.0 * bound / 65536.0), offset = (float)(bound * (1.0 / 65536.0 - 1.0));
    for (int64_t i = 0; i < n; i += 4) {
        uint64_t bits = tools_rng_next(rng);
        for (int64_t j = 0; j < 4 && i + j < n; ++j, bits >>= 16)
            out[i + j] = bf16_bits((float)(bits & 0xffffu) * step + offset);
    }
}

/* The tensors are taken in turn from a shared index, by as many threads as there are cores (at
 * most one per tensor); the calling thread is one of them, and does them all if no thread can
 * be started. */
typedef struct fill_work {
    tools_fill *fills;
    int64_t count;
    atomic_llong next;
} fill_work;

static void *fill_worker(void *arg) {
    fill_work *work = arg;
    for (int64_t i; (i = atomic_fetch_add(&work->next, 1)) < work->count;)
        tools_fill_bf16(work->fills[i].out, work->fills[i].n, work->fills[i].bound, &work->fills[i].rng);
    return NULL;
}

void tools_fill_bf16_many(tools_fill *fills, int64_t count) {
    enum { MAX_THREADS = 64 };
    fill_work work = {fills, count, 0};
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int64_t helpers = (cores > MAX_THREADS ? MAX_THREADS : cores < 1 ? 1 : cores) - 1;
    if (helpers > count - 1) helpers = count - 1;
    pthread_t threads[MAX_THREADS];
    int started = 0;
    while (started < helpers && pthread_create(&threads[started], NULL, fill_worker, &work) == 0) ++started;
    fill_worker(&work);
    for (int t = 0; t < started; ++t) pthread_join(threads[t], NULL);
}

double tools_weight_bound(int64_t fan_in) { return sqrt(3.0 / (double)fan_in); }

int tools_route(int32_t *ids, float *weights, int64_t tokens, int64_t num_experts, int64_t topk,
                double skew, tools_rng *rng) {
    /* logits [E], then the chosen experts' exp(logit - max) [k] */
    double *logits = malloc((size_t)(num_experts + topk) * sizeof *logits);
    if (!logits) return -1;
    double *chosen = logits + num_experts;
    for (int64_t t = 0; t < tokens; ++t) {
        double top = -INFINITY;
        for (int64_t e = 0; e < num_experts; ++e) {
            double bias = num_experts > 1 ? skew * (1.0 - (double)e / (double)(num_experts - 1)) : skew;
            logits[e] = tools_rng_gaussian(rng) + bias;
            if (logits[e] > top) top = logits[e];
        }
        /* The softmax denominator cancels in the renormalisation, so only exp(logit - max) of
         * the chosen experts matters. */
        double sum = 0.0;
        for (int64_t j = 0; j < topk; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; ++e)
                if (logits[e] != -INFINITY && (best < 0 || logits[e] > logits[best])) best = e;
            ids[t * topk + j] = (int32_t)best;
            chosen[j] = exp(logits[best] - top);
            sum += chosen[j];
            logits[best] = -INFINITY;
        }
        for (int64_t j = 0; j < topk; ++j) weights[t * topk + j] = (float)(chosen[j] / sum);
    }
    free(logits);
    return 0;
}
