/* fp8.c — the FP8 entry points: the layout of a rank's FP8 weights, their quantization (validate,
 * then hand over to the backend) and the check every pass makes of the buffer it is given, plus
 * the E4M3 helpers for callers. The numerics live in core/fp8.h and core/fp8_weights.h. */
#include <stdio.h>
#include <string.h>

#include "core/fp8_weights.h"
#include "backend.h"

uint8_t mok_e4m3_from_float(float value) { return mok__e4m3_from_f32(value); }
float mok_e4m3_to_float(uint8_t value) { return mok__e4m3_to_f32(value); }

static mok_status require_fp8(const mok_workspace *ws) {
    if (!ws) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "workspace: must not be NULL");
    if (ws->shape.precision != MOK_PRECISION_FP8)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "workspace: its shape.precision is bf16; FP8 weights belong to MOK_PRECISION_FP8 workspaces");
    return MOK_OK;
}

mok_status mok_workspace_fp8_layout(const mok_workspace *ws, mok_fp8_layout *layout) {
    mok__clear_error();
    mok_status st = require_fp8(ws);
    if (st != MOK_OK) return st;
    if (!layout) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "layout: must not be NULL");
    mok__fp8_layout(&ws->shape, ws->num_local_experts, layout);
    return MOK_OK;
}

mok_status mok__check_fp8_weights(const mok_workspace *ws, int r, const void *fp8_weights) {
    if (ws->shape.precision != MOK_PRECISION_FP8) {
        if (fp8_weights)
            return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                             "args[%d].fp8_weights: must be NULL, the workspace's precision is bf16", r);
        return MOK_OK;
    }
    if (!fp8_weights)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "args[%d].fp8_weights: must not be NULL in an FP8 workspace (mok_quantize_weights writes it)",
                         r);
    char name[64];
    snprintf(name, sizeof name, "args[%d].fp8_weights", r);
    mok_status st = mok__check_ptr(fp8_weights, name, 1);
    if (st != MOK_OK) return st;
    /* Host memory on cpu: its header can be read here. (On cuda it is device memory.) */
    if (ws->group->backend == MOK_BACKEND_CPU &&
        !mok__fp8_header_matches(fp8_weights, &ws->shape, ws->num_local_experts))
        return mok__fail(MOK_ERR_INVALID_ARGUMENT,
                         "args[%d].fp8_weights: not written by mok_quantize_weights for this workspace's shape", r);
    return MOK_OK;
}

static mok_status check_weight(const void *ptr, int r, const char *field, int required) {
    char name[64];
    snprintf(name, sizeof name, "args[%d].%s", r, field);
    if (!required && ptr)
        return mok__fail(MOK_ERR_INVALID_ARGUMENT, "%s: must be NULL, the layer has no shared expert", name);
    return mok__check_ptr(ptr, name, required);
}

mok_status mok_quantize_weights(mok_workspace *ws, const mok_quantize_args *args) {
    mok__clear_error();
    mok_status st = require_fp8(ws);
    if (st != MOK_OK) return st;
    if (ws->failed || ws->group->failed)
        return mok__fail(MOK_ERR_STATE, "workspace: unusable after an earlier timeout or fault; destroy the group");
    if (!args) return mok__fail(MOK_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    const int has_shared = ws->shape.shared_intermediate > 0;
    for (int r = 0; r < ws->group->num_local_ranks; ++r) {
        const mok_quantize_args *a = &args[r];
        const struct {
            const void *ptr;
            const char *name;
            int required;
        } fields[] = {{a->w_gate, "w_gate", 1},          {a->w_up, "w_up", 1},
                      {a->w_down, "w_down", 1},          {a->s_gate, "s_gate", has_shared},
                      {a->s_up, "s_up", has_shared},     {a->s_down, "s_down", has_shared},
                      {a->fp8_weights, "fp8_weights", 1}};
        for (size_t f = 0; f < sizeof fields / sizeof fields[0]; ++f)
            if ((st = check_weight(fields[f].ptr, r, fields[f].name, fields[f].required)) != MOK_OK) return st;
    }
    if (!ws->ops->quantize_weights)
        return mok__fail(MOK_ERR_UNSUPPORTED, "mok_quantize_weights: the %s backend has no FP8 path yet",
                         mok_backend_name(ws->group->backend));
    return ws->ops->quantize_weights(ws, args);
}
