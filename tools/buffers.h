/* buffers.h — the one place where `mok run` gets and moves the memory it hands the library.
 * A tensor has a host copy (inputs are made there, outputs are checked there) and the pointer
 * the library receives, which lives where its local rank's backend wants it: host memory (cpu)
 * or device memory of the rank's GPU (cuda). Memory and copies go through mok_memory_alloc /
 * mok_memory_free / mok_memory_copy, so one code path serves both backends. On cpu a tensor's
 * host copy and library pointer are the same memory (uploads and downloads are free); on cuda
 * they are two allocations and every move is a copy. */
#ifndef MOK_TOOLS_BUFFERS_H
#define MOK_TOOLS_BUFFERS_H

#include <stddef.h>

#include "mok.h"

/* Where a buffer's library memory lives: a local rank of a group, whose backend is cpu or cuda
 * (the group's resolved backend, from mok_group_info). The group must outlive the buffer. */
typedef struct tools_place {
    mok_group *group;
    int local_rank;
    mok_backend backend;
} tools_place;

typedef struct tools_buffer {
    void *host;        /* host copy; NULL for a device-only buffer */
    void *device;      /* what the library gets (host memory on cpu) */
    size_t bytes;
    int owns_host;     /* 1: host is ours (tools_host_alloc); 0: the caller's, or an alias */
    int owns_device;   /* 1: device came from mok_memory_alloc; 0: it aliases host */
    tools_place place; /* where device lives */
    const char *what;  /* the tensor's name, for messages (a string literal) */
} tools_buffer;

/* Each returns 0 on success and -1 (with `mok run: ...` and the library's message on stderr,
 * naming `what`) on failure; a failed create leaves the buffer safe to destroy. */

/* Host copy and library memory (the same memory on cpu). */
int tools_buffer_create(tools_buffer *buffer, const tools_place *place, size_t bytes, const char *what);
/* Library memory only (schedules, contexts, outputs read back with tools_buffer_read). */
int tools_buffer_create_device(tools_buffer *buffer, const tools_place *place, size_t bytes,
                               const char *what);
/* Library memory for caller-owned host memory (the caller keeps it alive and frees it): on cpu
 * an alias of it, on cuda a device buffer that tools_buffer_upload fills. */
int tools_buffer_mirror(tools_buffer *buffer, const tools_place *place, void *host, size_t bytes,
                        const char *what);
/* host -> library memory, and back; no-ops when the two are the same memory. */
int tools_buffer_upload(const tools_buffer *buffer);
int tools_buffer_download(tools_buffer *buffer);
/* Copies bytes [offset, offset + bytes) of the library memory into host memory dst. */
int tools_buffer_read(const tools_buffer *buffer, size_t offset, void *dst, size_t bytes);
/* Fills the library memory with all-ones bytes (a copy from a host buffer of 0xff bytes): NaN in
 * bf16 and fp32, so that an element the library should have written and did not shows up in the
 * comparison. */
int tools_buffer_poison(tools_buffer *buffer);
/* Frees what the buffer owns (a failure is reported on stderr) and zeroes it; safe on a zeroed
 * or partly created buffer. Call it while the buffer's group exists. */
void tools_buffer_destroy(tools_buffer *buffer);

/* Host memory aligned for the library (MOK_ALIGN); never NULL for a successful 0-byte request. */
void *tools_host_alloc(size_t bytes);

#endif
