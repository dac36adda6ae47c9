/* buffers.h — the one place where `mok run` gets and moves the memory it hands the library.
 * Every tensor has a host copy (inputs are made there, outputs are checked there) and the
 * pointer the library receives. On the cpu backend the two are the same memory and moving data
 * is free; another backend (device memory) changes only this file. */
#ifndef MOK_TOOLS_BUFFERS_H
#define MOK_TOOLS_BUFFERS_H

#include <stddef.h>

#include "mok.h"

typedef struct tools_buffer {
    void *host;      /* host copy; NULL for a device-only buffer */
    void *device;    /* what the library gets */
    size_t bytes;
    int owns_host;   /* 0 when host is the caller's memory (a mirror) */
    int owns_device; /* 0 when device aliases host */
} tools_buffer;

/* Each returns 0 on success and -1 (with a message on stderr naming `what`) on failure. */
int tools_buffer_create(tools_buffer *buffer, mok_backend backend, size_t bytes, const char *what);
int tools_buffer_create_device(tools_buffer *buffer, mok_backend backend, size_t bytes,
                               const char *what);
/* A device copy of caller-owned host memory (the caller keeps it alive and frees it). */
int tools_buffer_mirror(tools_buffer *buffer, mok_backend backend, void *host, size_t bytes,
                        const char *what);
int tools_buffer_upload(const tools_buffer *buffer, mok_backend backend);
int tools_buffer_download(tools_buffer *buffer, mok_backend backend);
/* Fills the device memory with all-ones bytes: NaN in bf16 and fp32, so that an element the
 * library should have written and did not shows up in the comparison. */
int tools_buffer_poison(tools_buffer *buffer, mok_backend backend);
void tools_buffer_destroy(tools_buffer *buffer, mok_backend backend);

/* Host memory aligned for the library (MOK_ALIGN); never NULL for a successful 0-byte request. */
void *tools_host_alloc(size_t bytes);

#endif
