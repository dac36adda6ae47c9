/* tuning.c — resolves the cuda backend's tuning table (tuning.h) for a rank when its workspace is
 * created, formats it, and answers mok_workspace_tuning. Plain host C, built in every build: the
 * table and its rules are facts of the cuda backend that the tests check anywhere, and a cpu
 * workspace answers the call with no knobs. */
#include "cuda/tuning.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int mok__cuda_comm_ctas(int64_t intermediate, int64_t shared_intermediate, int topk, int nranks, int backward,
                        int direct, int fp8, int num_sms) {
    const int64_t i_eff = intermediate + (topk > 0 ? shared_intermediate / topk : 0);
    direct = direct && nranks == 1;
    const int64_t bytes_term = direct ? (backward ? 12288 : 9216) : nranks == 1 && backward ? 15360 : 12288;
    int comm = i_eff > 0 ? (int)ceil_div(bytes_term, i_eff) : 1;
    const int floor = direct ? (backward ? 8 : 4) : nranks == 1 ? (backward ? 12 : 8) : backward ? 16 : 10;
    if (comm < floor) comm = floor;
    if (fp8 && backward && comm < 2 * floor) comm = 2 * floor;
    const int cap = num_sms / 4 > 1 ? num_sms / 4 : 1;
    if (comm > cap) comm = cap;
    return comm < num_sms - 1 ? comm : num_sms - 1 > 1 ? num_sms - 1 : 1;
}

int mok__cuda_raster(int64_t hidden, int64_t intermediate, int compute_ctas, int64_t l2_bytes) {
    if (2 * 4 * hidden * intermediate <= l2_bytes || compute_ctas < 2) return 1;
    int run = 1; /* the power of two nearest sqrt(2 W) on a log scale: run^2 within a factor sqrt(2) of 2 W */
    while ((double)(2 * run) * (2 * run) <= 2.0 * compute_ctas * 1.41421356) run *= 2;
    return run;
}

int mok__cuda_cols(int64_t a, int64_t b, int widest) {
    int w = widest;
    while (w > 64 && (a % w != 0 || b % w != 0)) w /= 2;
    return w;
}

/* A column width from the environment: 256, 128 or 64 when the variable names one, else the rule's. */
static int cols_env(const char *(*env)(const char *), const char *name, int rule) {
    const char *v = env(name);
    const int cols = v ? atoi(v) : 0;
    return cols == 256 || cols == 128 || cols == 64 ? cols : rule;
}

/* The configured comm CTAs (at most all SMs but one), or the rule's for 0. With one rank and the
 * default combine (forward) or reverse-dispatch (backward) direction the down / dx tiles store
 * their rows themselves ("direct"). */
static int comm_ctas(const mok_shape *s, const mok_config *c, int nranks, int num_sms, int backward) {
    const int configured = backward ? c->bwd_comm_sms : c->fwd_comm_sms;
    if (configured > 0) return configured < num_sms - 1 ? configured : num_sms - 1;
    const int direct = backward ? c->bwd_dispatch == MOK_PUSH : c->fwd_combine == MOK_PUSH;
    return mok__cuda_comm_ctas(s->intermediate, s->shared_intermediate, (int)s->topk, nranks, backward, direct,
                               s->precision == MOK_PRECISION_FP8, num_sms);
}

void mok__cuda_tuning_resolve(mok_cuda_tuning *t, const mok_shape *s, const mok_config *c, int nranks, int num_sms,
                              int64_t l2_bytes, int tma_found, const char *(*env)(const char *name)) {
    const char *tma = env("MOK_CUDA_TMA");
    t->tma = tma_found && !(tma && tma[0] == '0');
    const char *handoff = env("MOK_CUDA_HANDOFF");
    t->handoff = !(handoff && handoff[0] == '0' && handoff[1] == '\0');
    const char *direct = env("MOK_CUDA_DIRECT_ROWS");
    t->direct_rows = !(direct && direct[0] == '0' && direct[1] == '\0');
    t->fwd_comm_ctas = comm_ctas(s, c, nranks, num_sms, 0);
    t->bwd_comm_ctas = comm_ctas(s, c, nranks, num_sms, 1);
    const char *raster = env("MOK_CUDA_RASTER");
    t->raster = raster ? atoi(raster) : 0;
    if (t->raster < 1 || t->raster > 64)
        t->raster = mok__cuda_raster(s->hidden, s->intermediate, num_sms - t->fwd_comm_ctas, l2_bytes);
    t->cols_gateup = mok__cuda_cols(s->intermediate, s->shared_intermediate, 128);
    t->cols_dh = mok__cuda_cols(s->intermediate, s->shared_intermediate,
                                cols_env(env, "MOK_CUDA_COLS_DH", 256));
    t->cols_h = mok__cuda_cols(s->hidden, 0, cols_env(env, "MOK_CUDA_COLS_H", 256));
    const char *stream = env("MOK_CUDA_STREAM_SPANS");
    t->stream_spans = !(stream && stream[0] == '0' && stream[1] == '\0');
}

size_t mok__cuda_tuning_format(const mok_cuda_tuning *t, char *text, size_t size) {
    size_t length = 0;
    const char *sep = "";
#define MOK_X_KNOB(name, env, fallback, what)                                                                  \
    {                                                                                                          \
        const int n = snprintf(length < size ? text + length : NULL, length < size ? size - length : 0,        \
                               "%s%s=%d", sep, #name, t->name);                                                \
        length += n > 0 ? (size_t)n : 0;                                                                       \
        sep = " ";                                                                                             \
    }
    MOK_CUDA_TUNING(MOK_X_KNOB)
#undef MOK_X_KNOB
    if (size > 0 && length >= size) text[size - 1] = '\0';
    return length;
}

mok_status mok_workspace_tuning(const mok_workspace *ws, char *text, size_t size) {
    mok__clear_error();
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    if (!text) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "text: must not be NULL");
    if (size == 0) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "size: must be at least 1 (the NUL)");
    size_t length = 0;
    text[0] = '\0'; /* the cpu backend has no tuning knobs */
#ifdef MOK_HAVE_CUDA
    if (ws->group->backend == MOK_BACKEND_CUDA) length = mok__cuda_tuning_format(mok__cuda_workspace_tuning(ws), text, size);
#endif
    if (length >= size) {
        text[0] = '\0';
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "size: %zu bytes do not hold the tuning text, which needs %zu",
                         size, length + 1);
    }
    return MOK_OK;
}
