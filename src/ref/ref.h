/* ref.h — the fp64 form of the naive reference, for tests that need more than the public
 * mok_ref_forward / mok_ref_backward: every array is fp64, and the rounding points of the
 * contract can be switched off, so that the layer becomes a smooth fp64 function whose
 * gradients can be checked against finite differences.
 *
 * With round = 1 these compute exactly what the public functions do (which are these functions
 * applied to the bf16/fp32 inputs widened to fp64): the outputs then hold bf16 values for y and
 * dx, and the unrounded fp64 sums for d_router_w and the weight gradients. With round = 0 no value
 * is rounded anywhere (g, u, h, expert outputs, dg, du, dx parts, w·dy, y, dx); the SwiGLU clamp
 * still applies. */
#ifndef MOK_REF_REF_H
#define MOK_REF_REF_H

#include <stdint.h>

#include "mok.h"

/* mok_ref_layer with fp64 arrays; layouts as in include/mok.h. Pointers of ranks without tokens
 * may be NULL; the shared pointers are NULL when shape->shared_intermediate = 0. */
typedef struct mok__ref_layer64 {
    const mok_shape *shape;
    int nranks;
    double swiglu_limit;                          /* > 0: clamp limit; 0: no clamp */
    const int64_t *num_tokens;                    /* [P] */
    const double *const *x;                       /* [P] -> [T_p, H] */
    const int32_t *const *topk_ids;               /* [P] -> [T_p, k] */
    const double *const *router_w;                /* [P] -> [T_p, k] */
    const double *const *w_gate, *const *w_up;    /* [P] -> [E_local, I, H] */
    const double *const *w_down;                  /* [P] -> [E_local, H, I] */
    const double *s_gate, *s_up;                  /* [I_s, H] */
    const double *s_down;                         /* [H, I_s] */
} mok__ref_layer64;

/* y[p] -> [T_p, H]. */
mok_status mok__ref_forward_ex(const mok__ref_layer64 *layer, double *const *y, int round);

/* dy, dx [P] -> [T_p, H]; d_router_w [P] -> [T_p, k]; dw_* [P] -> the rank's experts in the
 * weights' layouts; ds_* [P] -> [I_s, H] / [H, I_s], the gradient from rank p's tokens (NULL
 * when I_s = 0). Every output is overwritten. */
mok_status mok__ref_backward_ex(const mok__ref_layer64 *layer, const double *const *dy, int round,
                                double *const *dx, double *const *d_router_w,
                                double *const *dw_gate, double *const *dw_up,
                                double *const *dw_down, double *const *ds_gate,
                                double *const *ds_up, double *const *ds_down);

#endif
