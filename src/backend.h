/* backend.h — what api.c dispatches to: a table of entry points per backend (mok_backend_ops),
 * picked once when a group is made (api.c: backend_ops) and kept in the group and its workspaces.
 * api.c validates every argument before it calls an entry point; an entry point validates only
 * what needs the backend's state (a schedule's or context's tag, a device). The cpu backend's
 * table is always built (cpu/ops.c), the cuda backend's with MOK_HAVE_CUDA (cuda/ops.c). */
#ifndef MOK_BACKEND_H
#define MOK_BACKEND_H

#include "internal.h"

typedef struct mok_backend_ops {
    mok_backend backend;
    /* Devices the backend can run on (0: none; the cpu backend: 1). */
    int (*device_count)(void);
    /* A group id (mok_unique_id_create): rank 0 makes it, the others get it from rank 0. */
    mok_status (*unique_id)(mok_unique_id *id);
    mok_status (*group_create)(mok_group *group, int rank, const mok_unique_id *id, const int *devices);
    void (*group_destroy)(mok_group *group);
    /* The group's state before a call, beside group->failed: MOK_OK, or the MOK_ERR_STATE of a
       failure a peer made. NULL: nothing more than group->failed. */
    mok_status (*group_check)(const mok_group *group);
    /* A collective call this rank refused before it reached the backend (`status`, its message in
       mok_last_error): tells the peers, which may already wait for this rank in the call's first
       barrier, so that they fail at once with a message naming it; returns the call's status. NULL:
       the peers learn of it otherwise. */
    mok_status (*refuse)(mok_group *group, const mok_call *call, mok_status status);
    mok_status (*workspace_create)(mok_workspace *ws);
    mok_status (*workspace_destroy)(mok_workspace *ws);
    mok_status (*schedule_build)(mok_workspace *ws, const mok_schedule_args *args);
    mok_status (*schedule_read)(mok_workspace *ws, const void *schedule, int local_rank, mok_sched_header *header);
    mok_status (*forward)(mok_workspace *ws, const mok_forward_args *args, int recompute);
    mok_status (*backward)(mok_workspace *ws, const mok_backward_args *args);
    /* mok_quantize_weights; NULL: the backend has no FP8 path. */
    mok_status (*quantize_weights)(mok_workspace *ws, const mok_quantize_args *args);
    mok_status (*trace_write)(mok_workspace *ws, const char *path);
    mok_status (*memory_alloc)(mok_group *group, int local_rank, size_t bytes, void **ptr);
    mok_status (*memory_free)(mok_group *group, int local_rank, void *ptr);
    mok_status (*memory_copy)(mok_group *group, int local_rank, void *dst, const void *src, size_t bytes,
                              mok_copy_kind kind);
    mok_status (*synchronize)(mok_workspace *ws);
} mok_backend_ops;

extern const mok_backend_ops mok__cpu_ops;
#ifdef MOK_HAVE_CUDA
extern const mok_backend_ops mok__cuda_ops;
#endif

/* The entry points the tables hold, by backend. */
#define MOK_BACKEND_FUNCS(prefix)                                                                  \
    mok_status prefix##_group_create(mok_group *group, int rank, const mok_unique_id *id,          \
                                     const int *devices);                                          \
    void prefix##_group_destroy(mok_group *group);                                                 \
    mok_status prefix##_workspace_create(mok_workspace *ws);                                       \
    mok_status prefix##_workspace_destroy(mok_workspace *ws);                                            \
    mok_status prefix##_schedule_build(mok_workspace *ws, const mok_schedule_args *args);          \
    mok_status prefix##_schedule_read(mok_workspace *ws, const void *schedule, int local_rank,     \
                                      mok_sched_header *header);                                   \
    mok_status prefix##_forward(mok_workspace *ws, const mok_forward_args *args, int recompute);   \
    mok_status prefix##_backward(mok_workspace *ws, const mok_backward_args *args);                \
    mok_status prefix##_trace_write(mok_workspace *ws, const char *path);                         \
    mok_status prefix##_memory_alloc(mok_group *group, int local_rank, size_t bytes, void **ptr);  \
    mok_status prefix##_memory_free(mok_group *group, int local_rank, void *ptr);                  \
    mok_status prefix##_memory_copy(mok_group *group, int local_rank, void *dst, const void *src,  \
                                    size_t bytes, mok_copy_kind kind);                             \
    mok_status prefix##_synchronize(mok_workspace *ws);

MOK_BACKEND_FUNCS(mok__cpu)
int mok__cpu_device_count(void);
mok_status mok__cpu_unique_id(mok_unique_id *id);
mok_status mok__cpu_group_check(const mok_group *group);
mok_status mok__cpu_refuse(mok_group *group, const mok_call *call, mok_status status);
mok_status mok__cpu_quantize_weights(mok_workspace *ws, const mok_quantize_args *args);
#ifdef MOK_HAVE_CUDA
MOK_BACKEND_FUNCS(mok__cuda)
int mok__cuda_device_count(void);
mok_status mok__cuda_unique_id(mok_unique_id *id);
mok_status mok__cuda_quantize_weights(mok_workspace *ws, const mok_quantize_args *args);
#endif

#endif
