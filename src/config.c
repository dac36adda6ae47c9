/* config.c — defaults and the rules of mok_config and mok_shape. Each rule's message names the
 * field and the rule, so a caller can fix the call from the message alone. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The longest peer timeout: 1e9 ms (11.6 days) keeps every deadline in int64 nanoseconds. */
#define MAX_PEER_TIMEOUT_MS 1e9
/* Comm threads per rank at most (cpu_threads = 0 adds them to one thread per core). */
#define MAX_CPU_COMM_THREADS 1024

int mok_version(void) { return MOK_VERSION; }
size_t mok_config_struct_size(void) { return sizeof(mok_config); }

mok_config mok_config_default(void) {
    mok_config config = MOK_CONFIG_INIT;
    return config;
}

uint16_t mok_bf16_from_float(float value) { return mok__bf16_from_f32(value); }
float mok_bf16_to_float(uint16_t value) { return mok__bf16_to_f32(value); }

static int is_direction(int d) { return d == MOK_PULL || d == MOK_PUSH; }

mok_status mok_config_validate(const mok_config *c) {
    if (!c) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config: must not be NULL");
    if (c->size != sizeof(mok_config))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.size: is %zu but this library's mok_config has %zu bytes (start from MOK_CONFIG_INIT)",
                         c->size, sizeof(mok_config));
    if (c->fwd_comm_sms < 0 || c->fwd_comm_sms > 1024)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.fwd_comm_sms: %d is not in [0, 1024] (0 = auto)",
                         c->fwd_comm_sms);
    if (c->bwd_comm_sms < 0 || c->bwd_comm_sms > 1024)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.bwd_comm_sms: %d is not in [0, 1024] (0 = auto)",
                         c->bwd_comm_sms);
    if (c->minibatch_rows < MOK_ROW_TILE || c->minibatch_rows % MOK_ROW_TILE != 0)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.minibatch_rows: %d is not a positive multiple of the row tile %d", c->minibatch_rows,
                         MOK_ROW_TILE);
    if (c->ring_rows < c->minibatch_rows)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.ring_rows: %d is smaller than one minibatch (minibatch_rows %d)", c->ring_rows,
                         c->minibatch_rows);
    if (c->ring_rows % c->minibatch_rows != 0)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.ring_rows: %d is not a multiple of minibatch_rows %d",
                         c->ring_rows, c->minibatch_rows);
    if (c->context_rows < 0)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.context_rows: %lld is negative (0 means all rows)",
                         (long long)c->context_rows);
    if (!(c->swiglu_limit >= 0.0f) || isinf(c->swiglu_limit))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.swiglu_limit: must be finite and >= 0 (0 = no clamp)");
    if (!(c->peer_timeout_ms > 0.0) || !(c->peer_timeout_ms <= MAX_PEER_TIMEOUT_MS))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.peer_timeout_ms: %g is not in (0, %.0e] (11.6 days)",
                         c->peer_timeout_ms, MAX_PEER_TIMEOUT_MS);
    if (c->cpu_threads < 0 || c->cpu_threads == 1 || c->cpu_threads > 1024)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.cpu_threads: %d must be 0 (the machine's cores) or in [2, 1024]", c->cpu_threads);
    if (c->cpu_comm_threads < 1 || c->cpu_comm_threads > MAX_CPU_COMM_THREADS)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.cpu_comm_threads: %d is not in [1, %d]",
                         c->cpu_comm_threads, MAX_CPU_COMM_THREADS);
    if (c->cpu_threads > 0 && c->cpu_comm_threads >= c->cpu_threads)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.cpu_comm_threads: %d must be >= 1 and leave at least one compute thread of "
                         "cpu_threads %d",
                         c->cpu_comm_threads, c->cpu_threads);
    if (!is_direction(c->fwd_dispatch) || !is_direction(c->fwd_combine) || !is_direction(c->bwd_combine) ||
        !is_direction(c->bwd_dispatch))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "config.fwd_dispatch/fwd_combine/bwd_combine/bwd_dispatch: each must be MOK_PULL or MOK_PUSH");
    if (c->trace != 0 && c->trace != 1)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "config.trace: %d must be 0 or 1", c->trace);
    return MOK_OK;
}

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 29);
}

uint64_t mok__protocol_digest(const mok_shape *s, const mok_config *c, int nranks) {
    uint32_t limit_bits;
    memcpy(&limit_bits, &c->swiglu_limit, sizeof limit_bits);
    const uint64_t fields[] = {(uint64_t)s->hidden, (uint64_t)s->intermediate, (uint64_t)s->num_experts,
                               (uint64_t)s->topk, (uint64_t)s->shared_intermediate, (uint64_t)s->max_tokens,
                               (uint64_t)s->precision, (uint64_t)nranks, (uint64_t)c->minibatch_rows,
                               (uint64_t)c->ring_rows, (uint64_t)c->context_rows, limit_bits,
                               (uint64_t)c->fwd_dispatch, (uint64_t)c->fwd_combine, (uint64_t)c->bwd_combine,
                               (uint64_t)c->bwd_dispatch};
    uint64_t h = 0x6d6f6b2070726f74ull;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; ++i) h = mix(h, fields[i]);
    return h;
}

