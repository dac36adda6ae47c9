/* ops.c — the cuda backend's table of entry points (backend.h), in plain C beside the .cu files
 * that define them; built only with MOK_HAVE_CUDA (the Makefile). Its group's state is
 * group->failed alone, and it tells no peer of a call that a rank refuses before the backend: no
 * group_check, no refuse. */
#include "backend.h"

const mok_backend_ops mok__cuda_ops = {
    .backend = MOK_BACKEND_CUDA,
    .device_count = mok__cuda_device_count,
    .unique_id = mok__cuda_unique_id,
    .group_create = mok__cuda_group_create,
    .group_destroy = mok__cuda_group_destroy,
    .workspace_create = mok__cuda_workspace_create,
    .workspace_destroy = mok__cuda_workspace_destroy,
    .schedule_build = mok__cuda_schedule_build,
    .schedule_read = mok__cuda_schedule_read,
    .forward = mok__cuda_forward,
    .backward = mok__cuda_backward,
    .quantize_weights = mok__cuda_quantize_weights,
    .trace_write = mok__cuda_trace_write,
    .memory_alloc = mok__cuda_memory_alloc,
    .memory_free = mok__cuda_memory_free,
    .memory_copy = mok__cuda_memory_copy,
    .synchronize = mok__cuda_synchronize,
};
