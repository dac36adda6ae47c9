/* check.c — the tolerance tables of `mok run --check` (bf16 and FP8) and the comparison it uses. */
#include "check.h"

#include <math.h>
#include <string.h>

#include "mok.h"

/* Both sides round at the same points (g, u, h, every expert output, the sums), but the library
 * accumulates in fp32 in its own order and the reference in fp64, so now and then a value that
 * sits near a bf16 rounding boundary rounds the other way. A bf16 ulp is 2^-7 of the value at
 * the bottom of its binade (2^-8 at the top); one flip of g, u or h moves that row's expert
 * output by about one ulp of h. The tolerances are relative to the tensor's largest magnitude,
 * so elements near zero do not set the bar; a wrong row, slot, weight or expert makes an error
 * of the order of max |ref| and fails by far.
 *
 *  y, dx        bf16 outputs, each rounded once more at the end (at most half an ulp, 2^-8 of
 *               max |ref|). 2e-2 of max |ref| is 2.5 to 5 ulps of the largest element: room for
 *               the final rounding plus a few flipped intermediates landing on one element.
 *  d_router_w   fp32 dot products <dy, FFN_e(x)> over H; a flipped expert output element changes
 *               one term by |dy| * ulp. 3e-2 of max |ref|, as for the weight gradients.
 *  dw_*, ds_*   fp32 sums over every routed row of products of bf16 values (x, h, dy, and dg, du,
 *               which carry a flip of g, u or h into the row's whole outer product), rounded to
 *               bf16 by the library while the reference stays fp32 (up to 2^-8 of max |ref|
 *               from that rounding alone). 3e-2 of max |ref|.
 *
 * atol only matters for a tensor that is zero or nearly so (an expert with no rows has zero
 * gradients on both sides). */
static const tools_tolerance tolerances[TOOLS_NUM_TENSORS] = {
    [TOOLS_Y] = {"y", 2e-2, 1e-6},
    [TOOLS_DX] = {"dx", 2e-2, 1e-6},
    [TOOLS_D_ROUTER_W] = {"d_router_w", 3e-2, 1e-6},
    [TOOLS_DW_GATE] = {"dw_gate", 3e-2, 1e-6},
    [TOOLS_DW_UP] = {"dw_up", 3e-2, 1e-6},
    [TOOLS_DW_DOWN] = {"dw_down", 3e-2, 1e-6},
    [TOOLS_DS_GATE] = {"ds_gate", 3e-2, 1e-6},
    [TOOLS_DS_UP] = {"ds_up", 3e-2, 1e-6},
    [TOOLS_DS_DOWN] = {"ds_down", 3e-2, 1e-6},
};

/* FP8 (mok.h's FP8 section) against the FP8 reference, which quantizes the same bf16 values by the
 * same rule: the quantized operands are bitwise the same on both sides except where a bf16 value
 * that gets quantized (h, dg, du) flipped as above and the flip crosses an E4M3 rounding boundary,
 * which moves that one element by an E4M3 ulp (2^-3 of it). tests/layer.c's table has the
 * measurements behind these values (its worst errors over 530 random layers: y 7.8e-3, dx 8.6e-3,
 * d_router_w 1.3e-3, gradients 3.9e-3, all relative to the block's max |ref|, and a missing
 * quantization point 1.8e-2 or more); here max |ref| is the whole tensor's, at least the block's.
 *
 *  y            1.5e-2  the last bf16 rounding (a bf16 ulp of the largest element) plus one
 *                       flipped h^ element (2^-3 of one of at least 128 terms).
 *  dx           2e-2    the same, the flips coming from dg^, du^ (one of 2I terms).
 *  d_router_w   1e-2    the same operands on both sides, fp32 against fp64 dots, but for an h^ flip.
 *  dw_*, ds_*   1e-2    the library's bf16 rounding of the result (2^-8 of an element) and the
 *                       flips above; x^ is an input, bitwise equal on both sides. */