/* NOTE: the fields here are the ones that change what ranks exchange or compute for each other:
 * the row blocks and ring (minibatch_rows, ring_rows), which rows the backward replays
 * (context_rows), the function the experts' owners compute (swiglu_limit) and who moves which rows
 * (the four directions). comm SMs, threads, the timeout and tracing stay each rank's own. */
int mok__config_protocol_diff(const mok_config *a, const mok_config *b, int their_rank, char *out, size_t size) {
#define DIFF_INT(field)                                                                                       \
    if (a->field != b->field) {                                                                               \
        snprintf(out, size, "config." #field ": this rank has %lld, rank %d has %lld", (long long)a->field,     \
                 their_rank, (long long)b->field);                                                             \
        return 1;                                                                                             \
    }
    DIFF_INT(minibatch_rows)
    DIFF_INT(ring_rows)
    DIFF_INT(context_rows)
    if (memcmp(&a->swiglu_limit, &b->swiglu_limit, sizeof a->swiglu_limit) != 0) {
        snprintf(out, size, "config.swiglu_limit: this rank has %g, rank %d has %g", (double)a->swiglu_limit,
                 their_rank, (double)b->swiglu_limit);
        return 1;
    }
    DIFF_INT(fwd_dispatch)
    DIFF_INT(fwd_combine)
    DIFF_INT(bwd_combine)
    DIFF_INT(bwd_dispatch)
#undef DIFF_INT
    return 0;
}

static int dim_ok(int64_t v) { return v >= MOK_DIM_TILE && v % MOK_DIM_TILE == 0 && v <= (1 << 20); }

mok_status mok_shape_validate(const mok_shape *s, int nranks) {
    if (!s) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape: must not be NULL");
    if (!dim_ok(s->hidden))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape.hidden: %lld is not a positive multiple of the tile %d",
                         (long long)s->hidden, MOK_DIM_TILE);
    if (!dim_ok(s->intermediate))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "shape.intermediate: %lld is not a positive multiple of the tile %d", (long long)s->intermediate,
                         MOK_DIM_TILE);
    if (s->shared_intermediate != 0 && !dim_ok(s->shared_intermediate))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "shape.shared_intermediate: %lld is neither 0 nor a positive multiple of the tile %d",
                         (long long)s->shared_intermediate, MOK_DIM_TILE);
    if (s->num_experts < 1 || s->num_experts > (1 << 20))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape.num_experts: %lld is not in [1, 2^20]",
                         (long long)s->num_experts);
    if (nranks < 1 || nranks > MOK_MAX_RANKS)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "nranks: %d is not in [1, %d]", nranks, MOK_MAX_RANKS);
    if (s->num_experts % nranks != 0)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "shape.num_experts: %lld is not divisible by the group size P = %d", (long long)s->num_experts,
                         nranks);
    if (s->topk < 1 || s->topk > s->num_experts)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape.topk: %lld is not in [1, num_experts = %lld]",
                         (long long)s->topk, (long long)s->num_experts);
    if (s->max_tokens < 1 || s->max_tokens > (1 << 24))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape.max_tokens: %lld is not in [1, 2^24]",
                         (long long)s->max_tokens);
    if ((int64_t)nranks * s->max_tokens * s->topk > INT32_MAX / 2)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "shape.max_tokens: P * max_tokens * topk = %lld routed slots exceed the 2^30 row limit",
                         (long long)nranks * s->max_tokens * s->topk);
    if (s->precision != MOK_PRECISION_BF16 && s->precision != MOK_PRECISION_FP8)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "shape.precision: %d is not a mok_precision", s->precision);
    /* FP8 scales cover blocks of MOK_FP8_BLOCK along every GEMM's K (H, I, I_s) */
    const struct {
        const char *name;
        int64_t value;
    } fp8_dims[] = {{"hidden", s->hidden}, {"intermediate", s->intermediate},
                    {"shared_intermediate", s->shared_intermediate}};
    for (int d = 0; s->precision == MOK_PRECISION_FP8 && d < 3; ++d)
        if (fp8_dims[d].value % MOK_FP8_BLOCK != 0)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "shape.%s: %lld is not a multiple of MOK_FP8_BLOCK = %d, which FP8 needs (its scales "
                             "cover blocks of %d)",
                             fp8_dims[d].name, (long long)fp8_dims[d].value, MOK_FP8_BLOCK, MOK_FP8_BLOCK);
    return MOK_OK;
}