static const tools_tolerance tolerances_fp8[TOOLS_NUM_TENSORS] = {
    [TOOLS_Y] = {"y", 1.5e-2, 1e-6},
    [TOOLS_DX] = {"dx", 2e-2, 1e-6},
    [TOOLS_D_ROUTER_W] = {"d_router_w", 1e-2, 1e-6},
    [TOOLS_DW_GATE] = {"dw_gate", 1e-2, 1e-6},
    [TOOLS_DW_UP] = {"dw_up", 1e-2, 1e-6},
    [TOOLS_DW_DOWN] = {"dw_down", 1e-2, 1e-6},
    [TOOLS_DS_GATE] = {"ds_gate", 1e-2, 1e-6},
    [TOOLS_DS_UP] = {"ds_up", 1e-2, 1e-6},
    [TOOLS_DS_DOWN] = {"ds_down", 1e-2, 1e-6},
};

/* FP8 on a backend whose tensor cores sum each 128-K block with fewer bits than fp32 (the cuda
 * backend; mok.h leaves a block's sum to the backend): g, u and dh move by a bf16 ulp often, and
 * several percent of the h^, dg^, du^ elements flip by an E4M3 step instead of a rare one.
 * tests/layer.c derives and measures these rows (worst seen over random layers: y 3.7e-2, dx
 * 2.2e-2, d_router_w 5.3e-2, dw_down 3.9e-2, ds_down 2.4e-2, the other gradients within 1e-2). */
static const tools_tolerance tolerances_fp8_tensor_cores[TOOLS_NUM_TENSORS] = {
    [TOOLS_Y] = {"y", 5e-2, 1e-6},
    [TOOLS_DX] = {"dx", 3e-2, 1e-6},
    [TOOLS_D_ROUTER_W] = {"d_router_w", 8e-2, 1e-6},
    [TOOLS_DW_GATE] = {"dw_gate", 1e-2, 1e-6},
    [TOOLS_DW_UP] = {"dw_up", 1e-2, 1e-6},
    [TOOLS_DW_DOWN] = {"dw_down", 5e-2, 1e-6},
    [TOOLS_DS_GATE] = {"ds_gate", 1e-2, 1e-6},
    [TOOLS_DS_UP] = {"ds_up", 1e-2, 1e-6},
    [TOOLS_DS_DOWN] = {"ds_down", 5e-2, 1e-6},
};

tools_table tools_table_of(int precision, int backend) {
    if (precision != MOK_PRECISION_FP8) return TOOLS_TABLE_BF16;
    return backend == MOK_BACKEND_CUDA ? TOOLS_TABLE_FP8_TENSOR_CORES : TOOLS_TABLE_FP8;
}

const tools_tolerance *tools_tolerance_of(tools_tensor tensor, tools_table table) {
    return table == TOOLS_TABLE_FP8_TENSOR_CORES ? &tolerances_fp8_tensor_cores[tensor]
           : table == TOOLS_TABLE_FP8         ? &tolerances_fp8[tensor]
                                              : &tolerances[tensor];
}

static double element(const void *data, tools_dtype type, int64_t index) {
    if (type == TOOLS_BF16) return (double)mok_bf16_to_float(((const uint16_t *)data)[index]);
    return (double)((const float *)data)[index];
}

tools_error tools_compare(tools_tensor tensor, tools_table table, const void *got, tools_dtype got_type,
                          const void *ref, tools_dtype ref_type, int64_t count) {
    tools_error error = {0.0, 0.0, 0.0, -1};
    for (int64_t i = 0; i < count; ++i) {
        double a = element(got, got_type, i), b = element(ref, ref_type, i);
        double diff = fabs(a - b);
        if (!isfinite(a) || !isfinite(b)) diff = INFINITY; /* also catches an unwritten (NaN) element */
        if (isfinite(b) && fabs(b) > error.max_abs_ref) error.max_abs_ref = fabs(b);
        if (diff > error.max_abs_error || error.worst_index < 0) {
            error.max_abs_error = diff;
            error.worst_index = i;
        }
    }
    const tools_tolerance *tol = tools_tolerance_of(tensor, table);
    error.normalized = error.max_abs_error / (tol->atol + tol->rtol * error.max_abs_ref);
    return error;
}
